"""Every `kvflow ...` mistake is one line on stderr (never a traceback), found before anything
starts; abbreviated options are refused."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvflow.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's own refusals
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    return rc, err.strip().splitlines()


def test_an_abbreviated_option_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, err = run(capsys, "up", "--prefil", "1", "--log-dir", str(tmp_path / "logs"))
    assert rc == 2 and err == ["kvflow up: unrecognized arguments: --prefil 1 (see --help)"]
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("argv", [
    ["gateway", "--port", "many"], ["sim", "--no-such-flag"], ["router", "--metrics-port"],
    ["operator"], ["operator", "render"], ["batch", "status"], ["tokenizer", "fetch"], ["status", "--nope"],
], ids=["gateway", "sim", "router", "operator", "operator-render", "batch", "tokenizer", "status"])
def test_every_commands_option_mistakes_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    rc, err = run(capsys, *argv)
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvflow ") and err[0].endswith("(see --help)"), err


def test_an_unknown_profile_is_refused_before_any_pod_starts(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    rc, err = run(capsys, "up", "--profile", "nosuch", "--log-dir", str(tmp_path / "logs"))
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvflow up: unknown --profile 'nosuch' (profiles: ")
    assert not (tmp_path / "logs").exists()  # no child was started (the group makes its log dir first)


def test_a_router_config_that_is_not_yaml_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "router.yaml"
    bad.write_text("schedulingProfiles: [\n")
    rc, err = run(capsys, "gateway", "--model", "m", "--endpoint", "127.0.0.2:1", "--router-config", str(bad))
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"kvflow gateway: invalid router config {bad}: ")


def test_a_router_config_that_is_missing_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, err = run(capsys, "router", "--config", str(tmp_path / "nope.yaml"))
    assert rc == 2 and len(err) == 1 and str(tmp_path / "nope.yaml") in err[0]
    assert "Traceback" not in err[0]


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read {path}: No such file or directory"),
    ("a: [\n", "{path} is not YAML: "),
], ids=["missing", "not-yaml"])
def test_operator_render_of_a_bad_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                   content: str | None, message: str) -> None:
    path = tmp_path / "svc.yaml"
    if content is not None:
        path.write_text(content)
    rc, err = run(capsys, "operator", "render", str(path))
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvflow operator render: " + message.format(path=path))


def _parsers(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("ArgumentParser", "add_parser")]


@pytest.mark.parametrize("folder", ["kvflow", "gateway", "router", "sim", "kube_operator", "sidecar", "beam", "bench"])
def test_no_parser_accepts_abbreviations(folder: str) -> None:
    lax = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for call in _parsers(ast.parse(path.read_text())):
            flags = {k.arg: k.value for k in call.keywords}
            if not (isinstance(flags.get("allow_abbrev"), ast.Constant) and flags["allow_abbrev"].value is False):
                lax.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert lax == []
