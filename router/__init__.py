"""kvflow's router: the endpoint picker that sends each request to the pod that answers fastest.

Public API (what the gateway and the ext_proc server use)::

    config = load_config("router.yaml")          # or a dict, or None for the built-ins
    router = Router(config, endpoints, profile="default")
    await router.start()                          # scrape /metrics, subscribe to KV events
    result = router.schedule(SchedulingRequest(request_id, model, router.tokenize(body)))
    router.request_started(request, result); ...; router.request_finished(request, result, ok=True)
"""

from kvflow.router.config import RouterConfig, load_config
from kvflow.router.model import EndpointView, EngineMetrics, SchedulingRequest, SchedulingResult
from kvflow.router.router import Router

__all__ = [
    "EndpointView",
    "EngineMetrics",
    "Router",
    "RouterConfig",
    "SchedulingRequest",
    "SchedulingResult",
    "load_config",
]
