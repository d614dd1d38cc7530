"""vLLM's ``GET /v1/models``: which LoRA adapters a pod has loaded, one parser and one fetch.

The list is where vLLM says what it serves: the base model's cards, then one card per loaded
adapter (``--lora-modules`` or ``/v1/load_lora_adapter``), whose ``parent`` is the base model
and whose ``root`` is the path it was loaded from. ``vllm:lora_requests_info`` does not say it:
that metric names only adapters with requests running or waiting. The router learns each pod's
adapters here (``router/scraper.py``), the operator compares them with the spec
(``kube_operator/adapters.py``).

A pod is not trusted: an answer that is not vLLM's shape is None (unknown), cards past
``MAX_CARDS`` or with over-long names are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aiohttp

MAX_CARDS = 1024
MAX_NAME = 1024


@dataclass(frozen=True, slots=True)
class ServedModels:
    base: frozenset[str]
    """Cards without a parent: the served model names."""
    adapters: Mapping[str, str]
    """Loaded LoRA adapters: served name → the path (``root``) they were loaded from."""


def parse_models(body: Any) -> ServedModels | None:
    """``/v1/models``'s JSON as (base names, adapters); None when it is not a model list."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    base: set[str] = set()
    adapters: dict[str, str] = {}
    for card in data[:MAX_CARDS]:
        name = card.get("id") if isinstance(card, dict) else None
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            continue
        parent, root = card.get("parent"), card.get("root")
        if isinstance(parent, str) and parent:
            adapters[name] = root if isinstance(root, str) else ""
        else:
            base.add(name)
    return ServedModels(frozenset(base), MappingProxyType(adapters))


async def fetch_models(session: aiohttp.ClientSession, url: str) -> ServedModels | None:
    """The pod's ``/v1/models`` at ``url``, or None when it failed, timed out or was not a list."""
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                return None
            body = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None
    return parse_models(body)
