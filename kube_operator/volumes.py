"""Pure: the volumes, mounts and init containers that put models, adapters and tokenizers in pods.

One mapping from a source to a path inside the pod, used by every pod that reads it: engines
load the model and LoRA adapters from it, routers and gateways the tokenizer. A PVC is mounted
once per pod however many sources live on it; an ``oci://`` source is an image volume; the
tokenizer of an ``hf://`` model is fetched by an init container (``kvflow tokenizer fetch``),
since the engines' download cache is not shared with other pods.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re

from kvflow.operator.objects import Obj
from kvflow.operator.spec import LLMService

MODELS_DIR = "/models"
TOKENIZER_DIR = f"{MODELS_DIR}/tokenizer"
HF_CACHE_DIR = f"{MODELS_DIR}/hf-cache"
# Engine env entries an init container that fetches from the hub needs too.
HUB_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT")
BUILTIN_TOKENIZER = "builtin"


@dataclasses.dataclass(frozen=True, slots=True)
class Storage:
    volumes: tuple[Obj, ...] = ()
    mounts: tuple[Obj, ...] = ()
    init_containers: tuple[Obj, ...] = ()

    def __add__(self, other: Storage) -> Storage:
        volumes = {v["name"]: v for v in (*self.volumes, *other.volumes)}
        mounts = {m["mountPath"]: m for m in (*self.mounts, *other.mounts)}
        return Storage(tuple(volumes.values()), tuple(mounts.values()), self.init_containers + other.init_containers)


def _volume_name(prefix: str, key: str) -> str:
    """A DNS-label volume name, unique per key, readable where it fits."""
    clean = re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-")
    name = f"{prefix}-{clean}"
    return name if len(name) <= 63 else f"{name[:54]}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def cache_claim_name(svc: LLMService) -> str:
    """The claim the operator creates for ``model.cacheSize``."""
    return f"{svc.name}-model-cache"


def claim_dir(claim: str) -> str:
    return f"{MODELS_DIR}/{claim}"


def pvc_storage(claim: str, volume: str | None = None) -> Storage:
    name = volume or _volume_name("pvc", claim)
    return Storage((
        {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},), (
        {"name": name, "mountPath": claim_dir(claim), "readOnly": True},))


def oci_storage(reference: str, volume: str, path: str) -> Storage:
    return Storage(({"name": volume, "image": {"reference": reference, "pullPolicy": "IfNotPresent"}},),
                   ({"name": volume, "mountPath": path, "readOnly": True},))


def source_path(source: str, *, oci_dir: str) -> str:
    """Where ``source`` appears in a pod; an hf:// source stays the hub id (vLLM downloads it)."""
    scheme, location = source.split("://", 1)
    if scheme == "pvc":
        claim, _, sub = location.partition("/")
        return claim_dir(claim) + (f"/{sub}" if sub else "")
    if scheme == "oci":
        return oci_dir
    return location


def adapter_dir(source: str) -> str:
    location = source.split("://", 1)[1]
    return f"{MODELS_DIR}/adapters/{location.replace('/', '_').replace(':', '_')}"


def _source_storage(source: str, volume: str, oci_dir: str, model_claim: str | None) -> Storage:
    scheme, location = source.split("://", 1)
    if scheme == "pvc":
        claim = location.partition("/")[0]
        return pvc_storage(claim, "model" if claim == model_claim else None)
    if scheme == "oci":
        return oci_storage(location, volume, oci_dir)
    return Storage()


def _model_claim(svc: LLMService) -> str | None:
    model = svc.spec.model
    return model.location.partition("/")[0] if model.scheme == "pvc" else None


def engine_storage(svc: LLMService) -> Storage:
    """/dev/shm, the model (PVC, image volume, or the hub cache), and every LoRA adapter."""
    model = svc.spec.model
    # vLLM's native CPU offloading keeps its pool in shared memory: room for it too.
    offload = max((svc.spec.engine_for(role).kv_offloading_size or 0) for role in svc.spec.roles)
    shm = Storage(({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{8 + math.ceil(offload)}Gi"}},),
                  ({"name": "shm", "mountPath": "/dev/shm"},))
    storage = shm + _source_storage(model.source, "model", f"{MODELS_DIR}/oci", _model_claim(svc))
    if model.scheme == "hf":
        claim = model.cache_pvc or (cache_claim_name(svc) if model.cache_size else None)
        cache: Obj = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
        storage += Storage(({"name": "model-cache", **cache},), ({"name": "model-cache", "mountPath": HF_CACHE_DIR},))
    for index, adapter in enumerate(svc.spec.model.lora_adapters):
        storage += _source_storage(adapter.source, f"lora-{index}", adapter_dir(adapter.source), _model_claim(svc))
    tokenizer = svc.spec.model.tokenizer
    if tokenizer and (svc.spec.engine.kind == "sim" or not tokenizer.startswith("hf://")):
        storage += tokenizer_storage(svc)[0]  # vLLM downloads an hf:// tokenizer itself
    return storage


def engine_tokenizer(svc: LLMService) -> str | None:
    """The engine's ``--tokenizer``: only when the spec names one (else the model's own)."""
    tokenizer = svc.spec.model.tokenizer
    if not tokenizer:
        return None
    if svc.spec.engine.kind == "vllm" and tokenizer.startswith("hf://"):
        return tokenizer.removeprefix("hf://")
    return tokenizer_storage(svc)[1]


def tokenizer_source(svc: LLMService) -> str | None:
    """The served model's tokenizer source; None means kvflow's built-in (simulator engines)."""
    model = svc.spec.model
    if model.tokenizer:
        return model.tokenizer
    return None if svc.spec.engine.kind == "sim" else model.source


def tokenizer_storage(svc: LLMService) -> tuple[Storage, str]:
    """What a router or gateway pod needs to read the tokenizer, and the ``--tokenizer`` value."""
    source = tokenizer_source(svc)
    if source is None:
        return Storage(), BUILTIN_TOKENIZER
    model = svc.spec.model
    scheme, location = source.split("://", 1)
    if scheme == "pvc":
        return _source_storage(source, "tokenizer", "", _model_claim(svc)), source_path(source, oci_dir="")
    if scheme == "oci":
        same = source == model.source
        path = f"{MODELS_DIR}/oci" if same else f"{MODELS_DIR}/tokenizer-oci"
        return oci_storage(location, "model" if same else "tokenizer", path), path
    revision = model.revision if source == model.source and model.revision else "main"
    env = [dict(e) for e in svc.spec.engine.env if e.get("name") in HUB_ENV]
    fetch: Obj = {
        "name": "fetch-tokenizer", "image": "", "command": ["kvflow"],
        "args": ["tokenizer", "fetch", source, TOKENIZER_DIR, "--revision", revision],
        "volumeMounts": [{"name": "tokenizer", "mountPath": TOKENIZER_DIR}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
    }
    if env:
        fetch["env"] = env
    if model.credentials_secret and source == model.source:  # a gated model's token
        fetch["envFrom"] = [{"secretRef": {"name": model.credentials_secret}}]
    return Storage(({"name": "tokenizer", "emptyDir": {"sizeLimit": "256Mi"}},),
                   ({"name": "tokenizer", "mountPath": TOKENIZER_DIR, "readOnly": True},), (fetch,)), TOKENIZER_DIR


def with_image(storage: Storage, image: str, security: Obj) -> Storage:
    """Init containers run the kvflow image, locked down like the container they serve."""
    inits = tuple({**c, "image": image, "securityContext": security} for c in storage.init_containers)
    return dataclasses.replace(storage, init_containers=inits)

