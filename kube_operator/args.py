"""Every container command line the operator renders, in one place.

Keeping them here (and nowhere else) makes a flag rename in vLLM or in a kvflow component a
one-line change. Each function returns ``(command, args)``; Kubernetes expands ``$(VAR)``
references in them from the container's environment (used for the pod name in KV-event topics).
"""

from __future__ import annotations

import json
import shlex

from kvflow.operator import names, volumes
from kvflow.operator.spec import OBJECT_STORES, Engine, LLMService, PoolRole

def model_path(svc: LLMService) -> str:
    """Where the engine finds the model: a hub id, a bucket URL, or a path inside a mounted volume."""
    if svc.spec.model.scheme in OBJECT_STORES:
        return svc.spec.model.source
    return volumes.source_path(svc.spec.model.source, oci_dir=f"{volumes.MODELS_DIR}/oci")


def adapter_path(source: str) -> str:
    if source.startswith("oci://"):
        return volumes.adapter_dir(source)
    return volumes.source_path(source, oci_dir="")


def kv_events_endpoint(svc: LLMService) -> str:
    """The engine binds its publisher; the router connects to every pod on this port."""
    return f"tcp://*:{names.KV_EVENTS_PORT}"


def kv_events_config(svc: LLMService) -> str:
    return json.dumps({
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv_events_endpoint(svc),
        "topic": f"kv@$(POD_NAME)@{svc.spec.model.name}",
    }, separators=(",", ":"))


def kv_transfer_config(svc: LLMService) -> str:
    return json.dumps({
        "kv_connector": svc.spec.kv_transfer.connector,
        "kv_role": svc.spec.kv_transfer.kv_role,
        "kv_load_failure_policy": svc.spec.kv_transfer.load_failure_policy,
    }, separators=(",", ":"))


def _vllm_model_args(svc: LLMService) -> list[str]:
    spec = svc.spec
    args = [model_path(svc), "--served-model-name", spec.model.name]
    if spec.model.scheme in OBJECT_STORES:  # streamed from the bucket, never copied to disk
        args += ["--load-format", "runai_streamer"]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    tokenizer = volumes.engine_tokenizer(svc)
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    return args


def _parallelism_args(engine: Engine) -> list[str]:
    par = engine.parallelism
    args = ["--tensor-parallel-size", str(par.tensor), "--data-parallel-size", str(par.data)]
    if par.pipeline > 1:
        args += ["--pipeline-parallel-size", str(par.pipeline)]
    if par.data_local is not None:
        args += ["--data-parallel-size-local", str(par.local_ranks)]
    if par.expert:
        args.append("--enable-expert-parallel")
    return args


