"""A model update rolls the pools out one after the other; meanwhile no P/D pair mixes revisions.

The operator runs against the emulated cluster; a real kvflow Router, built from the ConfigMap
the operator rendered, follows the InferencePool's pods through the emulated API server (its
own pod watcher, via a kubeconfig) and schedules a steady stream of long prompts while the
model changes. Pods carry ``kvflow.io/revision``; every disaggregated decision pairs a decode
pod with a prefill pod of the same revision, and when the prefill pool already runs the new
revision while decode still runs the old one, the requests stay aggregated instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path

import pytest
import yaml
from operator_emulator import write_kubeconfig
from operator_harness import Harness, eventually
from test_operator_lifecycle import LLMS, NAME, NS, sample, status

from kvflow.endpoints import Role
from kvflow.router.config import load_config
from kvflow.router.model import SchedulingRequest
from kvflow.router.router import Router
from kvflow.tokenizer import load_tokenizer


def kubeconfig(h: Harness, path: Path) -> Path:
    return write_kubeconfig(str(h.server.url), path)


def revisions(router: Router) -> dict[Role, set[str]]:
    out: dict[Role, set[str]] = {}
    for endpoint in router.endpoints:
        out.setdefault(endpoint.role, set()).add(endpoint.revision)
    return out


@pytest.mark.timeout(120)
async def test_pd_pairs_never_mix_revisions_during_a_model_rollout(
        harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness
    h.controller.rollout_ticks = 16  # each pool takes ~1 s to roll: time for many decisions
    body = sample(h.engines.port)
    body["spec"]["routing"].update(kvEvents=False, pdThreshold=64)
    await h.request("POST", LLMS, body, content_type="application/json")
    await eventually(lambda: status(h).get("phase") == "Ready", what="phase Ready")
    configmap = h.k8s.read("v1/configmaps", NS, f"{NAME}-router")
    assert configmap is not None
    config = load_config(yaml.safe_load(configmap["data"]["router.yaml"]))

    from kubernetes_asyncio.config import kube_config  # reads KUBECONFIG at import: point it here

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig(h, tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    router = Router(config, profile=config.default_profile, tokenizer=load_tokenizer(None))
    await router.start()
    try:
        await eventually(lambda: {r: len(v) for r, v in revisions(router).items()} == {
            Role.PREFILL: 1, Role.DECODE: 1} and len(router.endpoints) == 3, what="the router sees 1+2 pods")
        old = revisions(router)[Role.DECODE]
        decisions: list[tuple[str, str | None]] = []
        mixed_pools = False
        counter = itertools.count()

        def decide() -> None:
            nonlocal mixed_pools
            n = next(counter)
            prompt = list(range(n * 1000, n * 1000 + 200))  # fresh tokens: nothing cached anywhere
            try:
                flight = router.decide(SchedulingRequest(f"r{n}", "", prompt))
            except Exception:  # noqa: BLE001 - a moment with no healthy decode pod is not this test's subject
                return
            with flight:
                flight.dispatch()
                flight.prefill_done(ok=True)
                flight.first_token(observe=False)
            result = flight.result
            decode = result.targets[0]
            decisions.append((decode.revision, result.prefill.revision if result.prefill else None))
            seen = revisions(router)
            if seen.get(Role.PREFILL, set()) and seen.get(Role.PREFILL) != seen.get(Role.DECODE):
                mixed_pools = True

        async def steady_stream() -> None:
            while True:
                decide()
                await asyncio.sleep(0.01)  # the stream's pace: a request every 10 ms

        def rolled_out() -> bool:
            return (status(h).get("observedGeneration") == 2 and status(h).get("phase") == "Ready"
                    and revisions(router).get(Role.DECODE, old) != old
                    and len(revisions(router).get(Role.DECODE, ())) == 1)

        stream = asyncio.create_task(steady_stream())
        try:
            await eventually(lambda: len(decisions) >= 20, what="20 decisions before the update")
            await h.request("PATCH", f"{LLMS}/{NAME}", {"spec": {"model": {"name": "sim-model-v2"}}})
            await eventually(rolled_out, timeout=60, what="decode pods all on the new revision")
            new = revisions(router)[Role.DECODE]
        finally:
            stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream
        for _ in range(20):
            decide()
    finally:
        await router.stop()

    assert old != new
    assert mixed_pools, "the walk must have seen prefill and decode on different revisions"
    mixed = [d for d in decisions if d[1] is not None and d[0] != d[1]]
    assert not mixed, f"P/D pairs across revisions: {mixed[:5]}"
    (before,), (after,) = old, new
    assert (before, before) in decisions and (after, after) in decisions, "P/D before and after the rollout"
    assert (before, None) in decisions, "while only decode had the old revision, requests stayed aggregated"
