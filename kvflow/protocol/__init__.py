"""The wire protocols kvflow speaks, each defined once.

kvflow talks to vLLM (and its simulator stands in for vLLM) in vLLM's own formats. Each format
has one module here: its field names, types, defaults and the parsing that validates what
arrives from another process. Components build and read these messages only through them, so a
vLLM release that changes a format changes one module (and the golden captures in
``tests/golden/`` that pin it).

    kv_transfer   ``kv_transfer_params``: vLLM 0.32 NixlConnector's P/D fields (router, prefill, decode)

Pure data and parsing: no I/O, and nothing here imports a component.
"""
