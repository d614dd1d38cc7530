"""``kvflow sim``: one vLLM-compatible simulated model server (one process per simulated pod).

Flags mirror vLLM's where vLLM has them (``--model``, ``--served-model-name``, ``--block-size``,
``--max-num-seqs``, ``--max-model-len``, ``--lora-modules``, ``--prefix-caching-hash-algo``,
``--kv-events-config``, ``PYTHONHASHSEED``); the rest are the simulator's own (profiles, P/D
transfer, faults).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from kvflow.hashing import HASH_ALGOS, VLLM_UNSET_SEED
from kvflow.heap import settle_heap
from kvflow.sim.clock import Clock, MonotonicClock
from kvflow.sim.engine import Engine
from kvflow.sim.events import ZmqPublisher
from kvflow.sim.faults import Faults
from kvflow.sim.kv_transfer import DEFAULT_PIN_TIMEOUT_S, KVTransfer, TransferConfig, make_transfer
from kvflow.sim.lora import runtime_updating
from kvflow.sim.nixl.agent import NixlUnavailable
from kvflow.sim.metrics import SimMetrics, cache_config_info
from kvflow.sim.profiles import DEFAULT_PROFILE, PROFILES, Profile, get_profile
from kvflow.sim.request import HashConfig, LoraAdapter
from kvflow.sim.sampler import Sampler
from kvflow.sim.scheduler import Scheduler, SchedulerConfig
from kvflow.sim.server import SimState, build_app
from kvflow.sim.validation import ToolConfig
from kvflow.sim.shapes import system_fingerprint
from kvflow.tokenizer import load_tokenizer
from kvflow.cliargs import Parser

log = logging.getLogger("kvflow.sim")


def parser() -> Parser:
    p = Parser(prog="kvflow sim", description="A vLLM-compatible model-server simulator.")
    a = p.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--model", default="sim-model", help="model name, or a local model folder (its tokenizer is used)")
    a("--served-model-name", nargs="+", default=None, help="names the API serves (default: --model)")
    a("--tokenizer", default=None, help="a local Hugging Face tokenizer folder (default: built-in)")
    a("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    a("--block-size", type=int, default=16)
    a("--num-blocks", "--num-gpu-blocks-override", dest="num_blocks", type=int, default=None,
      help="KV pool size in blocks, the null block included (default: the profile's)")
    a("--max-num-seqs", type=int, default=256)
    a("--max-num-batched-tokens", type=int, default=None)
    a("--max-model-len", type=int, default=8192)
    a("--seed", type=int, default=0)
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    a("--enable-server-load-tracking", action="store_true", help="GET /load counts in-flight requests (as vLLM)")
    a("--enable-auto-tool-choice", action="store_true", help="accept tool_choice auto (as vLLM; no calls are parsed)")
    a("--tool-call-parser", default=None, help="accept required and named tool choices (as vLLM; no calls are parsed)")
    a("--prefix-caching-hash-algo", default="sha256", choices=HASH_ALGOS)
    a("--lora-modules", nargs="+", default=[], help="name=path or JSON {\"name\":..,\"path\":..}")
    a("--enable-lora", action="store_true")
    a("--max-loras", type=int, default=1)
    a("--kv-events-endpoint", default=None, help="ZMQ PUB endpoint: tcp://*:P binds, tcp://HOST:P connects")
    a("--kv-events-topic", default="")
    a("--kv-events-replay-endpoint", default=None)
    a("--kv-events-config", default=None, help="vLLM's JSON form of the three options above")
    a("--kv-offloading-size", type=float, default=None, metavar="GIB",
      help="CPU memory for offloaded KV blocks, GiB (vLLM's native OffloadingConnector; default: off)")
    a("--kv-offloading-backend", default="native", choices=("native",),
      help="offloading backend (vLLM also has lmcache, which the simulator does not model)")
    a("--role", default="both", choices=("prefill", "decode", "both"))
    a("--kv-transfer", default="modelled", choices=("modelled", "nixl", "none"))
    a("--kv-pin-timeout", type=float, default=DEFAULT_PIN_TIMEOUT_S)
    a("--kv-block-bytes", type=int, default=4096, help="bytes of 'KV' per block a real transfer moves")
    a("--nixl-side-channel-port", type=int, default=None)
    a("--engine-max-lag", type=float, default=None, metavar="SECONDS",
      help="how far the engine may fall behind its timeline before simulated time slips "
           "(default: 16 of the profile's minimal steps, at most 0.1 s)")
    a("--fault-fail-rate", type=float, default=0.0)
    a("--fault-stall-after", type=int, default=None)
    a("--fault-slow-factor", type=float, default=1.0)
    a("--fault-crash-after", type=int, default=None)
    a("--enable-admin-routes", action="store_true",
      help="serve /_sim/faults and /_sim/state (tests: faults at run time); off, nobody can inject faults")
    a("--log-level", default="WARNING")
    return p


def parse_lora(spec: str, adapter_id: int) -> LoraAdapter:
    if spec.lstrip().startswith("{"):
        data = json.loads(spec)
        return LoraAdapter(data["name"], data["path"], adapter_id)
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules expects name=path, got {spec!r}")
    return LoraAdapter(name, path, adapter_id)


def apply_kv_events_config(args: argparse.Namespace) -> None:
    if not args.kv_events_config:
        return
    cfg = json.loads(args.kv_events_config)
    if cfg.get("enable_kv_cache_events", True) and cfg.get("publisher", "zmq") == "zmq":
        args.kv_events_endpoint = cfg.get("endpoint", "tcp://*:5557")
        args.kv_events_topic = cfg.get("topic", args.kv_events_topic)
        args.kv_events_replay_endpoint = cfg.get("replay_endpoint", args.kv_events_replay_endpoint)


def build_state(args: argparse.Namespace) -> SimState:
    """Wire the simulator's parts from the command line (no I/O beyond loading a tokenizer)."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")  # vLLM's start-up check
    profile = get_profile(args.profile)
    tokenizer = load_tokenizer(_tokenizer_path(args))
    served = tuple(args.served_model_name or [args.model])
    sampler = Sampler(tokenizer)
    scheduler = _scheduler(args, profile, sampler)
    loras = {a.name: a for a in (parse_lora(s, i + 1) for i, s in enumerate(args.lora_modules))}
    metrics = _metrics(args, served[0], scheduler.config.num_blocks, lora=bool(loras) or args.enable_lora,
                       offload_bytes=(profile.kv_bytes_per_token, profile.offload_bytes_per_s)
                       if scheduler.config.num_cpu_blocks else None)
    faults = Faults(args.fault_fail_rate, args.fault_stall_after, args.fault_slow_factor, args.fault_crash_after)
    faults.validate()
    publisher = None
    if args.kv_events_endpoint:
        publisher = ZmqPublisher(args.kv_events_endpoint, topic=args.kv_events_topic,
                                 replay_endpoint=args.kv_events_replay_endpoint, own_host=args.host)
    clock = MonotonicClock()  # one timeline: the transfer's leases run on the engine's clock
    engine = Engine(scheduler, profile, transfer=_transfer(args, profile, clock), metrics=metrics,
                    publisher=publisher, faults=faults, bytes_per_block=args.kv_block_bytes,
                    max_lag_s=args.engine_max_lag, clock=clock)
    metrics.bind(engine.gauges())
    seed = os.environ.get("PYTHONHASHSEED", VLLM_UNSET_SEED)  # vLLM's NONE_HASH seed
    return SimState(
        engine=engine, tokenizer=tokenizer, metrics=metrics, faults=faults, served_names=served,
        model_root=args.model, max_model_len=args.max_model_len,
        hash_config=HashConfig(args.block_size, seed, args.prefix_caching_hash_algo),
        seed=args.seed, sampler=sampler, loras=loras, lora_enabled=args.enable_lora, runtime_lora=runtime_updating(),
        role=args.role, fingerprint=system_fingerprint(served[0]),
        load_tracking=args.enable_server_load_tracking,
        tools=ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser),
    )


