"""Router config: built-ins are always there, and every mistake is a clear ValueError."""

from __future__ import annotations

import pytest

from kvflow.router import load_config
from kvflow.endpoints import Role


def test_builtins_need_no_config() -> None:
    config = load_config(None)
    assert {"round-robin", "least-load", "prefix-approx", "prefix-precise", "default"} <= set(config.profiles)
    assert config.default_profile == "default"
    assert (config.block_size, config.scrape_interval, config.scrape_idle_interval, config.pd_threshold) == (16, 0.5, 2.0, 256)


def test_default_profile_is_estimated_ttft_with_kv_lora_and_session_tie_breakers() -> None:
    weights = {r.plugin_ref: r.weight for r in load_config(None).profiles["default"].plugins if r.weight is not None}
    assert weights == {"ttft": 4, "kv-cache": 1, "lora-affinity": 1, "session-affinity": 1}


def test_user_profile_and_pool() -> None:
    config = load_config(
        {
            "blockSize": 32,
            "pool": {
                "endpoints": [
                    {
                        "address": "127.0.0.2:8000",
                        "role": "prefill",
                        "models": ["m"],
                        "kvEvents": "tcp://127.0.0.2:7000",
                    }
                ]
            },
            "plugins": [{"name": "sat", "type": "saturation-filter", "parameters": {"queueLimit": 4}}],
            "schedulingProfiles": [
                {
                    "name": "mine",
                    "plugins": [
                        {"pluginRef": "sat"},
                        {"pluginRef": "queue", "weight": 3},
                        {"pluginRef": "weighted-random"},
                    ],
                }
            ],
            "defaultProfile": "mine",
        }
    )
    (ep,) = config.endpoints
    assert (ep.id, ep.role, ep.models) == ("127.0.0.2:8000", Role.PREFILL, frozenset({"m"}))
    assert config.kv_events_address(ep) == "tcp://127.0.0.2:7000"
    assert config.default_profile == "mine" and config.block_size == 32


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"blockSiz": 16}, "blockSiz: Extra inputs are not permitted"),
        ({"schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "nope"}]}]}, "unknown plugin 'nope'"),
        (
            {"schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "queue"}, {"pluginRef": "max-score"}]}]},
            "scorer 'queue' needs a weight",
        ),
        (
            {"schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "max-score", "weight": 1}]}]},
            "picker 'max-score' takes no weight",
        ),
        (
            {"schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "queue", "weight": 1}]}]},
            "needs exactly one picker, has 0",
        ),
        (
            {
                "plugins": [{"name": "x", "type": "warp-drive"}],
                "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "x"}]}],
            },
            "unknown type 'warp-drive'",
        ),
        (
            {"plugins": [{"name": "s", "type": "saturation-filter", "parameters": {"queueLimt": 3}}]},
            "plugin 's' (saturation-filter): bad parameters: queueLimt: Extra inputs are not permitted",
        ),
        ({"defaultProfile": "fastest"}, "unknown profile 'fastest'"),
        ({"pd": {"prefillProfile": "nope"}}, "unknown profile 'nope'"),
        ({"pool": {"endpoints": [{"address": "nohost"}]}}, "expected HOST:PORT"),
        (
            {"plugins": [{"name": "a", "type": "queue-scorer"}, {"name": "a", "type": "queue-scorer"}]},
            "duplicate plugin name 'a'",
        ),
    ],
    ids=[
        "unknown-key",
        "dangling-ref",
        "missing-weight",
        "weight-on-picker",
        "no-picker",
        "unknown-type",
        "bad-param",
        "unknown-default",
        "unknown-prefill",
        "bad-address",
        "duplicate",
    ],
)
def test_strict(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config(raw)
    assert message in str(info.value)


def test_yaml_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "router.yaml"
    path.write_text("blockSize: 64\npd: {threshold: 1000}\n")
    config = load_config(path)
    assert (config.block_size, config.pd_threshold) == (64, 1000)


def test_cli_flags_build_a_config() -> None:
    from kvflow.router.cli import config_from_args, parse_args

    args = parse_args(
        [
            "--endpoint",
            "127.0.0.2:8000",
            "--prefill-endpoint",
            "127.0.0.3:8001",
            "--model",
            "m",
            "--block-size",
            "32",
            "--kv-events-port",
            "6000",
        ]
    )
    raw, endpoints = config_from_args(args)
    config = load_config(raw)
    assert [(e.id, e.role, e.models) for e in endpoints] == [
        ("127.0.0.2:8000", Role.BOTH, frozenset({"m"})),
        ("127.0.0.3:8001", Role.PREFILL, frozenset({"m"})),
    ]
    assert (config.block_size, config.kv_events_address(endpoints[0])) == (32, "tcp://127.0.0.2:6000")
