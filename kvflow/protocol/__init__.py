"""The wire protocols kvflow speaks, one definition each, shared by the components.

Each module is one protocol as its peer (vLLM, the Inference Extension, NIXL) writes it: the
names and types on the wire and the code that encodes or decodes them, so a simulator that writes
a format and a router that reads it cannot drift apart. Part of the core: no module here imports
a component.

    vllm_metrics   vLLM's ``/metrics``: the families kvflow reads, one validating parser, one fetch
"""
