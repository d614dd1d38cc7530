"""Plain typed data shared by the components: endpoints (model-server pods) and their roles."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

EndpointId = NewType("EndpointId", str)
"""``host:port`` of a model-server pod; unique within a pool."""


class Role(StrEnum):
    """What a pod does in disaggregated serving (llm-d's ``llm-d.ai/role`` label)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def serves_decode(self) -> bool:
        return self is not Role.PREFILL

    def serves_prefill(self) -> bool:
        return self is not Role.DECODE


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    role: Role = Role.BOTH
    models: frozenset[str] = field(default_factory=frozenset)
    """Served model names; empty means 'whatever the pod reports'."""
    name: str = ""
    """A pod name, where one is known (Kubernetes); KV-event topics carry it."""
    revision: str = ""
    """The pod's KV-cache revision (model, tokenizer, engine; the operator's
    ``kvflow.io/revision`` label): a prefill pod pairs only with a decode pod of the same one."""
    id: EndpointId = field(init=False, repr=False, compare=False)
    """``host:port``: made once, since a decision reads it a dozen times."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", EndpointId(f"{self.host}:{self.port}"))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def parse_host_port(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """``'127.0.0.2:8000'`` → ``('127.0.0.2', 8000)``; a clear ``ValueError`` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        return text, default_port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)
