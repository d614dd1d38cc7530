"""Pools from what the pods serve: ``kvflow gateway --endpoint H:P ...`` without ``--model``.

Like sglang-router and vllm-router, the gateway asks each pod's ``/v1/models`` at start-up and
serves what they serve: one pool per base model, with the pods that serve it, the LoRA adapters
they list (entries whose ``parent`` is the base model) and the context length they report. The
pods may still be starting: they are asked again until ``wait`` seconds have passed.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger("kvflow.gateway.discovery")

Listing = list[dict[str, Any]]
"""The ``data`` of one pod's ``/v1/models`` answer."""


def plan_pools(listings: Mapping[str, Listing], prefill: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Pool configs (``PoolConfig`` fields) from each pod's model list. Pure."""
    pools: dict[str, dict[str, Any]] = {}
    for address, listing in listings.items():
        for entry in listing:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or entry.get("parent"):
                continue
            pool = pools.setdefault(entry["id"], {"model": entry["id"], "endpoints": [], "prefill_endpoints": [],
                                                  "loras": [], "max_model_len": None})
            pool["prefill_endpoints" if address in prefill else "endpoints"].append(address)
            length = entry.get("max_model_len")
            if isinstance(length, int) and length > 0:
                pool["max_model_len"] = min(length, pool["max_model_len"] or length)
        for entry in listing:
            parent = entry.get("parent") if isinstance(entry, dict) else None
            if parent in pools and entry["id"] not in pools[parent]["loras"]:
                pools[parent]["loras"].append(entry["id"])
    return [pools[name] for name in sorted(pools)]


def fetch_models(address: str, timeout: float = 5.0) -> Listing:
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=timeout) as response:
        data = json.loads(response.read()).get("data")
    if not isinstance(data, list):
        raise ValueError(f"{address}/v1/models has no model list")
    return data


def discover(endpoints: Sequence[str], prefill: Sequence[str] = (), *, wait: float = 120.0,
             fetch: Callable[[str], Listing] = fetch_models, clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> list[dict[str, Any]]:
    """Ask every pod (before the gateway serves anything, so blocking is fine); ValueError when a
    pod still has not answered after ``wait`` seconds or when they serve nothing."""
    deadline = clock() + wait
    listings: dict[str, Listing] = {}
    pending = [*endpoints, *prefill]
    while pending:
        for address in list(pending):
            try:
                listings[address] = fetch(address)
                pending.remove(address)
            except (OSError, ValueError, urllib.error.URLError) as exc:
                if clock() >= deadline:
                    raise ValueError(f"cannot list the models of {address} ({exc}); give --model") from None
        if pending:
            log.info("waiting for %s to list their models", ", ".join(pending))
            sleep(1.0)
    pools = plan_pools(listings, prefill)
    if not pools:
        raise ValueError("the pods list no models; give --model")
    return pools
