"""The sim sample LLMService with spec sections merged in, and its rendering checked strictly:
what the replica and peers tests render."""

from __future__ import annotations

from typing import Any

import yaml
from operator_schemas import crd_errors, validate
from operator_tools import SAMPLES

from kvflow.operator import names
from kvflow.operator.render import render
from kvflow.operator.spec import LLMService, parse

IMAGES = names.Images(kvflow="ghcr.io/kvflow/kvflow:test", vllm="vllm/vllm-openai:test")
SECTION = {"router": "routing", "gateway": "gateway"}
"""The spec section that sets each component's replicas."""


def body(**spec: dict[str, Any]) -> dict[str, Any]:
    """The sim sample with ``spec`` sections merged in, checked by the CRD schema."""
    doc: dict[str, Any] = yaml.safe_load((SAMPLES / "sim.yaml").read_text())
    for section, fields in spec.items():
        doc["spec"][section] = {**doc["spec"].get(section, {}), **fields}
    assert crd_errors(doc) == []
    return doc


def service(**spec: dict[str, Any]) -> LLMService:
    doc = body(**spec)
    doc["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    return parse(doc)


def rendered(**spec: dict[str, Any]) -> list[dict[str, Any]]:
    """``service(**spec)``'s objects, each checked by the API's own (strict) schemas."""
    objs = render(service(**spec), IMAGES)
    for obj in objs:
        validate(obj)
    return objs
