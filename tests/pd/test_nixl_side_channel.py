"""The side-channel handshake: vLLM's message shapes, its checks, and a real ROUTER/REQ exchange."""

from __future__ import annotations

import msgspec
import pytest
import zmq.asyncio

from kvflow.sim.nixl.layout import KVLayout
from kvflow.sim.nixl.side_channel import (
    GET_META_MSG,
    AgentMetadata,
    HandshakeError,
    SideChannelServer,
    compatibility_hash,
    decode_payload,
    encode_payload,
    fetch_metadata,
    is_meta_request,
)
from tests.pd.conftest import side_channel_port

LAYOUT = KVLayout(num_blocks=8)
META = AgentMetadata("prefill-a", b"nixl-blob", [4096, 8192], 0, 8, [2048, 2048], "HND", 16)


@pytest.mark.parametrize(
    ("body", "ok"),
    [
        pytest.param(msgspec.msgpack.encode((GET_META_MSG, 0, 0)), True, id="vllm-0.32-pp-and-tp-rank"),
        pytest.param(msgspec.msgpack.encode((GET_META_MSG, 0)), True, id="older-vllm-tp-rank"),
        pytest.param(msgspec.msgpack.encode((b"other", 0)), False, id="another-message"),
        pytest.param(b"\xc1", False, id="not-msgpack"),
    ],
)
def test_meta_requests_are_recognised(body: bytes, ok: bool) -> None:
    assert is_meta_request(body) is ok


def test_the_payload_nests_msgpack_metadata_under_a_compatibility_hash() -> None:
    compat = compatibility_hash(LAYOUT, "m")
    outer = msgspec.msgpack.decode(encode_payload(META, compat))
    assert outer["compatibility_hash"] == compat
    assert msgspec.msgpack.decode(outer["agent_metadata_bytes"])["kv_caches_base_addr"] == [4096, 8192]
    assert decode_payload(encode_payload(META, compat), compat, "prefill-a") == META


def test_the_hash_covers_the_model_and_its_kv_shape() -> None:
    base = compatibility_hash(LAYOUT, "m")
    assert compatibility_hash(KVLayout(num_blocks=99), "m") == base  # pool sizes may differ
    assert compatibility_hash(LAYOUT, "other-model") != base
    assert compatibility_hash(KVLayout(num_blocks=8, num_layers=3), "m") != base
    assert compatibility_hash(KVLayout(num_blocks=8, block_size=32), "m") != base


@pytest.mark.parametrize(
    ("compat", "engine", "match"),
    [
        pytest.param("other-hash", "prefill-a", "incompatible KV layout", id="hash"),
        pytest.param(None, "prefill-b", "expected engine prefill-b, side channel serves prefill-a", id="engine"),
    ],
)
def test_a_payload_from_the_wrong_peer_is_refused(compat: str | None, engine: str, match: str) -> None:
    good = compatibility_hash(LAYOUT)
    with pytest.raises(HandshakeError, match=match):
        decode_payload(encode_payload(META, good), compat or good, engine)


async def test_a_handshake_over_zmq_returns_the_metadata_and_wakes_the_agent() -> None:
    port, woken = side_channel_port(), []
    compat = compatibility_hash(LAYOUT)
    server = SideChannelServer("127.0.0.1", port, encode_payload(META, compat), lambda: woken.append(1))
    await server.start()
    ctx = zmq.asyncio.Context()
    try:
        got = await fetch_metadata("127.0.0.1", port, compat=compat, engine_id="prefill-a", timeout=2.0, ctx=ctx)
    finally:
        ctx.term()
        await server.close()
    assert (got, woken) == (META, [1])


async def test_nobody_listening_is_a_handshake_error_after_the_timeout() -> None:
    ctx = zmq.asyncio.Context()
    try:
        with pytest.raises(HandshakeError, match=r"no answer from 127.0.0.1:\d+ within 0.2s"):
            await fetch_metadata("127.0.0.1", side_channel_port(), compat="x", engine_id="e", timeout=0.2, ctx=ctx)
    finally:
        ctx.term()
