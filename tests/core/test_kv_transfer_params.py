"""``kv_transfer_params``: one typed definition, checked against a real vLLM 0.32 P/D pair's messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.protocol.kv_transfer import (
    InvalidKvTransferParams,
    KvTransferParams,
    PrefillEngine,
    parse_prefill_answer,
    remote_decode_request,
)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "golden" / "vllm_pd.json").read_text())
ANSWER: dict[str, Any] = GOLDEN["prefill_response"]["kv_transfer_params"]


def test_the_remote_decode_request_is_what_vllms_proxies_send() -> None:
    request = remote_decode_request()
    assert request == GOLDEN["prefill_request"]["kv_transfer_params"]
    assert list(request) == list(GOLDEN["prefill_request"]["kv_transfer_params"])


def test_a_real_prefill_answer_parses_and_writes_back_byte_for_byte() -> None:
    params = parse_prefill_answer(ANSWER)

    assert params.remote() == (PrefillEngine(ANSWER["remote_engine_id"], "127.0.0.1", 15600),
                               ANSWER["remote_request_id"])
    assert params.block_ids == (1, 2, 3, 4)
    assert (params.transfer_mode, params.remote_num_tokens, params.extra) == ("pull", 100, {})
    assert json.dumps(params.to_wire()) == json.dumps(ANSWER)  # same keys, same order, same values


def test_the_decode_pod_gets_the_prefill_answer_verbatim() -> None:
    assert GOLDEN["decode_request"]["kv_transfer_params"] == ANSWER


def test_keys_a_newer_vllm_adds_are_kept_and_written_back() -> None:
    params = KvTransferParams.from_wire({**ANSWER, "remote_dp_rank": 2})
    assert params.extra == {"remote_dp_rank": 2}
    assert params.to_wire() == {**ANSWER, "remote_dp_rank": 2}


def test_the_cached_tokens_field_is_written_only_when_known() -> None:
    assert "remote_prefill_cached_tokens" not in KvTransferParams().to_wire()
    assert KvTransferParams(remote_prefill_cached_tokens=0).to_wire()["remote_prefill_cached_tokens"] == 0


def test_a_flat_block_list_is_read_as_one_group() -> None:
    assert KvTransferParams.from_wire({"remote_block_ids": [5, 6]}).remote_block_ids == ((5, 6),)
    assert KvTransferParams.from_wire({"remote_block_ids": []}).block_ids == ()


def test_missing_and_null_fields_take_their_defaults() -> None:
    assert KvTransferParams.from_wire({}) == KvTransferParams()
    assert KvTransferParams.from_wire({"tp_size": None, "remote_port": None}) == KvTransferParams()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("do_remote_prefill", "yes", "bad do_remote_prefill: 'yes' (expected true or false)"),
    ("remote_port", "5600", "bad remote_port: '5600' (expected an integer from 0 to 65535)"),
    ("remote_port", 70000, "bad remote_port: 70000 (expected an integer from 0 to 65535)"),
    ("remote_port", True, "bad remote_port: True"),
    ("tp_size", 0, "bad tp_size: 0 (expected an integer from 1 up)"),
    ("remote_engine_id", 7, "bad remote_engine_id: 7 (expected a string)"),
    ("remote_block_ids", [[1, -2]], "bad remote_block_ids: [[1, -2]] (expected a list of block ids"),
    ("remote_block_ids", "1,2", "bad remote_block_ids"),
    ("remote_blocks_expiry_time", False, "bad remote_blocks_expiry_time: False (expected a number)"),
], ids=lambda v: str(v)[:20])
def test_a_field_of_the_wrong_type_is_named(field: str, value: object, message: str) -> None:
    with pytest.raises(InvalidKvTransferParams) as caught:
        KvTransferParams.from_wire({**ANSWER, field: value})
    assert message in str(caught.value)


def test_a_huge_bad_value_is_cut_short_in_the_message() -> None:
    with pytest.raises(InvalidKvTransferParams) as caught:
        KvTransferParams.from_wire({"remote_host": ["x" * 10_000]})
    assert len(str(caught.value)) < 200


def test_params_must_be_an_object() -> None:
    with pytest.raises(InvalidKvTransferParams, match="must be an object, not list"):
        KvTransferParams.from_wire([ANSWER])


@pytest.mark.parametrize(("change", "message"), [
    ({"do_remote_prefill": False}, "do not offer a remote prefill"),
    ({"remote_block_ids": [[]]}, "name no remote_block_ids"),
    ({"remote_block_ids": None}, "name no remote_block_ids"),
    ({"remote_host": None, "remote_request_id": ""}, "lack remote_host, remote_request_id"),
], ids=["no-remote-prefill", "empty-blocks", "no-blocks", "no-address"])
def test_a_prefill_answer_a_decode_pod_cannot_pull_with_is_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidKvTransferParams, match=message):
        parse_prefill_answer({**ANSWER, **change})
