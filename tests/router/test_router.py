"""Router: the public API the gateway and the ext_proc server rely on."""

from __future__ import annotations

import pytest

from kvflow.errors import NoCapacityError, RateLimitError
from kvflow.router import Incoming, Router, SchedulingRequest, load_config
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
        "Flight",
        "Incoming",
        "Router",
        "RouterConfig",
        "SchedulingRequest",
        "SchedulingResult",
        "load_config",
    }


def test_approx_profile_learns_and_follows_the_prefix() -> None:
    router = Router(load_config(None), PODS, profile="prefix-approx")
    with router.decide(req("a")) as flight:
        first = flight.result
        assert first.cached_tokens == 0 and len(first.targets) == 3 and first.prefill is None
        flight.dispatch()
        flight.first_token(observe=False)
    second = router.decide(req("b", PROMPT + [7] * 20)).result
    assert second.targets[0] == first.targets[0] and second.cached_tokens == 512


def test_each_decision_teaches_what_it_read_even_under_one_request_id() -> None:
    """What a decision read travels in its flight: a second decision for the same request id
    (a client that reuses ids, a retry from outside) changes nothing the first one teaches."""
    router = Router(load_config(None), PODS, profile="prefix-approx")
    other = [7] * 512
    first, second = router.decide(req("same")), router.decide(req("same", other))
    elsewhere = next(p for p in PODS if p != first.result.targets[0])
    first.dispatch()
    second.send(elsewhere)
    picks = [router.decide(req(rid, prompt)).result for rid, prompt in (("a", PROMPT), ("b", other))]
    assert [(r.targets[0], r.cached_tokens) for r in picks] == [(first.result.targets[0], 512), (elsewhere, 512)]


async def test_route_takes_the_parsed_body_and_names_the_request_as_the_pool_serves_it() -> None:
    router = Router(load_config({"pool": {"model": "base", "loras": ["sql"]}}), PODS)
    flight = await router.route(Incoming({"model": "sql", "prompt": "hello", "cache_salt": "t"}, {}, "r1", 40))
    request = flight.request
    assert (request.request_id, request.model, request.lora, request.cache_salt) == ("r1", "base", "sql", "t")
    assert request.token_ids == router.tokenizer.encode("hello") and flight.result.targets[0] in PODS


async def test_route_refuses_a_prompt_over_the_pools_limit_with_a_400() -> None:
    from kvflow.errors import InvalidRequestError

    router = Router(load_config({"maxPromptTokens": 4}), PODS)
    with pytest.raises(InvalidRequestError, match="maximum context length is 4 tokens"):
        await router.route(Incoming({"prompt": list(range(5))}, {}, "r1", 40))


def test_precise_profile_reads_the_kv_event_index() -> None:
    router = Router(load_config(None), PODS, profile="prefix-precise")
    hashes = router.fingerprinter.prompt(PROMPT).all()
    router.precise.add(PODS[2].id, hashes[:10])
    result = router.decide(req("a")).result
    assert (result.targets[0], result.cached_tokens) == (PODS[2], 160)


def test_same_snapshot_and_request_same_decision() -> None:
    picks = {Router(load_config(None), PODS).decide(req("same")).result.targets for _ in range(5)}
    assert len(picks) == 1


def test_in_flight_accounting_spreads_a_burst() -> None:
    router = Router(load_config(None), PODS, profile="least-load")
    chosen = []
    for i in range(8):
        flight = router.decide(req(f"r{i}", [i] * 40))
        flight.dispatch()
        chosen.append(flight.result.targets[0])
    assert sorted(chosen.count(p) for p in PODS) == [2, 2, 2, 2]
    assert [v.in_flight for v in router.datastore.snapshot()] == [2, 2, 2, 2]


def test_mark_failed_until_next_good_scrape() -> None:
    router = Router(load_config(None), PODS[:1])
    router.mark_failed(PODS[0])
    with pytest.raises(NoCapacityError) as info:
        router.decide(req("a"))
    assert info.value.status == 503
    router.datastore.record_scrape(PODS[0].id, EngineMetrics(), now=1.0)
    assert router.decide(req("b")).result.targets == (PODS[0],)


