"""The wire protocols kvflow speaks, one definition each, shared by the components.

kvflow talks to vLLM (and its simulator stands in for vLLM) in vLLM's own formats. Each format
has one module here: its names and types on the wire and the code that encodes or decodes and
validates them, so a simulator that writes a format and a router that reads it cannot drift
apart, and a vLLM release that changes a format changes one module (and the golden captures in
``tests/golden/`` that pin it).

    kv_events      vLLM's ZMQ KV-cache events: the msgspec wire structs, the encoder the simulator
                   publishes with, the validating decoder the router reads with
    kv_transfer    ``kv_transfer_params``: vLLM 0.32 NixlConnector's P/D fields (router, prefill, decode)
    vllm_metrics   vLLM's ``/metrics``: the families kvflow reads, one validating parser, one fetch

Part of the core: pure data and parsing, and no module here imports a component.
"""