def _tokenizer_path(args: argparse.Namespace) -> str | None:
    """--tokenizer, else the model folder when --model is one (as vLLM loads it), else built-in."""
    if args.tokenizer is None and (Path(args.model) / "tokenizer.json").is_file():
        return str(args.model)
    return args.tokenizer


def _scheduler(args: argparse.Namespace, profile: Profile, sampler: Sampler) -> Scheduler:
    config = SchedulerConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks or profile.default_num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or profile.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_transfer=args.kv_transfer != "none",
        num_cpu_blocks=num_cpu_blocks(args.kv_offloading_size, args.block_size, profile.kv_bytes_per_token),
        reload_seconds_per_token=profile.reload_seconds(1),
    )
    return Scheduler(config, sampler, enable_events=bool(args.kv_events_endpoint))


def num_cpu_blocks(size_gib: float | None, block_size: int, kv_bytes_per_token: int) -> int:
    """CPU offload blocks in ``size_gib``: vLLM's ``cpu_bytes_to_use // bytes per offloaded
    block`` (``kv_offloading_size * 2**30``; the offloaded block is the GPU block here)."""
    if size_gib is None:
        return 0
    if not size_gib > 0:
        raise ValueError(f"--kv-offloading-size must be a number of GiB > 0, got {size_gib}")
    blocks = int(size_gib * (1 << 30)) // (block_size * kv_bytes_per_token)
    if blocks < 1:
        raise ValueError(f"--kv-offloading-size {size_gib} GiB holds no {block_size}-token block "
                         f"({block_size * kv_bytes_per_token} bytes each)")
    return blocks