def vllm_engine(svc: LLMService, role: PoolRole, *, worker: bool = False) -> tuple[list[str], list[str]]:
    """vLLM's command line. In a multi-node pool (a LeaderWorkerSet group) the leader serves the
    API with the first ``dataLocal`` ranks; each worker runs its ranks ``--headless``, joining the
    leader at ``$(LWS_LEADER_ADDRESS)``."""
    spec = svc.spec
    engine = spec.engine_for(role)
    args = [
        *_vllm_model_args(svc),
        "--host", "0.0.0.0",
        "--port", str(names.engine_port(svc, role)),
        *_parallelism_args(engine),
        "--block-size", str(spec.engine.block_size),
        "--enable-prefix-caching" if spec.engine.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.kv_offloading_size is not None:  # vLLM's CPU tier for KV blocks the GPU evicts
        args += ["--kv-offloading-size", f"{engine.kv_offloading_size:g}", "--kv-offloading-backend", "native"]
    if spec.model.lora_adapters:  # adapters are loaded at run time (kvflow.operator.adapters)
        args.append("--enable-lora")
    if spec.kv_transfer.connector != "None" and spec.disaggregated:
        args += ["--kv-transfer-config", kv_transfer_config(svc)]
    if spec.routing.kv_events:
        args += ["--kv-events-config", kv_events_config(svc)]
    if engine.multi_node:
        args += ["--data-parallel-address", "$(LWS_LEADER_ADDRESS)",
                 "--data-parallel-rpc-port", str(names.DATA_PARALLEL_RPC_PORT)]
    args += list(engine.extra_args)
    if not engine.multi_node:
        return ["vllm", "serve"], args
    # A worker's first rank is its index in the group times the ranks per pod: shell arithmetic,
    # since Kubernetes' $(VAR) expansion cannot multiply.
    start = f"$((LWS_WORKER_INDEX * {engine.parallelism.local_ranks}))" if worker else "0"
    line = " ".join(["exec", "vllm", "serve", *(_shell(a) for a in args),
                     "--data-parallel-start-rank", start, *(["--headless"] if worker else [])])
    return ["/bin/sh", "-c"], [line]


def _shell(arg: str) -> str:
    """Quote for sh, leaving $(LWS_...) for the shell (Kubernetes leaves unknown $(VAR)s alone)."""
    if arg.startswith("$(") and arg.endswith(")"):
        return "$" + arg[2:-1].join("{}")
    return shlex.quote(arg)


def sim_engine(svc: LLMService, role: PoolRole) -> tuple[list[str], list[str]]:
    spec = svc.spec
    engine = spec.engine_for(role)
    args = [
        "sim",
        "--host", "0.0.0.0",
        "--port", str(names.engine_port(svc, role)),
        "--role", role,
        "--model", spec.model.name,
        "--block-size", str(spec.engine.block_size),
        "--enable-prefix-caching" if spec.engine.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.kv_offloading_size is not None:
        args += ["--kv-offloading-size", f"{engine.kv_offloading_size:g}", "--kv-offloading-backend", "native"]
    tokenizer = volumes.engine_tokenizer(svc)
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    if spec.model.lora_adapters:
        args += ["--enable-lora"]
    if spec.disaggregated and spec.kv_transfer.connector == "NixlConnector":
        args += ["--kv-transfer", "nixl", "--nixl-side-channel-port", str(spec.kv_transfer.side_channel_port)]
    if spec.routing.kv_events:
        args += ["--kv-events-config", kv_events_config(svc)]
    args += list(engine.extra_args)
    return ["kvflow"], args


def engine(svc: LLMService, role: PoolRole, *, worker: bool = False) -> tuple[list[str], list[str]]:
    if svc.spec.engine.kind == "sim":
        return sim_engine(svc, role)
    return vllm_engine(svc, role, worker=worker)


def routing_sidecar(svc: LLMService) -> tuple[list[str], list[str]]:
    """llm-d's routing sidecar: runs the prefill step the picker chose, then the local decode.

    It sends prompts only to this service's prefill pods: the names its headless Service resolves
    to (a client's ``x-prefiller-host-port`` naming anything else is refused)."""
    prefillers = f"{names.child_name(svc, 'prefill')}.{svc.namespace}.svc"
    return ["kvflow"], [
        "gateway", "--sidecar", "--upstream", f"127.0.0.1:{names.engine_port(svc, 'decode')}",
        "--host", "0.0.0.0", "--port", str(svc.spec.engine.port), "--allow-prefiller", prefillers,
    ]


TLS_DIR = f"{names.CONFIG_DIR}/tls"
CLIENT_CA_DIR = f"{names.CONFIG_DIR}/client-ca"


def router(svc: LLMService) -> tuple[list[str], list[str]]:
    """The Inference Extension EPP's ports and flags (its chart's), plus kvflow's config file."""
    tls = svc.spec.routing.tls
    args = [
        "router", "--config", f"{names.CONFIG_DIR}/{names.ROUTER_CONFIG_FILE}",
        "--host", "0.0.0.0", "--grpc-port", str(names.ROUTER_GRPC_PORT),
        "--grpc-health-port", str(names.ROUTER_HEALTH_PORT), "--metrics-port", str(names.ROUTER_METRICS_PORT),
        "--tokenizer", volumes.tokenizer_storage(svc)[1],
    ]
    if tls.mode == "Disabled":
        args += ["--no-secure-serving"]
    elif tls.mode == "Secret":
        args += ["--cert-path", TLS_DIR]
    if tls.client_ca_secret_name:
        args += ["--client-ca", f"{CLIENT_CA_DIR}/ca.crt"]
    return ["kvflow"], args


def gateway(svc: LLMService) -> tuple[list[str], list[str]]:
    # Host, port and the pool (with its router configuration) are in the config file.
    return ["kvflow"], ["gateway", "--config", f"{names.CONFIG_DIR}/{names.GATEWAY_CONFIG_FILE}"]
