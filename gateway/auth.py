"""Optional API-key authentication: keys from a file or a Kubernetes Secret.

A key file holds one key per line (``#`` comments allowed), or YAML with per-key settings::

    keys:
      - {key: sk-team-a, name: team-a, priority: 10, rate: 50, burst: 100}
      - {key: sk-batch, name: batch, priority: -5}
      - {key: sk-ops, name: ops, allow_headers: [x-kvflow-profile, x-kvflow-explain], admin: true}

``allow_headers`` lets that key choose a scheduling profile or a priority by header, or ask
where its request went (``x-kvflow-explain``); nobody else may (the headers are removed from
everyone else's requests). ``admin`` lets it read the status page and its API.

A Secret's data values hold the same text (each value is parsed; the keys of all values are
merged). Keys are looked up by their SHA-256 digest, so a lookup takes no time that depends
on how many leading characters of a guess were right.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvflow.errors import AuthenticationError
from kvflow.routing_headers import check_allowable
from kvflow.gateway.flow import Rate


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    priority: int | None = None
    rate: Rate | None = None
    allow_headers: frozenset[str] = frozenset()
    """kvflow routing headers this key may send (x-kvflow-profile, x-kvflow-priority, x-kvflow-explain)."""
    admin: bool = False
    """May read the status page and ``/v1/kvflow/status`` (``kvflow.router.status_api``)."""
    owner: str = field(default="", compare=False)
    """Who owns the key's batches and files: the name the operator gave it, or ``owner_of`` the key
    itself for an unnamed one; never its place in the file, so removing one key hands nothing of
    its to another. Empty: the name."""


ANONYMOUS = ApiKey(name="anonymous", owner="anonymous")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def owner_of(key: str) -> str:
    """An unnamed key's stable identity: a digest of the key (not the lookup digest), never the key."""
    return "sha256-" + hashlib.sha256(b"kvflow-owner\0" + key.encode()).hexdigest()[:32]


def parse_keys(text: str, *, prefix: str = "key") -> dict[bytes, ApiKey]:
    """Key digests → settings, from a key file's text (plain lines or YAML ``keys:``).

    Unnamed keys are called ``PREFIX-INDEX`` in logs and metrics; the key itself never is.
    """
    data = None
    if "keys:" in text:
        data = yaml.safe_load(text)
    if isinstance(data, dict):
        return dict(_yaml_entry(i, entry, prefix) for i, entry in enumerate(data.get("keys") or []))
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return {_digest(line): ApiKey(name=f"{prefix}-{i}", owner=owner_of(line))
            for i, line in enumerate(filter(None, lines))}


def _yaml_entry(index: int, entry: object, prefix: str) -> tuple[bytes, ApiKey]:
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not entry["key"]:
        raise ValueError(f"keys[{index}]: expected a mapping with a non-empty 'key'")
    rate = Rate(float(entry["rate"]), int(entry.get("burst", 1))) if entry.get("rate") else None
    priority = entry.get("priority")
    allowed = entry.get("allow_headers") or []
    if not isinstance(allowed, list) or not all(isinstance(h, str) for h in allowed):
        raise ValueError(f"keys[{index}]: allow_headers must be a list of header names")
    try:
        allowed = check_allowable(allowed)
    except ValueError as exc:
        raise ValueError(f"keys[{index}]: {exc}") from None
    name = entry.get("name")
    key = ApiKey(str(name or f"{prefix}-{index}"), None if priority is None else int(priority), rate,
                 frozenset(allowed), entry.get("admin") is True, owner=str(name) if name else owner_of(entry["key"]))
    return _digest(entry["key"]), key


def keys_from_secret_data(data: Mapping[str, str]) -> dict[bytes, ApiKey]:
    """A Secret's ``data`` (base64 values) as keys; every value is a key file's text."""
    keys: dict[bytes, ApiKey] = {}
    for field_name, value in sorted(data.items()):
        keys.update(parse_keys(base64.b64decode(value).decode(), prefix=field_name))
    return keys


def load_file(path: str | Path) -> dict[bytes, ApiKey]:
    return parse_keys(Path(path).read_text())


async def load_secret(ref: str) -> dict[bytes, ApiKey]:
    """Read ``NAMESPACE/NAME`` with the in-cluster (or kubeconfig) credentials."""
    from kubernetes_asyncio import client, config  # only a gateway configured with a Secret needs it

    namespace, _, name = ref.partition("/")
    if not name:
        raise ValueError(f"expected NAMESPACE/NAME for the API key Secret, got {ref!r}")
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    async with client.ApiClient() as api:
        secret = await client.CoreV1Api(api).read_namespaced_secret(name, namespace)
    return keys_from_secret_data(secret.data or {})


class Authenticator:
    """Checks ``Authorization: Bearer KEY``; with no keys configured everyone is anonymous."""

    def __init__(self, keys: Mapping[bytes, ApiKey] | None) -> None:
        self._keys = dict(keys) if keys is not None else None

    @property
    def enabled(self) -> bool:
        return self._keys is not None

    def renamed_owners(self) -> dict[str, str]:
        """Unnamed keys' ``PREFIX-INDEX`` names -> their owners: what a batch store written when
        owners were those names migrates by (``Store``'s schema version 1)."""
        return {k.name: k.owner for k in (self._keys or {}).values() if k.owner and k.owner != k.name}

    def rates(self) -> dict[str, Rate]:
        return {k.name: k.rate for k in (self._keys or {}).values() if k.rate is not None}

    def check(self, authorization: str | None) -> ApiKey:
        if self._keys is None:
            return ANONYMOUS
        if not authorization:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        key = self._keys.get(_digest(token.strip())) if scheme.lower() == "bearer" else None
        if key is None:
            raise AuthenticationError("invalid API key")
        return key
