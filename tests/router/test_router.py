"""Router: the public API the gateway and the ext_proc server rely on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvflow.errors import NoCapacityError, RateLimitError
from kvflow.router import Router, SchedulingRequest, load_config
from kvflow.router.model import EngineMetrics
from kvflow.endpoints import Endpoint, Role

PODS = [Endpoint(f"127.0.0.{i}", 8000) for i in range(2, 6)]
PROMPT = list(range(1000, 1512))  # 32 blocks of 16


def req(rid: str, tokens: list[int] = PROMPT, **kw: object) -> SchedulingRequest:
    return SchedulingRequest(rid, "m", tokens, **kw)  # type: ignore[arg-type]


def test_public_names() -> None:
    import kvflow.router as api

    assert set(api.__all__) == {
        "EndpointView",
        "EngineMetrics",
        "Router",
        "RouterConfig",
        "SchedulingRequest",
        "SchedulingResult",
        "load_config",
    }


def test_approx_profile_learns_and_follows_the_prefix() -> None:
    router = Router(load_config(None), PODS, profile="prefix-approx")
    first = router.schedule(req("a"))
    assert first.cached_tokens == 0 and len(first.targets) == 3 and first.prefill is None
    router.request_started(req("a"), first)
    router.request_finished(req("a"), first, ok=True)
    second = router.schedule(req("b", PROMPT + [7] * 20))
    assert second.targets[0] == first.targets[0] and second.cached_tokens == 512


def test_precise_profile_reads_the_kv_event_index() -> None:
    router = Router(load_config(None), PODS, profile="prefix-precise")
    hashes = router.fingerprinter.prompt(PROMPT).all()
    router.precise.add(PODS[2].id, hashes[:10])
    result = router.schedule(req("a"))
    assert (result.targets[0], result.cached_tokens) == (PODS[2], 160)


def test_same_snapshot_and_request_same_decision() -> None:
    picks = {Router(load_config(None), PODS).schedule(req("same")).targets for _ in range(5)}
    assert len(picks) == 1


def test_in_flight_accounting_spreads_a_burst() -> None:
    router = Router(load_config(None), PODS, profile="least-load")
    chosen = []
    for i in range(8):
        r = req(f"r{i}", [i] * 40)
        result = router.schedule(r)
        router.request_started(r, result)
        chosen.append(result.targets[0])
    assert sorted(chosen.count(p) for p in PODS) == [2, 2, 2, 2]
    assert [v.in_flight for v in router.datastore.snapshot()] == [2, 2, 2, 2]


def test_mark_failed_until_next_good_scrape() -> None:
    router = Router(load_config(None), PODS[:1])
    router.mark_failed(PODS[0])
    with pytest.raises(NoCapacityError) as info:
        router.schedule(req("a"))
    assert info.value.status == 503
    router.datastore.record_scrape(PODS[0].id, EngineMetrics(), now=1.0)
    assert router.schedule(req("b")).targets == (PODS[0],)


def test_sheds_with_429_when_every_pod_is_saturated() -> None:
    router = Router(load_config(None), PODS[:2])
    for pod in PODS[:2]:
        router.datastore.record_scrape(pod.id, EngineMetrics(waiting=500), now=1.0)
    with pytest.raises(RateLimitError):
        router.schedule(req("a"))
    assert router.explain(1)[0]["error"].startswith("shed")


def test_unknown_profile_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown profile 'nope'"):
        Router(load_config(None), PODS, profile="nope")


PD_PODS = [
    Endpoint("127.0.0.2", 8000, role=Role.DECODE),
    Endpoint("127.0.0.3", 8000, role=Role.DECODE),
    Endpoint("127.0.0.4", 8000, role=Role.PREFILL),
]


@pytest.mark.parametrize(
    ("prompt_tokens", "cached_blocks", "disaggregate"),
    [(512, 0, True), (200, 0, False), (512, 24, False), (512, 8, True)],
    ids=["long-uncached", "short", "mostly-cached", "partly-cached"],
)
def test_pd_decision(prompt_tokens: int, cached_blocks: int, disaggregate: bool) -> None:
    router = Router(load_config({"pd": {"threshold": 256}}), PD_PODS, profile="prefix-precise")
    tokens = PROMPT[:prompt_tokens]
    router.precise.add(PD_PODS[0].id, router.fingerprinter.prompt(tokens).all()[:cached_blocks])
    result = router.schedule(req("a", tokens))
    assert result.targets[0].role is Role.DECODE
    assert result.prefill == (PD_PODS[2] if disaggregate else None)
    assert all(t.role is not Role.PREFILL for t in result.targets)


def test_pd_counts_both_pods_in_flight() -> None:
    router = Router(load_config(None), PD_PODS)
    r = req("a")
    result = router.schedule(r)
    router.request_started(r, result)
    assert {v.id: v.in_flight for v in router.datastore.snapshot()}[PD_PODS[2].id] == 1
    router.request_finished(r, result, ok=True)
    assert [v.in_flight for v in router.datastore.snapshot()] == [0, 0, 0]


def test_profile_header_overrides_per_request() -> None:
    router = Router(load_config(None), PODS)
    picks = [router.schedule(req(f"r{i}", headers={"x-kvflow-profile": "round-robin"})).targets[0] for i in range(4)]
    assert sorted(p.host for p in picks) == sorted(p.host for p in PODS)
    assert router.explain(1)[0]["profile"] == "round-robin"


def test_precise_falls_back_to_approx_for_pods_without_kv_events() -> None:
    router = Router(load_config({"kvEvents": {"speculativeTtlSeconds": 0}}), PODS, profile="prefix-precise")
    first = router.schedule(req("a"))
    router.request_started(req("a"), first)
    again = router.schedule(req("b"))
    assert (again.targets[0], again.cached_tokens) == (first.targets[0], 512)  # learned by routing
    router.event_sources.add(first.targets[0].id)  # that pod's events are heard now: they are the truth
    assert router.schedule(req("c")).cached_tokens == 0


@pytest.mark.parametrize(("profile", "taught"), [("default", False), ("prefix-approx", True), ("prefix-precise", True)])
def test_the_routed_index_learns_about_pods_with_kv_events_only_for_profiles_that_read_it(
        profile: str, taught: bool) -> None:
    router = Router(load_config(None), PODS, profile=profile)
    heard = {p.id for p in PODS[:2]}
    router.event_sources.update(heard)  # two pods publish KV events, two do not
    picked = set()
    for i in range(8):
        result = router.schedule(req(f"r{i}", tokens=[i] * 64))
        router.request_started(req(f"r{i}", tokens=[i] * 64), result)
        picked.add(result.targets[0].id)
    assert picked & heard and picked - heard  # both kinds were sent requests
    for eid in picked:
        # the default profile reads the approximate index only where no events tell the truth
        assert (router.approx.blocks_of(eid) > 0) is (taught or eid not in heard), eid


def test_a_guess_carries_the_match_on_past_what_the_events_have_confirmed_so_far() -> None:
    from kvflow.router.kv_events import apply
    from kvflow.protocol.kv_events import BlockStored

    router = Router(load_config(None), PODS, profile="prefix-precise")
    router.event_sources.update(p.id for p in PODS)  # every pod's events are heard
    result = router.schedule(req("a"))
    router.request_started(req("a"), result)
    pod = result.targets[0].id
    # the pod's first BlockStored covers the first 20 blocks (chunked prefill: the rest comes later)
    apply(router.precise, pod, [BlockStored(tuple(range(1, 21)), None, 16, tuple(PROMPT[:320]))], router.speculative)
    assert router.precise.match(router.fingerprinter.prompt(PROMPT).all()) == {pod: 20}
    assert len(router.speculative) == 12  # the confirmed blocks are no longer guesses
    again = router.schedule(req("b"))
    assert (again.targets[0].id, again.cached_tokens) == (pod, 32 * 16)  # 20 confirmed, 12 guessed


def test_an_eviction_of_an_older_copy_does_not_end_the_guess_of_a_request_still_waiting_there() -> None:
    """A pod that held the prompt evicts it while a request sent with it waits in its queue: the
    request computes the blocks again, so the next one finds them there. Once the request is
    prefilled, a removal is the truth again."""
    from kvflow.protocol.kv_events import BlockRemoved, BlockStored
    from kvflow.router.kv_events import apply

    router = Router(load_config(None), PODS, profile="prefix-precise")
    router.event_sources.update(p.id for p in PODS)
    first = router.schedule(req("a"))
    router.request_started(req("a"), first)
    pod = first.targets[0].id
    vllm_hashes = tuple(range(1, 33))
    apply(router.precise, pod, [BlockStored(vllm_hashes, None, 16, tuple(PROMPT))], router.speculative)
    router.request_finished(req("a"), first, ok=True)  # stored, answered: the pod holds the prompt

    waiting = router.schedule(req("b"))
    assert (waiting.targets[0].id, waiting.cached_tokens) == (pod, 512)
    router.request_started(req("b"), waiting)  # queued behind others: not prefilled yet
    apply(router.precise, pod, [BlockRemoved(vllm_hashes[8:])], router.speculative)  # the old copy goes
    assert router.precise.match(router.fingerprinter.prompt(PROMPT).all()) == {pod: 8}
    assert router.schedule(req("c")).cached_tokens == 512  # "b" stores the 24 blocks again before "c" runs

    router.request_finished(req("b"), waiting, ok=False)  # "b" left without storing them
    apply(router.precise, pod, [BlockRemoved(vllm_hashes[:8])], router.speculative)
    assert router.schedule(req("d")).cached_tokens == 0


def test_an_unknown_profile_is_the_clients_mistake_not_a_capacity_problem() -> None:
    from kvflow.errors import InvalidRequestError

    router = Router(load_config(None), PODS)
    with pytest.raises(InvalidRequestError) as raised:
        router.schedule(req("a", profile="no-such-profile"))
    assert raised.value.status == 400 and "no-such-profile" in raised.value.message


def test_a_prompt_shorter_than_a_block_matches_and_teaches_nothing_but_ages_the_working_set() -> None:
    clock = [0.0]
    # a fixed fingerprint key, under which 4 of the long prompt's 32 blocks are sampled: the
    # working set samples 1 block in 16 by fingerprint, so a random key samples none 1 time in 8
    router = Router(load_config(None), PODS, clock=lambda: clock[0], secret=bytes([1]) * 32)
    long = router.schedule(req("long"))
    router.request_started(req("long"), long)
    pod = router.datastore.counter(long.targets[0].id)
    assert pod is not None and pod.working_set.tokens == 4 * 256 and len(router.speculative) == 32
    taught = len(router.approx)
    clock[0] = pod.working_set.window + 1.0  # the long prompt's blocks have left both windows
    short = req("short", [7] * 15)
    result = router.schedule(short)
    assert result.cached_tokens == 0
    router.request_started(short, replace(result, targets=long.targets))  # sent where the long one went
    assert (len(router.approx), len(router.speculative)) == (taught, 0)
    assert pod.working_set.tokens == 0 and pod.in_flight == 2


async def test_a_body_as_large_as_the_tokenizers_threshold_is_tokenized_in_a_worker_thread() -> None:
    import threading

    from kvflow.router.request import tokens_off_loop

    router = Router(load_config(None), PODS)
    assert router.offload_bytes == 64 * 1024  # the built-in tokenizer holds the GIL: only huge prompts
    threads: list[int] = []

    def tokenize(body: dict[str, str]) -> list[int]:
        threads.append(threading.get_ident())
        return router.tokenize(body)

    body = {"prompt": "hello world"}
    assert await tokens_off_loop(tokenize, body, 4095, 4096) == await tokens_off_loop(tokenize, body, 4096, 4096)
    assert threads[0] == threading.get_ident() != threads[1]


def test_a_hugging_face_tokenizer_is_given_bodies_of_4_kb_and_more_off_the_loop() -> None:
    from pathlib import Path

    from kvflow.tokenizer import load_tokenizer

    folder = Path(__file__).resolve().parents[1] / "golden" / "tiny-llama-tokenizer"
    router = Router(load_config(None), PODS, tokenizer=load_tokenizer(folder))
    assert router.offload_bytes == 4096  # its Rust code encodes outside the GIL
