"""The status page in a real browser: headless Chromium (Debian's, driven by Playwright) against
`kvflow up` with decode and prefill pods, while traffic flows. What a person sees: every pod
listed with its role, counts that move, plots drawn, and decisions whose explanation names the
pod chosen and the prefill pod; never a prompt. A screenshot goes to the test's tmp dir and to
bench/out/dashboard.png."""

from __future__ import annotations

import base64
import json
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack.test_up import Stack, start_stack, stop_stack

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
ROOT = Path(__file__).resolve().parents[2]
SECRET = "the fox with the purple umbrella"
"""Part of every prompt sent: the page must never show it."""
LONG = f"{SECRET}, a prompt long enough for a prefill pod to compute it " * 30


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    running = start_stack(tmp_path, "--decode", "2", "--prefill", "1")
    try:
        yield running
    finally:
        stop_stack(running)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed: `make test` installs Debian's with apt-get")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(tmp_path / "chromium-profile"), executable_path=CHROMIUM,
                                                       headless=True, args=FLAGS, viewport={"width": 1500, "height": 1400},
                                                       bypass_csp=True)  # the page forbids eval; waits use it
        try:
            yield context
        finally:
            context.close()


def send(url: str, prompt: str, *, stream: bool) -> None:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 12, "stream": stream}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


def served(page) -> int:  # type: ignore[no-untyped-def]
    """The requests the page says the pods served (the SERVED column, summed)."""
    cells = page.locator("tr[data-pod] td:nth-child(12)").all_inner_texts()
    return sum(int(c) for c in cells if c.isdigit())


def test_the_status_page_shows_pods_traffic_and_why_each_request_went_where_it_did(stack: Stack, browser,  # type: ignore[no-untyped-def]
                                                                                   tmp_path: Path) -> None:
    status = json.loads(urllib.request.urlopen(f"{stack.url}/v1/kvflow/status", timeout=10).read())
    pods = {p["id"]: p["role"] for p in status["models"][0]["pods"]}
    assert sorted(pods.values()) == ["decode", "decode", "prefill"]

    page = browser.new_page()  # type: ignore[attr-defined]
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{stack.url}/dashboard?interval=300")
    page.wait_for_function("document.querySelectorAll('tr[data-pod]').length === 3")
    rows = {r.get_attribute("data-pod"): r.locator("td").all_inner_texts() for r in page.locator("tr[data-pod]").all()}
    assert {pod: cells[1] for pod, cells in rows.items()} == pods  # every pod, with its role
    assert all(cells[2] == "healthy" for cells in rows.values())
    before = served(page)

    done = threading.Event()

    def traffic() -> None:
        try:
            for i in range(12):  # streamed: the pods' TTFT and ITL; long prompts go P/D
                send(stack.url, f"#{i} {LONG}" if i % 3 == 2 else f"{SECRET} #{i}", stream=True)  # nothing cached
        finally:
            done.set()

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    page.wait_for_function("[...document.querySelectorAll('tr.decision td:nth-child(3)')].some(td => td.textContent === 'pd')",
                           timeout=60_000)
    assert done.wait(60)
    sender.join()
    page.wait_for_function(f"""() => {{
        const cells = [...document.querySelectorAll('tr[data-pod] td:nth-child(12)')].map(td => Number(td.textContent) || 0);
        return cells.reduce((a, b) => a + b, 0) >= {before + 12};
    }}""", timeout=30_000)
    assert served(page) >= before + 12  # the numbers moved with the traffic
    plotted = page.evaluate("({ttft: series.ttft, itl: series.itl, rate: series.rate})")  # what the plots drew
    decoders = [pod for pod, role in pods.items() if role == "decode"]
    for kind in ("ttft", "itl", "rate"):
        points = [v for pod in decoders for v in plotted[kind][pod] if v is not None]
        assert points and max(points) > 0, kind

    decisions = page.locator("tr.decision").all()
    assert {row.locator("td").nth(2).inner_text() for row in decisions} == {"pd", "aggregated"}
    for row in decisions:
        cells = row.locator("td").all_inner_texts()
        mode, pick, prefill, why = cells[2], cells[3], cells[4], cells[7]
        assert pick in pods and pods[pick] == "decode"
        assert why.startswith(f"{pick} picked")  # the explanation names the chosen pod
        if mode == "pd":
            assert pods[prefill] == "prefill" and f"prefill on {prefill}" in why
        else:
            assert prefill == "–" and "aggregated" in why
    assert page.locator(".uplot").count() == 3  # TTFT, ITL and request-rate plots drawn
    assert SECRET not in page.content()  # no prompt text anywhere on the page
    assert not errors, errors

    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, out / "dashboard.png")
    assert shot.stat().st_size > 10_000


def test_behind_api_keys_the_page_opens_only_with_an_admin_key(sim_pods, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from kvflow.local.procs import ProcessGroup, kvflow_argv
    from tests.conftest import free_port

    pods = sim_pods(2, "--model", "sim-model", "--profile", "instant")
    (tmp_path / "keys.yaml").write_text("keys:\n  - {key: sk-ops, name: ops, admin: true}\n"
                                        "  - {key: sk-team, name: team}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with ProcessGroup(tmp_path / "gw") as group:
        group.start("gateway", kvflow_argv("gateway", "--port", str(port), "--model", "sim-model",
                                           *[a for p in pods for a in ("--endpoint", p.id)], "--no-batch",
                                           "--api-keys-file", str(tmp_path / "keys.yaml")),
                    ready_url=f"{url}/health")
        group.wait_ready(30)
        from playwright.sync_api import Error as BrowserError

        anonymous = browser.new_page()  # type: ignore[attr-defined]
        with pytest.raises(BrowserError, match="ERR_INVALID_AUTH_CREDENTIALS"):  # asked for a key, it had none
            anonymous.goto(f"{url}/dashboard")
        challenge = anonymous.request.get(f"{url}/dashboard")
        assert challenge.status == 401 and challenge.headers["www-authenticate"].startswith("Basic ")
        anonymous.close()
        for user, key, status in (("team", "sk-team", 403), ("ops", "sk-ops", 200)):
            page = browser.new_page()  # type: ignore[attr-defined]
            basic = base64.b64encode(f"{user}:{key}".encode()).decode()
            page.set_extra_http_headers({"Authorization": f"Basic {basic}"})  # as a browser sends a login
            assert page.goto(f"{url}/dashboard").status == status
            if status == 200:  # the page's own calls to the API carry the same credentials
                page.wait_for_function("document.querySelectorAll('tr[data-pod]').length === 2")
                assert set(page.locator("tr[data-pod]").evaluate_all("rows => rows.map(r => r.dataset.pod)")) == {
                    p.id for p in pods}
                assert page.locator("#error").inner_text() == ""
            page.close()
