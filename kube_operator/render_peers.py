"""Pure renderers for router replicas that tell each other what they routed (``router/peers.py``).

With more than one replica, each router (the endpoint picker's, or the one inside each kvflow
gateway) routes a share of the traffic and, without KV events, knows only its share of the
pool's prefixes; with events it still learns of its peers' requests only once their prefills
end. So a component with ``replicas > 1`` gets a ``peers`` section in its router config: every
replica publishes on ``PEERS_PORT`` and subscribes to every address of a headless Service that
selects the component's pods (``publishNotReadyAddresses``: a starting replica is heard before it
is ready), and all of them read one key, from a Secret, that signs their messages and keys their
block fingerprints alike. One replica renders none of this: its objects are what they were
before peers existed.

The key is the one thing here a renderer cannot make: it must be random, and the same in every
round, or the replicas of one rollout would hold different keys. ``secret`` renders the Secret
without its data; ``keep_key`` (called by ``plan``, which sees the cluster) fills in the key
the cluster's Secret already holds, or a fresh one the first time, and stamps an identifier of
it on the pod templates that mount it, so a key that does change (the Secret deleted, or a new
key written into it) rolls every replica onto the new one together.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
from collections.abc import Mapping
from typing import Any, Literal

from kvflow.operator import names, volumes
from kvflow.operator.objects import Obj, key, new
from kvflow.operator.spec import LLMService

Routing = Literal["router", "gateway"]
"""The components that run a router: the endpoint picker, and the kvflow gateway."""
ROUTING: tuple[Routing, ...] = ("router", "gateway")

KEY_DIR = f"{names.CONFIG_DIR}/peers"
KEY_FILE = "key"
KEY_PATH = f"{KEY_DIR}/{KEY_FILE}"
VOLUME = "peers-key"
PORT_NAME = "peers"
MIN_KEY_BYTES = 16
"""The shortest key ``router/peers.py`` accepts (after stripping whitespace)."""
ANNOTATION_KEY_ID = "kvflow.io/peers-key-id"
COMPONENT = "peers"
"""``app.kubernetes.io/component`` of the Secret (it belongs to no one component)."""


def enabled(svc: LLMService, component: Routing) -> bool:
    """Does ``component`` run as replicas that share what they route? Only kvflow's own routers
    do: GIE's EPP (``routing.picker: gie``) and an HTTPRoute to another Gateway run none."""
    if component == "gateway":
        return svc.spec.gateway.mode == "standalone" and svc.spec.gateway.replicas > 1
    return svc.spec.routing.picker == "kvflow" and svc.spec.routing.replicas > 1


def service_name(svc: LLMService, component: Routing) -> str:
    return f"{names.child_name(svc, component)}-peers"


def secret_name(svc: LLMService) -> str:
    """One key per LLMService, shared by the picker's and the gateway's replicas (each set
    subscribes only to its own Service, so they never hear each other)."""
    return f"{svc.name}-peers"


def config(svc: LLMService, component: Routing) -> dict[str, Any]:
    """The router config's ``peers`` section (``router/config.py``, ``PeersSpec``)."""
    return {"port": names.PEERS_PORT, "service": f"{service_name(svc, component)}.{svc.namespace}.svc",
            "keyFile": KEY_PATH}


def container_port() -> Obj:
    return {"name": PORT_NAME, "containerPort": names.PEERS_PORT, "protocol": "TCP"}


def storage(svc: LLMService) -> volumes.Storage:
    """The key, mounted read-only. ``items`` names the key: a Secret that has none yet keeps the
    pod waiting for it, never starting a router without one."""
    volume = {"name": VOLUME, "secret": {"secretName": secret_name(svc),
                                         "items": [{"key": KEY_FILE, "path": KEY_FILE}]}}
    return volumes.Storage((volume,), ({"name": VOLUME, "mountPath": KEY_DIR, "readOnly": True},))


def service(svc: LLMService, component: Routing) -> Obj:
    """The headless Service whose DNS name resolves to every replica of ``component``."""
    obj = new(svc, "v1", "Service", service_name(svc, component), component)
    obj["spec"] = {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": names.selector_labels(svc, component),
        "ports": [{"name": PORT_NAME, "port": names.PEERS_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
    }
    return obj


def secret(svc: LLMService) -> Obj:
    """The key's Secret, less the key (``keep_key`` adds it)."""
    obj = new(svc, "v1", "Secret", secret_name(svc), "router")
    obj["metadata"]["labels"]["app.kubernetes.io/component"] = COMPONENT  # the picker's and the gateway's
    obj["type"] = "Opaque"
    return obj


def peers_objects(svc: LLMService) -> list[Obj]:
    """Each sharing component's headless Service, and the Secret if any component shares."""
    sharing = [c for c in ROUTING if enabled(svc, c)]
    return [service(svc, c) for c in sharing] + ([secret(svc)] if sharing else [])


def new_key() -> str:
    """A fresh key, as the Secret's (base64) data holds it: 32 random bytes, in hex."""
    return base64.b64encode(secrets.token_hex(32).encode()).decode()


def usable(data: object) -> bool:
    """Is ``data`` (base64, as a Secret holds it) a key the routers accept?"""
    if not isinstance(data, str):
        return False
    try:
        return len(base64.b64decode(data, validate=True).strip()) >= MIN_KEY_BYTES
    except (binascii.Error, ValueError):
        return False


def key_id(data: str) -> str:
    """Names a key on the pod templates without giving any of it away."""
    return hashlib.blake2b(data.encode(), person=b"kvflow-key-id", digest_size=8).hexdigest()


def keep_key(apply: list[Obj], observed: Mapping[tuple[str, str, str], Obj], fresh: str | None) -> None:
    """Give the rendered peers Secret in ``apply`` its key, in place: the one the cluster's
    Secret holds if the routers can use it, else ``fresh``; and stamp its identifier on every
    pod template that mounts it. Without either key nothing is changed."""
    for obj in apply:
        if obj["kind"] != "Secret":
            continue
        have = (observed.get(key(obj)) or {}).get("data") or {}
        data = have.get(KEY_FILE) if usable(have.get(KEY_FILE)) else fresh
        if data is None:
            return
        obj["data"] = {KEY_FILE: data}
        for workload in apply:
            if workload["kind"] == "Deployment" and _mounts(workload, obj["metadata"]["name"]):
                template = workload["spec"]["template"]
                annotations = template["metadata"].setdefault("annotations", {})
                annotations[ANNOTATION_KEY_ID] = key_id(data)
        return


def _mounts(workload: Obj, secret: str) -> bool:
    pod_volumes = workload["spec"]["template"]["spec"].get("volumes") or []
    return any((v.get("secret") or {}).get("secretName") == secret for v in pod_volumes)

