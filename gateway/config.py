"""The gateway's configuration: one pydantic model, built from flags or a YAML/JSON file.

A config file says for many models what the command line says for one::

    host: 127.0.0.1
    port: 8080
    pools:
      - model: tiny-llama
        endpoints: [127.0.0.2:8000, 127.0.0.3:8000]
        prefill_endpoints: [127.0.0.4:8000]
        profile: pd
    flow: {max_inflight: 256, max_queue: 1024}
    auth: {keys_file: /etc/kvflow/keys.yaml}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvflow.endpoints import Endpoint, Role, parse_host_port
from kvflow.gateway.batch.config import BatchConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolConfig(_Strict):
    model: str
    endpoints: list[str] = Field(default_factory=list)
    """Decode (or aggregated) pods, HOST:PORT."""
    prefill_endpoints: list[str] = Field(default_factory=list)
    profile: str = "default"
    router_config: str | dict[str, Any] | None = None
    """A router config file or mapping (kvflow.router.load_config); None: the router's defaults."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer folder; None: kvflow's built-in tokenizer."""
    loras: list[str] = Field(default_factory=list)
    """LoRA adapter names the pods serve (vLLM ``--lora-modules``): requests naming one go to
    this pool, with the adapter passed to the router (LoRA affinity)."""

    @field_validator("endpoints", "prefill_endpoints")
    @classmethod
    def _host_ports(cls, values: list[str]) -> list[str]:
        for value in values:
            parse_host_port(value)  # a ValueError becomes a pydantic error naming the field
        return values

    def all_endpoints(self) -> list[Endpoint]:
        models = frozenset({self.model})
        roles = [(e, Role.PREFILL) for e in self.prefill_endpoints]
        decode_role = Role.DECODE if self.prefill_endpoints else Role.BOTH
        roles += [(e, decode_role) for e in self.endpoints]
        return [Endpoint(*parse_host_port(text), role=role, models=models) for text, role in roles]


class TimeoutConfig(_Strict):
    connect: float = Field(5.0, gt=0)
    """Seconds to open a connection to a pod."""
    first_byte: float = Field(300.0, gt=0)
    """Seconds from sending a request until the first byte of the answer (prefill included)."""
    idle: float = Field(60.0, gt=0)
    """Seconds an answer may stay silent between chunks once it has begun."""


class RateConfig(_Strict):
    rate: float = Field(gt=0)
    """Requests per second, sustained."""
    burst: int = Field(1, ge=1)


class FlowConfig(_Strict):
    max_inflight: int | None = Field(None, ge=1)
    """Requests per model sent upstream at once; None: unlimited (no queue)."""
    max_queue: int = Field(1024, ge=0)
    """Requests per model waiting for a slot; more are shed with 429."""
    queue_timeout: float = Field(30.0, gt=0)
    priority_header: str = "x-kvflow-priority"
    default_rate: RateConfig | None = None
    """A rate limit for each API key that sets none itself."""


class AuthConfig(_Strict):
    keys_file: str | None = None
    """One key per line, or YAML ``keys: [{key, name, priority, rate, burst}]``."""
    secret: str | None = None
    """A Kubernetes Secret ``NAMESPACE/NAME`` whose data holds keys in the same format."""

    @property
    def enabled(self) -> bool:
        return bool(self.keys_file or self.secret)


class GatewayConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, lt=65536)
    pools: list[PoolConfig] = Field(default_factory=list)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1)
    max_attempts: int = Field(3, ge=1)
    """Pods tried per request (the router's pick, then its fallbacks)."""
    timeouts: TimeoutConfig = TimeoutConfig()
    flow: FlowConfig = FlowConfig()
    auth: AuthConfig = AuthConfig()
    batch: BatchConfig = BatchConfig()
    """The Batch API (/v1/files, /v1/batches): where its database lives, how lines use idle capacity."""
    access_log: bool = True
    workers: int = Field(1, ge=1, le=64)
    """Processes sharing the port (SO_REUSEPORT); flow-control limits hold per worker."""

    @model_validator(mode="after")
    def _fixed_port_for_workers(self) -> GatewayConfig:
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers > 1 need a fixed port (each would pick its own)")
        return self

    @field_validator("pools")
    @classmethod
    def _unique_models(cls, pools: list[PoolConfig]) -> list[PoolConfig]:
        names = [name for p in pools for name in (p.model, *p.loras)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"models served by more than one pool: {', '.join(dupes)}")
        return pools


def load_file(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data
