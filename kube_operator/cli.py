"""``kvflow operator render FILE`` and ``kvflow operator run``.

``kvflow/cli.py`` forwards ``kvflow operator ...`` here: ``kvflow.operator.cli.main(argv)``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import sys
from collections.abc import Sequence

from kvflow.operator import names
from kvflow.operator.spec import InvalidSpecError
from kvflow.cliargs import Parser


def parser() -> Parser:
    p = Parser(prog="kvflow operator", description="The kvflow Kubernetes operator.")
    sub = p.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", allow_abbrev=False, help="print, as YAML, every child object of the LLMService(s) in FILE")
    render.add_argument("file", help="a YAML file with LLMService documents ('-' for stdin)")
    render.add_argument("--kvflow-image", default=None, help="image of the kvflow components")
    render.add_argument("--vllm-image", default=None, help="default image of vLLM engines")
    run = sub.add_parser("run", allow_abbrev=False, help="run the operator (kopf) against the current cluster")
    run.add_argument("--namespace", "-n", action="append", default=[],
                     help="watch only this namespace (repeatable); default: all namespaces")
    run.add_argument("--interval", type=float, default=float(os.environ.get("KVFLOW_INTERVAL", "15")),
                     help="seconds between lifecycle rounds (stuck engines, scaling, rollouts)")
    run.add_argument("--server", default=os.environ.get("KVFLOW_KUBE_SERVER"),
                     help="API server URL (development only; default: in-cluster or kubeconfig)")
    run.add_argument("--liveness", default=os.environ.get("KVFLOW_LIVENESS", "http://0.0.0.0:8080/healthz"),
                     help="liveness endpoint URL (every replica serves it, a standby too; '' for none)")
    run.add_argument("--leader-election", action=argparse.BooleanOptionalAction,
                     default=os.environ.get("KVFLOW_LEADER_ELECTION", "true") != "false",
                     help="reconcile only while holding a Lease (default: on; run 2+ replicas for HA)")
    run.add_argument("--lease-name", default=os.environ.get("KVFLOW_LEASE_NAME", "kvflow-operator"),
                     help="the coordination.k8s.io Lease the replicas compete for")
    run.add_argument("--lease-namespace", default=os.environ.get("KVFLOW_LEASE_NAMESPACE"),
                     help="its namespace (default: the pod's, from POD_NAMESPACE or the service account)")
    run.add_argument("--verbose", "-v", action="store_true")
    return p


def _images(kvflow: str | None, vllm: str | None) -> names.Images:
    base = names.Images.from_env()
    return names.Images(kvflow=kvflow or base.kvflow, vllm=vllm or base.vllm)


def render_command(path: str, images: names.Images) -> int:
    from kvflow.operator.render import render_yaml

    import yaml

    try:
        text = sys.stdin.read() if path == "-" else pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"kvflow operator render: cannot read {path}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(render_yaml(text, images))
    except InvalidSpecError as exc:
        print(f"kvflow operator render: invalid LLMService in {path}: {exc}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:
        print(f"kvflow operator render: {path} is not YAML: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


def run_command(args: argparse.Namespace) -> int:
    from kvflow.operator.reconcile import OperatorConfig
    from kvflow.operator.run import RunOptions, run

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = OperatorConfig(interval=args.interval, images=_images(None, None), server=args.server)
    return asyncio.run(run(RunOptions(
        config=config, namespaces=tuple(args.namespace), liveness=args.liveness or None,
        leader_election=args.leader_election, lease_name=args.lease_name,
        lease_namespace=args.lease_namespace)))


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(argv) if argv is not None else None)
    if args.command == "render":
        return render_command(args.file, _images(args.kvflow_image, args.vllm_image))
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
