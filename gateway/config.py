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
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvflow.endpoints import Endpoint, Role, parse_host_port
from kvflow.gateway.batch.config import BatchConfig
from kvflow.routing_headers import check_allowable


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
    """A local Hugging Face tokenizer folder, or "builtin"; None: the built-in one, except that a pool
    following Kubernetes with precise prefix routing refuses to start without one (router/tokenizer_policy.py)."""
    loras: list[str] = Field(default_factory=list)
    """LoRA adapter names the pods serve (vLLM ``--lora-modules``): requests naming one go to
    this pool, with the adapter passed to the router (LoRA affinity)."""
    max_model_len: int | None = Field(None, gt=0)
    """The pods' context length (``/v1/models``): longer prompts are refused with a 400 here."""
    hold_when_empty_seconds: float = Field(300.0, ge=0)
    """While no pod can decode for the pool (scaled to zero, or its first pod starting), requests
    wait this long for one to become ready, then get a 503; 0: the 503 at once (gateway/hold.py)."""

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
    """Towards the pods. A timed-out attempt is retried on the next candidate and counts against
    the pod's passive health (``router/outliers.py``)."""

    connect: float = Field(5.0, gt=0)
    """Seconds to open a connection to a pod."""
    first_byte: float = Field(60.0, gt=0)
    """Seconds from sending a request until the first chunk of a stream (prefill included)."""
    per_token: float = Field(0.2, ge=0)
    """A non-streamed answer comes whole: it gets ``first_byte`` plus this for each token it may
    generate (``max_tokens``, times ``n``) ..."""
    answer: float = Field(900.0, gt=0)
    """... and at most this many seconds (also when it sets no ``max_tokens``)."""
    prefill: float = Field(300.0, gt=0)
    """P/D: seconds for the prefill leg's answer (the whole prompt computed)."""
    batch: float = Field(3600.0, gt=0)
    """A Batch API line's whole answer."""
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
    """Read only for API keys (or everyone, ``allow_client_headers``) allowed to send it."""
    default_rate: RateConfig | None = None
    """A rate limit for each API key that sets none itself."""
    max_inflight_per_client: int | None = Field(None, ge=1)
    """Slots one client (API key, or address without authentication) may hold at once;
    None: no cap beyond ``max_inflight``. Waiting clients are served fairly either way."""


class HttpConfig(_Strict):
    """What one client connection may send and how long it may take (docs/gateway.md)."""

    max_request_line_bytes: int = Field(8192, ge=256)
    """Longer request lines (URLs): 414."""
    max_header_bytes: int = Field(65536, ge=1024)
    """More header bytes: 431."""
    max_headers: int = Field(100, ge=8)
    """More headers: 431."""
    header_timeout: float = Field(10.0, gt=0)
    """Seconds from a request's first byte to the end of its headers; then 408 and close."""
    body_timeout: float = Field(60.0, gt=0)
    """Seconds from the end of the headers to the end of the body; then 408 and close."""
    keep_alive_timeout: float = Field(60.0, gt=0)
    """Seconds an idle keep-alive connection stays open."""
    write_timeout: float = Field(60.0, gt=0)
    """Seconds a client may read nothing of its answer before it is dropped and its slot freed."""
    max_connections: int = Field(4096, ge=1)
    """Open client connections; beyond it idle ones are closed first, else newcomers get 503."""
    max_pipelined: int = Field(16, ge=1)
    """Requests read ahead on one connection before reading pauses."""
    max_json_depth: int = Field(64, ge=2)
    """Nesting of a JSON body; deeper: 400."""
    max_buffered_body_bytes: int = Field(256 << 20, ge=1)
    """Request body bytes all connections of one process hold at once; a body that does not fit is
    refused unread with 503 and Retry-After (one body is always admitted)."""


class AuthConfig(_Strict):
    keys_file: str | None = None
    """One key per line, or YAML ``keys: [{key, name, priority, rate, burst}]``."""
    secret: str | None = None
    """A Kubernetes Secret ``NAMESPACE/NAME`` whose data holds keys in the same format."""

    @property
    def enabled(self) -> bool:
        return bool(self.keys_file or self.secret)


SIDECAR_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/version")


class SidecarConfig(_Strict):
    """The decode pod's P/D sidecar (``kvflow gateway --sidecar``)."""

    prefillers: list[str] = Field(default_factory=list)
    """Prefill pods the sidecar may send a prompt to when ``x-prefiller-host-port`` names them:
    addresses, ``HOST:PORT``, networks (CIDR) or DNS names re-resolved every 10 s (a headless
    Service). Empty: the header is refused (400)."""
    paths: list[str] = Field(default_factory=lambda: list(SIDECAR_PATHS))
    """Paths passed to the local model server; others get a 404 (vLLM's admin and dev routes,
    a simulator's fault routes). The router's scrapes and the kubelet's probes need /metrics
    and /health."""

    @field_validator("prefillers")
    @classmethod
    def _entries(cls, entries: list[str]) -> list[str]:
        from kvflow.gateway.allowlist import PrefillerAllowList

        PrefillerAllowList(entries)  # a ValueError names the bad entry
        return entries


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
    http: HttpConfig = HttpConfig()
    client_kv_transfer_params: Literal["reject", "strip"] = "reject"
    """``kv_transfer_params`` in a client's body (P/D is the router's business): a 400, or removed."""
    allow_client_headers: list[str] = Field(default_factory=list)
    """kvflow routing headers every client may send (x-kvflow-profile, x-kvflow-priority);
    by default none, and an API key may allow them for itself (``allow_headers``)."""
    sidecar: SidecarConfig = SidecarConfig()
    workers: int = Field(1, ge=1, le=64)
    """Processes sharing the port (SO_REUSEPORT); flow-control limits hold per worker."""

    @model_validator(mode="after")
    def _fixed_port_for_workers(self) -> GatewayConfig:
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers > 1 need a fixed port (each would pick its own)")
        return self

    @field_validator("allow_client_headers")
    @classmethod
    def _allowable(cls, names: list[str]) -> list[str]:
        return check_allowable(names)

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
