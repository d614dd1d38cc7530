"""The batch store: claims, leases and results, with two Store objects on one directory standing
in for two gateway replicas (each has its own SQLite connection, as separate processes do)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.errors import InvalidRequestError, NotFoundError
from kvflow.gateway.batch.states import BatchRecord, FileRecord, Status
from kvflow.gateway.batch.store import NewLine, Result, Store

T0 = 1_000.0


@pytest.fixture
def replicas(tmp_path: Path) -> tuple[Store, Store]:
    return Store(tmp_path), Store(tmp_path)


def new_batch(store: Store, n: int, *, malformed: int = 0, now: float = T0) -> str:
    store.add_file(FileRecord("file-in", "key", "in.jsonl", "batch", 10, int(now)), b"{}\n")
    store.add_batch(BatchRecord("batch_1", "key", "/v1/completions", "file-in", "24h", Status.VALIDATING,
                                int(now), int(now) + 86400))
    assert store.lease_batch("batch_1", "a", now + 30, now)
    lines = [NewLine(i, f"c{i}", b'{"model":"m"}') for i in range(n)]
    lines += [NewLine(n + i, None, None, b'{"bad":1}') for i in range(malformed)]
    assert store.start("batch_1", "a", lines, int(now))
    return "batch_1"


def result(index: int, ok: bool = True) -> Result:
    return Result("batch_1", index, ok, json.dumps({"custom_id": f"c{index}"}).encode())


def test_replicas_claim_disjoint_lines_in_file_order(replicas: tuple[Store, Store]) -> None:
    a, b = replicas
    new_batch(a, 10)
    first = a.claim("batch_1", "a", 4, T0 + 30, T0)
    second = b.claim("batch_1", "b", 10, T0 + 30, T0)
    assert [c.index for c in first] == [0, 1, 2, 3] and [c.index for c in second] == [4, 5, 6, 7, 8, 9]
    assert b.claim("batch_1", "b", 10, T0 + 30, T0) == []


def test_a_result_counts_once_and_only_from_the_claim_holder(replicas: tuple[Store, Store]) -> None:
    a, b = replicas
    new_batch(a, 3)
    a.claim("batch_1", "a", 3, T0 + 30, T0)
    assert b.record("b", [result(0)]) == 0  # b never held line 0
    assert a.record("a", [result(0), result(1, ok=False)]) == 2
    assert a.record("a", [result(0)]) == 0  # already answered
    rec = a.get_batch(None, "batch_1")
    assert (rec.total, rec.completed, rec.failed) == (3, 1, 1)


def test_a_dead_replicas_lines_go_to_another_once_their_lease_runs_out(replicas: tuple[Store, Store]) -> None:
    a, b = replicas
    new_batch(a, 2)
    a.claim("batch_1", "a", 2, T0 + 30, T0)
    assert b.claim("batch_1", "b", 2, T0 + 60, T0 + 29) == []  # a's lease still holds
    taken = b.claim("batch_1", "b", 2, T0 + 61, T0 + 31)
    assert [(c.index, c.attempts) for c in taken] == [(0, 2), (1, 2)]
    assert a.record("a", [result(0)]) == 0  # a, back from a stall, lost its claim: its answer is dropped
    assert b.record("b", [result(0), result(1)]) == 2


def test_renewing_keeps_a_live_replicas_claims(replicas: tuple[Store, Store]) -> None:
    a, b = replicas
    new_batch(a, 1)
    a.claim("batch_1", "a", 1, T0 + 30, T0)
    a.renew("a", T0 + 60)
    assert b.claim("batch_1", "b", 1, T0 + 90, T0 + 45) == []


def test_a_replica_restarted_under_its_name_takes_its_claims_back_at_once(tmp_path: Path) -> None:
    before = Store(tmp_path)
    new_batch(before, 3)
    before.claim("batch_1", "gw:8080", 3, T0 + 30, T0)
    before.close()
    after = Store(tmp_path)
    assert after.release_all("gw:8080") == 3
    assert len(after.claim("batch_1", "gw:8080", 3, T0 + 31, T0 + 1)) == 3


def test_a_released_line_waits_for_its_back_off(replicas: tuple[Store, Store]) -> None:
    a, _ = replicas
    new_batch(a, 1)
    a.claim("batch_1", "a", 1, T0 + 30, T0)
    a.release("batch_1", 0, "a", not_before=T0 + 5)
    assert a.claim("batch_1", "a", 1, T0 + 30, T0 + 4) == []
    assert [c.index for c in a.claim("batch_1", "a", 1, T0 + 35, T0 + 5)] == [0]


def test_finalizing_writes_output_and_error_files_in_line_order(replicas: tuple[Store, Store]) -> None:
    a, _ = replicas
    new_batch(a, 3, malformed=1)  # the malformed line has its result from the start
    a.claim("batch_1", "a", 3, T0 + 30, T0)
    a.record("a", [result(2), result(0), result(1, ok=False)])
    assert not a.any_unfinished("batch_1") and a.to_finalizing("batch_1", int(T0) + 1)
    assert a.lease_batch("batch_1", "a", T0 + 30, T0)
    done = a.finalize("batch_1", "a", int(T0) + 2)
    assert done is not None and done.status is Status.COMPLETED
    assert (done.total, done.completed, done.failed) == (4, 2, 2)
    output = a.read_file("key", done.output_file_id or "").splitlines()
    errors = a.read_file("key", done.error_file_id or "").splitlines()
    assert [json.loads(x).get("custom_id") for x in output] == ["c0", "c2"]
    assert errors == [b'{"custom_id": "c1"}', b'{"bad":1}']
    assert a.get_file("key", done.output_file_id or "").purpose == "batch_output"
    with pytest.raises(InvalidRequestError, match="Cannot cancel a batch with status 'completed'"):
        a.cancel("key", "batch_1", int(T0) + 3)


def test_finalizing_needs_the_batch_lease(replicas: tuple[Store, Store]) -> None:
    a, b = replicas
    new_batch(a, 1)
    a.claim("batch_1", "a", 1, T0 + 30, T0)
    a.record("a", [result(0)])
    a.to_finalizing("batch_1", int(T0))
    assert a.lease_batch("batch_1", "a", T0 + 30, T0)
    assert not b.lease_batch("batch_1", "b", T0 + 30, T0 + 1) and b.finalize("batch_1", "b", int(T0)) is None
    assert a.finalize("batch_1", "a", int(T0)) is not None


def test_cancel_keeps_what_is_done_and_drops_the_rest(replicas: tuple[Store, Store]) -> None:
    a, _ = replicas
    new_batch(a, 4)
    a.claim("batch_1", "a", 2, T0 + 30, T0)
    a.record("a", [result(0)])
    rec = a.cancel("key", "batch_1", int(T0) + 1)
    assert rec.status is Status.CANCELLING and rec.stamps["cancelling_at"] == int(T0) + 1
    assert a.cancel("key", "batch_1", int(T0) + 2).status is Status.CANCELLING  # twice is fine
    assert a.claim("batch_1", "a", 4, T0 + 30, T0) == []  # nothing new starts
    assert a.any_running("batch_1", T0 + 1)  # line 1 is still running
    a.record("a", [result(1)])
    assert a.lease_batch("batch_1", "a", T0 + 30, T0)
    done = a.finalize("batch_1", "a", int(T0) + 3)
    assert done is not None and done.status is Status.CANCELLED and done.completed == 2
    assert len(a.read_file("key", done.output_file_id or "").splitlines()) == 2
    assert a.cancel("key", "batch_1", int(T0) + 4).status is Status.CANCELLED


def test_expiry_turns_unrun_lines_into_batch_expired_errors(replicas: tuple[Store, Store]) -> None:
    a, _ = replicas
    new_batch(a, 3)
    a.claim("batch_1", "a", 1, T0 + 30, T0)
    a.record("a", [result(0)])
    a.expire("batch_1", int(T0) + 86401)
    assert a.lease_batch("batch_1", "a", T0 + 30, T0)
    done = a.finalize("batch_1", "a", int(T0) + 86402)
    assert done is not None and done.status is Status.EXPIRED and (done.completed, done.failed) == (1, 2)
    codes = [json.loads(x)["error"]["code"] for x in a.read_file("key", done.error_file_id or "").splitlines()]
    assert codes == ["batch_expired", "batch_expired"]


def test_files_and_batches_belong_to_their_key(replicas: tuple[Store, Store]) -> None:
    a, _ = replicas
    new_batch(a, 1)
    with pytest.raises(NotFoundError):
        a.get_file("someone-else", "file-in")
    with pytest.raises(NotFoundError):
        a.get_batch("someone-else", "batch_1")
    assert a.list_batches("someone-else", None, 20) == ([], False)
    with pytest.raises(NotFoundError, match="upload it with purpose 'batch'"):
        a.add_batch(BatchRecord("batch_2", "someone-else", "/v1/completions", "file-in", "24h",
                                Status.VALIDATING, 1, 2))


def test_listing_pages_newest_first(replicas: tuple[Store, Store]) -> None:
    a, _ = replicas
    for i in range(5):
        a.add_file(FileRecord(f"file-{i}", "key", "x", "batch", 1, i), b"x")
    page, more = a.list_files("key", None, None, 2, newest_first=True)
    assert [f.id for f in page] == ["file-4", "file-3"] and more
    page, more = a.list_files("key", "batch", "file-3", 10, newest_first=True)
    assert [f.id for f in page] == ["file-2", "file-1", "file-0"] and not more
    a.delete_file("key", "file-0")
    with pytest.raises(NotFoundError):
        a.read_file("key", "file-0")