def test_sheds_sheddable_requests_with_429_when_every_pod_is_saturated() -> None:
    router = Router(load_config(None), PODS[:2])
    for pod in PODS[:2]:
        router.datastore.record_scrape(pod.id, EngineMetrics(waiting=500), now=1.0)
    with pytest.raises(RateLimitError):
        router.decide(req("a", priority=-1))
    assert router.explain(1)[0]["error"].startswith("shed")
    # a request of the default priority is sent on, to queue on a pod as vLLM queues it
    assert router.decide(req("b")).result.targets[0] in PODS[:2]


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
    result = router.decide(req("a", tokens)).result
    assert result.targets[0].role is Role.DECODE
    assert result.prefill == (PD_PODS[2] if disaggregate else None)
    assert all(t.role is not Role.PREFILL for t in result.targets)


def test_pd_counts_both_pods_in_flight() -> None:
    router = Router(load_config(None), PD_PODS)
    with router.decide(req("a")) as flight:
        flight.dispatch()
        assert {v.id: v.in_flight for v in router.datastore.snapshot()}[PD_PODS[2].id] == 1
        flight.prefill_done(ok=True)
        flight.first_token(observe=False)
    assert [v.in_flight for v in router.datastore.snapshot()] == [0, 0, 0]


def test_profile_header_overrides_per_request() -> None:
    router = Router(load_config(None), PODS)
    picks = [router.decide(req(f"r{i}", headers={"x-kvflow-profile": "round-robin"})).result.targets[0]
             for i in range(4)]
    assert sorted(p.host for p in picks) == sorted(p.host for p in PODS)
    assert router.explain(1)[0]["profile"] == "round-robin"


def test_precise_falls_back_to_approx_for_pods_without_kv_events() -> None:
    router = Router(load_config({"kvEvents": {"speculativeTtlSeconds": 0}}), PODS, profile="prefix-precise")
    first = router.decide(req("a"))
    first.dispatch()
    again = router.decide(req("b")).result
    assert (again.targets[0], again.cached_tokens) == (first.result.targets[0], 512)  # learned by routing
    router.event_sources.add(first.result.targets[0].id)  # that pod's events are heard now: they are the truth
    assert router.decide(req("c")).result.cached_tokens == 0


@pytest.mark.parametrize(("profile", "taught"), [("default", False), ("prefix-approx", True), ("prefix-precise", True)])
def test_the_routed_index_learns_about_pods_with_kv_events_only_for_profiles_that_read_it(
        profile: str, taught: bool) -> None:
    router = Router(load_config(None), PODS, profile=profile)
    heard = {p.id for p in PODS[:2]}
    router.event_sources.update(heard)  # two pods publish KV events, two do not
    picked = set()
    for i in range(8):
        flight = router.decide(req(f"r{i}", tokens=[i] * 64))
        flight.dispatch()
        picked.add(flight.result.targets[0].id)
    assert picked & heard and picked - heard  # both kinds were sent requests
    for eid in picked:
        # the default profile reads the approximate index only where no events tell the truth
        assert (router.approx.blocks_of(eid) > 0) is (taught or eid not in heard), eid


def test_a_guess_carries_the_match_on_past_what_the_events_have_confirmed_so_far() -> None:
    from kvflow.router.kv_events import apply
    from kvflow.protocol.kv_events import BlockStored

    router = Router(load_config(None), PODS, profile="prefix-precise")
    router.event_sources.update(p.id for p in PODS)  # every pod's events are heard
    flight = router.decide(req("a"))
    flight.dispatch()
    pod = flight.result.targets[0].id
    # the pod's first BlockStored covers the first 20 blocks (chunked prefill: the rest comes later)
    apply(router.precise, pod, [BlockStored(tuple(range(1, 21)), None, 16, tuple(PROMPT[:320]))], router.speculative)
    assert router.precise.match(router.fingerprinter.prompt(PROMPT).all()) == {pod: 20}
    assert len(router.speculative) == 12  # the confirmed blocks are no longer guesses
    again = router.decide(req("b")).result
    assert (again.targets[0].id, again.cached_tokens) == (pod, 32 * 16)  # 20 confirmed, 12 guessed


