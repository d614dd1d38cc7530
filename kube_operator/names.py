"""Names, labels, ports and images shared by every renderer: change them here only."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from kvflow import IMAGE as KVFLOW_IMAGE
from kvflow import VLLM_VERSION
from kvflow.operator.spec import LLMService, PoolRole

Component = Literal["prefill", "decode", "both", "router", "gateway"]
"""A child's part of the service: an engine pool (by its role) or the router or the gateway."""
# An aggregated pool (role ``both``) is named and labelled for what it is.
POOL_COMPONENTS: dict[str, str] = {"prefill": "prefill", "decode": "decode", "both": "aggregated"}

FIELD_MANAGER = "kvflow-operator"
LABEL_SERVICE = "kvflow.io/service"
LABEL_ROLE = "kvflow.io/role"
LABEL_ENGINE = "kvflow.io/engine"
# The KV-cache compatibility of an engine pod (model, tokenizer, engine, block size, hash seed):
# the router pairs a prefill pod only with a decode pod of the same revision.
LABEL_REVISION = "kvflow.io/revision"
LABEL_LLMD_ROLE = "llm-d.ai/role"  # llm-d's scheduler tells prefill from decode by this
ANNOTATION_TEMPLATE_HASH = "kvflow.io/template-hash"
ANNOTATION_APPLIED_HASH = "kvflow.io/applied-hash"

# kvflow router, on the Inference Extension EPP's ports: ext_proc gRPC (TLS by default), gRPC
# health (plaintext, for kubelet probes; service "inference-extension"), /metrics + /healthz.
ROUTER_GRPC_PORT = 9002
ROUTER_HEALTH_PORT = 9003
ROUTER_HEALTH_SERVICE = "inference-extension"
ROUTER_METRICS_PORT = 9090
# Multi-node pools (LeaderWorkerSets): vLLM's data-parallel RPC port on the group's leader.
DATA_PARALLEL_RPC_PORT = 5555
# The label LeaderWorkerSet puts on every pod of a group: 0 on the leader.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# Engines publish KV events on this port (vLLM binds tcp://*:PORT); the router connects to each pod.
KV_EVENTS_PORT = 5557
# Router replicas publish what they route to each other here (render_peers.py, router/peers.py).
PEERS_PORT = 5571
CONFIG_DIR = "/etc/kvflow"
ROUTER_CONFIG_FILE = "router.yaml"
GATEWAY_CONFIG_FILE = "gateway.yaml"


# The image this repository builds (`make image`, the Dockerfile), named in kvflow/__init__.py,
# and vLLM's official image at the version kvflow's protocols are written against.
DEFAULT_KVFLOW_IMAGE = KVFLOW_IMAGE
DEFAULT_VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"


@dataclasses.dataclass(frozen=True, slots=True)
class Images:
    """Images of the kvflow components; the operator Deployment sets them via env."""

    kvflow: str = DEFAULT_KVFLOW_IMAGE
    vllm: str = DEFAULT_VLLM_IMAGE
    # The Dockerfile's nixl target: the simulator with NIXL, for simulated P/D pools.
    kvflow_nixl: str = f"{DEFAULT_KVFLOW_IMAGE}-nixl"

    @classmethod
    def from_env(cls) -> Images:
        kvflow = os.environ.get("KVFLOW_IMAGE", DEFAULT_KVFLOW_IMAGE)
        return cls(
            kvflow=kvflow,
            vllm=os.environ.get("KVFLOW_VLLM_IMAGE", DEFAULT_VLLM_IMAGE),
            kvflow_nixl=os.environ.get("KVFLOW_NIXL_IMAGE", f"{kvflow}-nixl"),
        )


def component_label(component: Component) -> str:
    """``app.kubernetes.io/component`` of a child, and the suffix of its name."""
    return POOL_COMPONENTS.get(component, component)


def child_name(svc: LLMService, component: Component) -> str:
    return f"{svc.name}-{component_label(component)}"


def pool_name(svc: LLMService) -> str:
    """The InferencePool's name: the service's own name, as users will reference it."""
    return svc.name


def selector_labels(svc: LLMService, component: Component) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvflow",
        "app.kubernetes.io/instance": svc.name,
        "app.kubernetes.io/component": component_label(component),
    }


def labels(svc: LLMService, component: Component) -> dict[str, str]:
    out = {
        **selector_labels(svc, component),
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        "app.kubernetes.io/part-of": "kvflow",
        LABEL_SERVICE: svc.name,
    }
    if component in POOL_COMPONENTS:
        out[LABEL_ROLE] = component
        out[LABEL_ENGINE] = "true"
        out[LABEL_LLMD_ROLE] = component
    return out


def engine_pool_selector(svc: LLMService) -> dict[str, str]:
    """Selects the pods of both pools: the router tells prefill from decode by LABEL_ROLE."""
    return {LABEL_SERVICE: svc.name, LABEL_ENGINE: "true"}


# llm-d's layout for P/D behind an Envoy gateway: the decode pod's routing sidecar takes the
# pool's target port and the engine moves this far up (8000 -> 8200).
SIDECAR_ENGINE_PORT_OFFSET = 200


def uses_sidecar(svc: LLMService, role: PoolRole) -> bool:
    """Decode pods need the P/D routing sidecar when an external Gateway (ext_proc) routes."""
    return role == "decode" and svc.spec.gateway.mode == "httpRoute"


def engine_port(svc: LLMService, role: PoolRole) -> int:
    """The port the engine itself listens on (and serves /metrics on)."""
    port = svc.spec.engine.port
    return port + SIDECAR_ENGINE_PORT_OFFSET if uses_sidecar(svc, role) else port
