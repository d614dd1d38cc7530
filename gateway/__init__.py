"""kvflow's OpenAI-compatible gateway: the embedded default in front of the router; its HTTP
edge also carries the decode pod's P/D sidecar (``kvflow.sidecar``) when Envoy routes.

    config = GatewayConfig(port=8080, pools=[PoolConfig(model="m", endpoints=["127.0.0.2:8000"])])
    await serve(config)                          # until cancelled
    running = await start_gateway(config)        # or: a handle (port, close()) for tests

Modules: ``app`` (routes, the one error/metrics/access-log edge), ``proxy`` (attempts, retries,
stream pass-through), ``pd`` (the NixlConnector protocol), ``flow`` (queues, priorities, rate
limits), ``auth``, ``metrics``, ``allowlist`` (the prefill pods the P/D sidecar, ``kvflow.sidecar``, trusts),
``body`` (client JSON and P/D fields at the trust boundary), ``httpserver``/``http1`` (the
HTTP/1.1 server, with its limits and timeouts, and client of the data path), ``config``, ``cli``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GatewayConfig", "PoolConfig", "serve", "start_gateway"]


def __getattr__(name: str) -> Any:  # lazy: `kvflow gateway --help` should not import the data path
    if name in ("GatewayConfig", "PoolConfig"):
        from kvflow.gateway import config

        return getattr(config, name)
    if name in ("serve", "start_gateway"):
        from kvflow.gateway import server

        return getattr(server, name)
    raise AttributeError(name)
