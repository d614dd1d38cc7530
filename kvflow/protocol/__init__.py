"""The wire protocols kvflow speaks, each defined once, in the core (no component imports here):

    kvflow.protocol.kv_events  vLLM's ZMQ KV-cache events: the msgspec wire structs, the encoder
                               the simulator publishes with, the validating decoder the router reads with
"""
