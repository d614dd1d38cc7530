"""kvflow sim: a vLLM-compatible model-server simulator (see docs/simulator.md).

Pure core (kvcache, request, scheduler, profiles, shapes, validation) in the middle; the engine
loop, ZMQ events, transfers and the aiohttp server at the edges.
"""