def _metrics(args: argparse.Namespace, model_name: str, num_blocks: int, *, lora: bool,
             offload_bytes: tuple[int, float] | None = None) -> SimMetrics:
    cache_info = cache_config_info(
        block_size=args.block_size, num_blocks=num_blocks, num_blocks_override=args.num_blocks,
        enable_prefix_caching=args.enable_prefix_caching, hash_algo=args.prefix_caching_hash_algo,
        max_model_len=args.max_model_len, kv_offloading_size=args.kv_offloading_size)
    return SimMetrics(model_name, max_model_len=args.max_model_len, cache_info=cache_info,
                      max_loras=args.max_loras if lora else None, offload_bytes=offload_bytes)


def _transfer(args: argparse.Namespace, profile: Profile, clock: Clock) -> KVTransfer:
    # modelled: the decode pod reaches the prefill pod's HTTP port; nixl: its side channel
    port = args.port if args.kv_transfer == "modelled" else (args.nixl_side_channel_port or args.port + 1000)
    return make_transfer(args.kv_transfer, TransferConfig(
        host=args.host, port=port, side_channel_port=args.nixl_side_channel_port,
        pin_timeout_s=args.kv_pin_timeout, transfer_base_s=profile.transfer_base_s,
        transfer_bytes_per_s=profile.transfer_bytes_per_s,
        modelled_bytes_per_block=profile.kv_bytes_per_token * args.block_size,
    ), clock)


async def serve(args: argparse.Namespace) -> None:
    state = build_state(args)
    app = build_app(state, admin_routes=args.enable_admin_routes)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await state.engine.start()
    # a short shutdown grace: a stalled stream (fault injection) must not hold up SIGTERM
    site = web.TCPSite(runner, args.host, args.port, backlog=1024, shutdown_timeout=1.0)
    await site.start()
    settle_heap()  # a full collection of the startup heap would outlast the engine's lag tolerance
    log.warning("kvflow sim serving %s on http://%s:%d (profile %s)", ",".join(state.served_names),
                args.host, args.port, args.profile)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await state.engine.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    apply_kv_events_config(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(serve(args))
    except (ValueError, OSError, FileNotFoundError) as exc:
        print(f"kvflow sim: {exc}", file=sys.stderr)
        return 2
    except NixlUnavailable as exc:
        print(f"kvflow sim: --kv-transfer nixl needs NIXL ({exc}): run the kvflow-nixl image, "
              "pip install nixl, or use --kv-transfer modelled", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
