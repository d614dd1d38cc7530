"""A batch's state machine, and its objects as the official openai SDK reads them."""

from __future__ import annotations

import openai.types
import pytest

from kvflow.errors import InvalidRequestError
from kvflow.gateway.batch.states import (
    BatchRecord, FileRecord, Status, batch_object, can_move, cancellable, check_metadata, file_object, sources,
    window_seconds,
)

S = Status


@pytest.mark.parametrize(("current", "to"), [
    (S.VALIDATING, S.IN_PROGRESS), (S.VALIDATING, S.FAILED), (S.VALIDATING, S.CANCELLING),
    (S.IN_PROGRESS, S.FINALIZING), (S.IN_PROGRESS, S.CANCELLING), (S.FINALIZING, S.COMPLETED),
    (S.FINALIZING, S.EXPIRED), (S.CANCELLING, S.CANCELLED),
])
def test_allowed_moves(current: Status, to: Status) -> None:
    assert can_move(current, to) and current in sources(to)


@pytest.mark.parametrize("to", list(Status))
def test_nothing_leaves_a_terminal_status(to: Status) -> None:
    for current in (S.COMPLETED, S.FAILED, S.EXPIRED, S.CANCELLED):
        assert current.terminal and not can_move(current, to)


def test_cancelling_is_allowed_until_the_batch_ends() -> None:
    assert {s for s in Status if cancellable(s)} == {S.VALIDATING, S.IN_PROGRESS, S.CANCELLING}


def test_each_move_stamps_its_time() -> None:
    rec = BatchRecord("batch_1", "k", "/v1/completions", "file-1", "24h", S.VALIDATING, 100, 86500)
    done = rec.moved(S.IN_PROGRESS, 101).moved(S.FINALIZING, 105).moved(S.COMPLETED, 106)
    assert done.stamps == {"in_progress_at": 101, "finalizing_at": 105, "completed_at": 106}
    with pytest.raises(ValueError, match="cannot go from completed to in_progress"):
        done.moved(S.IN_PROGRESS, 107)


def test_the_batch_object_parses_as_the_sdks_batch() -> None:
    rec = BatchRecord("batch_1", "k", "/v1/chat/completions", "file-1", "24h", S.COMPLETED, 100, 86500,
                      {"job": "nightly"}, "file-o", "file-e", None, 10, 9, 1,
                      {"in_progress_at": 101, "completed_at": 120})
    batch = openai.types.Batch.model_validate(batch_object(rec))
    assert (batch.status, batch.output_file_id, batch.error_file_id, batch.completed_at) == (
        "completed", "file-o", "file-e", 120)
    assert batch.request_counts is not None and batch.request_counts.model_dump() == {
        "total": 10, "completed": 9, "failed": 1}
    assert batch.metadata == {"job": "nightly"} and batch.cancelled_at is None


def test_failed_validation_errors_are_a_list_object() -> None:
    rec = BatchRecord("batch_1", "k", "/v1/completions", "file-1", "24h", S.FAILED, 1, 2,
                      errors=[{"code": "invalid_file", "message": "gone", "line": None, "param": "input_file_id"}])
    batch = openai.types.Batch.model_validate(batch_object(rec))
    assert batch.errors is not None and batch.errors.data and batch.errors.data[0].code == "invalid_file"


def test_the_file_object_parses_as_the_sdks_file() -> None:
    f = openai.types.FileObject.model_validate(file_object(FileRecord("file-1", "k", "in.jsonl", "batch", 12, 5)))
    assert (f.id, f.bytes, f.filename, f.purpose) == ("file-1", 12, "in.jsonl", "batch")


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86400), ("1h", 3600), ("2d", 172800), ("366d", 366 * 86400)])
def test_completion_windows(window: str, seconds: int) -> None:
    assert window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["24", "0h", "1w", 24, None, "24h\n", " 24h"])
def test_bad_completion_windows_are_a_400_naming_the_field(window: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        window_seconds(window)
    assert info.value.param == "completion_window"


@pytest.mark.parametrize("window", ["367d", "8785h", "99999999999999999999d", "9" * 5000 + "h"])
def test_windows_past_a_year_are_a_400_not_an_overflow(window: str) -> None:
    with pytest.raises(InvalidRequestError, match="at most 366d") as info:
        window_seconds(window)
    assert info.value.param == "completion_window"


def test_metadata_follows_openais_limits() -> None:
    assert check_metadata({"a": "b"}) == {"a": "b"} and check_metadata(None) is None
    for bad in ({"a": 1}, {str(i): "v" for i in range(17)}, {"k" * 65: "v"}, ["a"]):
        with pytest.raises(InvalidRequestError):
            check_metadata(bad)
