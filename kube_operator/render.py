"""``render(svc) -> objects``: every child object of one LLMService, as plain dicts.

Pure and deterministic: the handlers and ``kvflow operator render`` call the same function, so
what the CLI prints is what the operator applies (before ``plan`` holds back a pool mid-rollout,
and fills in the key router replicas share, which only the cluster's Secret holds).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

from kvflow.operator import names
from kvflow.operator.objects import Obj, sort_for_apply
from kvflow.operator.render_control import (
    autoscaler_objects,
    gateway_objects,
    picker_objects,
)
from kvflow.operator.render_network import network_policies
from kvflow.operator.render_peers import peers_objects
from kvflow.operator.render_pools import render_pools
from kvflow.operator.spec import API_VERSION, KIND, LLMService, parse


def render(svc: LLMService, images: names.Images | None = None) -> list[Obj]:
    images = images or names.Images()
    objs = picker_objects(svc, images) + render_pools(svc, images)
    objs += gateway_objects(svc, images) + autoscaler_objects(svc) + peers_objects(svc)
    if svc.spec.network_policy.enabled:
        objs += network_policies(svc, metrics_from=svc.spec.network_policy.metrics_namespaces)
    return sort_for_apply(objs)


def load_services(documents: Iterable[Any]) -> list[LLMService]:
    """Pick and validate the LLMService documents of a multi-document YAML stream."""
    out = []
    for doc in documents:
        if isinstance(doc, dict) and doc.get("apiVersion") == API_VERSION and doc.get("kind") == KIND:
            out.append(parse(doc))
    return out


def render_yaml(text: str, images: names.Images | None = None) -> str:
    """Render every LLMService in a YAML stream; the output is a YAML stream of children."""
    services = load_services(yaml.safe_load_all(text))
    objs = [obj for svc in services for obj in render(svc, images)]
    return yaml.safe_dump_all(objs, sort_keys=False, width=120)
