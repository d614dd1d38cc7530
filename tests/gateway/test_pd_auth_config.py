"""The pure parts: P/D request builders, API-key parsing, and flags → config."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from kvflow.errors import AuthenticationError
from kvflow.gateway.auth import ANONYMOUS, ApiKey, Authenticator, keys_from_secret_data, parse_keys
from kvflow.gateway.cli import config_from_args, parser
from kvflow.gateway.flow import Rate
from kvflow.gateway.pd import PREFILL_KV_PARAMS, decode_body, kv_params_of, prefill_body
from kvflow.endpoints import Role
from kvflow.protocol.kv_transfer import InvalidKvTransferParams

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1", "remote_request_id": "r1",
          "remote_block_ids": [3, 4], "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1}


@pytest.mark.parametrize(("body", "expected"), [
    ({"model": "m", "prompt": "p", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}},
     {"model": "m", "prompt": "p", "max_tokens": 1, "stream": False}),
    ({"model": "m", "messages": [], "max_completion_tokens": 9, "min_tokens": 3, "min_completion_tokens": 2},
     {"model": "m", "messages": [], "max_tokens": 1, "max_completion_tokens": 1, "stream": False}),
], ids=["completions", "chat"])
def test_prefill_body(body, expected) -> None:  # type: ignore[no-untyped-def]
    assert prefill_body(body) == {**expected, "kv_transfer_params": dict(PREFILL_KV_PARAMS)}


def test_decode_body_adds_params_and_keeps_everything_else() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 50, "stream": True, "min_tokens": 3}
    assert decode_body(body, PARAMS) == {**body, "kv_transfer_params": PARAMS}
    assert decode_body({**body, "kv_transfer_params": {"x": 1}}, None) == body


@pytest.mark.parametrize(("raw", "expected"), [
    (json.dumps({"choices": [], "kv_transfer_params": PARAMS}).encode(), PARAMS),
    (b'{"choices": [], "kv_transfer_params": null}', None),
    (b'{"choices": []}', None),
    (b"not json", None),
])
def test_kv_params_of(raw, expected) -> None:  # type: ignore[no-untyped-def]
    assert kv_params_of(raw) == expected


@pytest.mark.parametrize(("change", "message"), [
    ({"remote_port": "5600"}, "bad remote_port"),
    ({"remote_host": None}, "lack remote_host"),
    ({"do_remote_prefill": False}, "do not offer a remote prefill"),
], ids=["wrong-type", "no-host", "no-remote-prefill"])
def test_params_a_decode_pod_could_not_pull_with_are_not_forwarded(change, message) -> None:  # type: ignore[no-untyped-def]
    raw = json.dumps({"choices": [], "kv_transfer_params": {**PARAMS, **change}}).encode()
    with pytest.raises(InvalidKvTransferParams, match=message):
        kv_params_of(raw)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@pytest.mark.parametrize(("text", "expected"), [
    ("sk-a\n# comment\n\nsk-b  # trailing\n", {digest("sk-a"): ApiKey("key-0"), digest("sk-b"): ApiKey("key-1")}),
    ("keys:\n  - {key: sk-a, name: team-a, priority: 5, rate: 2.5, burst: 4}\n  - {key: sk-b}\n",
     {digest("sk-a"): ApiKey("team-a", 5, Rate(2.5, 4)), digest("sk-b"): ApiKey("key-1")}),
], ids=["lines", "yaml"])
def test_parse_keys(text, expected) -> None:  # type: ignore[no-untyped-def]
    assert parse_keys(text) == expected


def test_parse_keys_rejects_an_entry_without_a_key() -> None:
    with pytest.raises(ValueError, match=r"keys\[0\]"):
        parse_keys("keys:\n  - {name: x}\n")


def test_keys_from_a_secret() -> None:
    data = {"team-a": base64.b64encode(b"sk-1\nsk-2\n").decode(), "team-b": base64.b64encode(b"sk-3").decode()}
    assert keys_from_secret_data(data) == {digest("sk-1"): ApiKey("team-a-0"), digest("sk-2"): ApiKey("team-a-1"),
                                           digest("sk-3"): ApiKey("team-b-0")}


@pytest.mark.parametrize(("header", "expected"), [
    ("Bearer sk-a", "team-a"), ("bearer  sk-a", "team-a"), (None, 401), ("Bearer nope", 401), ("Basic sk-a", 401),
])
def test_authenticator(header, expected) -> None:  # type: ignore[no-untyped-def]
    auth = Authenticator({digest("sk-a"): ApiKey("team-a")})
    if expected == 401:
        with pytest.raises(AuthenticationError):
            auth.check(header)
    else:
        assert auth.check(header).name == expected


def test_no_keys_means_anonymous() -> None:
    assert Authenticator(None).check(None) is ANONYMOUS


def test_flags_become_a_pool() -> None:
    args = parser().parse_args(["--port", "9000", "--model", "m", "--endpoint", "127.0.0.2:8000",
                                "--endpoint", "127.0.0.3:8000", "--prefill-endpoint", "127.0.0.4:8000",
                                "--profile", "pd", "--max-inflight", "8", "--idle-timeout", "5"])
    config = config_from_args(args)
    (pool,) = config.pools
    assert (config.port, pool.model, pool.profile) == (9000, "m", "pd")
    assert (config.flow.max_inflight, config.timeouts.idle) == (8, 5.0)
    assert [(e.id, e.role) for e in pool.all_endpoints()] == [
        ("127.0.0.4:8000", Role.PREFILL), ("127.0.0.2:8000", Role.DECODE), ("127.0.0.3:8000", Role.DECODE)]


@pytest.mark.parametrize("argv", [
    ["--model", "m"],
    ["--endpoint", "127.0.0.2:1", "--discover-timeout", "0"],  # no --model, and the pod cannot list its models
    ["--model", "m", "--endpoint", "nonsense"],
], ids=["model-without-endpoints", "nothing-to-discover", "bad-address"])
def test_bad_flags_are_errors(argv) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        config_from_args(parser().parse_args(argv))


def test_a_config_file_serves_many_models(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "gw.yaml"
    path.write_text("pools:\n  - {model: a, endpoints: ['127.0.0.2:8000']}\n"
                    "  - {model: b, endpoints: ['127.0.0.3:8000'], profile: pd}\n")
    config = config_from_args(parser().parse_args(["--config", str(path)]))
    assert [(p.model, p.profile) for p in config.pools] == [("a", "default"), ("b", "pd")]


@pytest.mark.parametrize(("argv", "code"), [
    (["--port", "1"], 2),                                   # no pools
    (["--sidecar"], 2),                                     # a sidecar needs --upstream
    (["--model", "m", "--endpoint", "bad"], 2),             # not HOST:PORT
])
def test_cli_refuses_bad_setups_with_exit_code_2(argv, code, capsys) -> None:  # type: ignore[no-untyped-def]
    from kvflow.gateway.cli import main

    assert main(argv) == code
    assert capsys.readouterr().err.startswith("kvflow gateway: ")
