"""kvflow's router: the endpoint picker that sends each request to the pod that answers fastest.

Public API (what the gateway and the ext_proc server use)::

    config = load_config("router.yaml")          # or a dict, or None for the built-ins
    router = Router(config, endpoints, profile="default")
    await router.start()                          # scrape /metrics, subscribe to KV events
    flight = await router.route(Incoming(body, headers, request_id, size))   # body: client_body(raw)
    result = flight.result                        # targets[0] the pick, then fallbacks; P/D's prefill pod
    with flight:                                  # tell it each attempt; leaving it finishes the request
        flight.send(result.targets[0]); ...; flight.first_token()

``router.decide(SchedulingRequest(request_id, model, token_ids))`` is the same decision for a
caller that already holds the request's tokens (benchmarks, replays); it returns the ``Flight``
too. ``kvflow.router.flight`` says what each of its calls counts.
"""

from kvflow.router.config import RouterConfig, load_config
from kvflow.router.flight import Flight
from kvflow.router.model import EndpointView, EngineMetrics, SchedulingRequest, SchedulingResult
from kvflow.router.request import Incoming
from kvflow.router.router import Router

__all__ = [
    "EndpointView",
    "EngineMetrics",
    "Flight",
    "Incoming",
    "Router",
    "RouterConfig",
    "SchedulingRequest",
    "SchedulingResult",
    "load_config",
]