def test_an_eviction_of_an_older_copy_does_not_end_the_guess_of_a_request_still_waiting_there() -> None:
    """A pod that held the prompt evicts it while a request sent with it waits in its queue: the
    request computes the blocks again, so the next one finds them there. Once the request is
    prefilled, a removal is the truth again."""
    from kvflow.protocol.kv_events import BlockRemoved, BlockStored
    from kvflow.router.kv_events import apply

    router = Router(load_config(None), PODS, profile="prefix-precise")
    router.event_sources.update(p.id for p in PODS)
    with router.decide(req("a")) as first:
        first.dispatch()
        pod = first.result.targets[0].id
        vllm_hashes = tuple(range(1, 33))
        apply(router.precise, pod, [BlockStored(vllm_hashes, None, 16, tuple(PROMPT))], router.speculative)
        first.first_token(observe=False)  # stored, answered: the pod holds the prompt

    waiting = router.decide(req("b"))
    assert (waiting.result.targets[0].id, waiting.result.cached_tokens) == (pod, 512)
    waiting.dispatch()  # queued behind others: not prefilled yet
    apply(router.precise, pod, [BlockRemoved(vllm_hashes[8:])], router.speculative)  # the old copy goes
    assert router.precise.match(router.fingerprinter.prompt(PROMPT).all()) == {pod: 8}
    assert router.decide(req("c")).result.cached_tokens == 512  # "b" stores the 24 blocks again before "c" runs

    waiting.finish()  # "b" left without storing them
    apply(router.precise, pod, [BlockRemoved(vllm_hashes[:8])], router.speculative)
    assert router.decide(req("d")).result.cached_tokens == 0


def test_an_unknown_profile_is_the_clients_mistake_not_a_capacity_problem() -> None:
    from kvflow.errors import InvalidRequestError

    router = Router(load_config(None), PODS)
    with pytest.raises(InvalidRequestError) as raised:
        router.decide(req("a", profile="no-such-profile"))
    assert raised.value.status == 400 and "no-such-profile" in raised.value.message


def test_a_prompt_shorter_than_a_block_matches_and_teaches_nothing_but_ages_the_working_set() -> None:
    clock = [0.0]
    # a fixed fingerprint key, under which 4 of the long prompt's 32 blocks are sampled: the
    # working set samples 1 block in 16 by fingerprint, so a random key samples none 1 time in 8
    router = Router(load_config(None), PODS, clock=lambda: clock[0], secret=bytes([1]) * 32)
    long = router.decide(req("long"))
    long.dispatch()
    pod = router.datastore.counter(long.result.targets[0].id)
    assert pod is not None and pod.working_set.tokens == 4 * 256 and len(router.speculative) == 32
    taught = len(router.approx)
    clock[0] = pod.working_set.window + 1.0  # the long prompt's blocks have left both windows
    short = router.decide(req("short", [7] * 15))
    assert short.result.cached_tokens == 0
    short.send(long.result.targets[0])  # sent where the long one went
    assert (len(router.approx), len(router.speculative)) == (taught, 0)
    assert pod.working_set.tokens == 0 and pod.in_flight == 2


async def test_a_body_as_large_as_the_tokenizers_threshold_is_tokenized_in_a_worker_thread() -> None:
    import threading

    from kvflow.tokenizer import BuiltinTokenizer

    assert Router(load_config(None), PODS).tokenizer.offload_bytes == 64 * 1024  # it holds the GIL: only huge prompts
    threads: list[int] = []

    class Recorded(BuiltinTokenizer):
        offload_bytes = 4096

        def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
            threads.append(threading.get_ident())
            return super().encode(text, add_special_tokens=add_special_tokens)

    router = Router(load_config(None), PODS, tokenizer=Recorded())
    body = {"prompt": "hello world"}
    small, large = [await router.route(Incoming(body, {}, rid, size)) for rid, size in (("a", 4095), ("b", 4096))]
    assert small.request.token_ids == large.request.token_ids == BuiltinTokenizer().encode("hello world")
    assert threads[0] == threading.get_ident() != threads[1]


def test_a_hugging_face_tokenizer_is_given_bodies_of_4_kb_and_more_off_the_loop() -> None:
    from pathlib import Path

    from kvflow.tokenizer import load_tokenizer

    folder = Path(__file__).resolve().parents[1] / "golden" / "tiny-llama-tokenizer"
    router = Router(load_config(None), PODS, tokenizer=load_tokenizer(folder))
    assert router.tokenizer.offload_bytes == 4096  # its Rust code encodes outside the GIL
