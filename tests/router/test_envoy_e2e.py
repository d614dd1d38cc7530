"""A real Envoy in front of simulated vLLM pods, with ``kvflow router`` as its ext_proc.

The stack is started once for the module (3 sim pods, the router, one Envoy with a fail-closed
and a fail-open listener and a lean one that keeps answers' bodies away from the picker, and a private HTTP server that is no pod: a request reaching it would
be server-side request forgery) and always stopped. The tests run in file order; the last ones
stop the router to check what each listener does without it.
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from kvflow.local.procs import Child, ProcessGroup, free_port, kvflow_argv
from kvflow.router.envoy_config import Listener, envoy_binary, render
from kvflow.endpoints import Endpoint
from tests.waiting import eventually_blocking

MODEL = "sim-model"
MAX_BODY = 256 * 1024


@dataclass
class Stack:
    pods: list[Endpoint]
    router: Child
    router_http: str
    router_grpc: str
    closed: str
    """Envoy listener that fails closed when the router is down."""
    open: str
    """Envoy listener that fails open (to a round-robin cluster)."""
    lean: str
    """Envoy listener that relays answers' bodies itself (``response_bodies=False``)."""
    group: ProcessGroup
    private: str = ""
    """HOST:PORT of an HTTP server that is not part of the pool."""
    private_hits: list[str] = field(default_factory=list)


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str]

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("envoy-e2e")
    with ProcessGroup(tmp / "logs") as group:
        pods, pool = [], []
        for i in range(3):
            host = f"127.0.0.{60 + i}"
            port, kv_port = free_port(host), free_port(host)
            group.start(
                f"sim{i}",
                kvflow_argv(
                    "sim",
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--profile",
                    "fast",
                    "--kv-events-endpoint",
                    f"tcp://*:{kv_port}",
                    "--enable-admin-routes",  # so that only Envoy's allow-list keeps clients off them
                ),
                env={"PYTHONHASHSEED": "0"},
                ready_url=f"http://{host}:{port}/health",
            )
            pods.append(Endpoint(host, port))
            pool.append({"address": f"{host}:{port}", "models": [MODEL], "kvEvents": f"tcp://{host}:{kv_port}"})
        config = tmp / "router.yaml"
        config.write_text(yaml.safe_dump({"pool": {"endpoints": pool}}))
        grpc_port, http_port = free_port(), free_port()
        router = group.start(
            "router",
            kvflow_argv("router", "--config", str(config), "--port", str(grpc_port), "--metrics-port", str(http_port),
                        "--max-body-bytes", str(MAX_BODY),
                        "--grpc-health-port", "0", "--no-secure-serving"),  # Envoy speaks plaintext here
            ready_url=f"http://127.0.0.1:{http_port}/healthz",
        )
        closed, opened, lean, admin = free_port(), free_port(), free_port(), free_port()
        bootstrap = render(
            [Listener("127.0.0.1", closed), Listener("127.0.0.1", opened, fail_open=True),
             Listener("127.0.0.1", lean, response_bodies=False)],
            ("127.0.0.1", grpc_port),
            pods,
            admin=("127.0.0.1", admin),
            expose_picked_endpoint=True,  # the tests below check the pick against the pods' counters
        )
        (tmp / "envoy.json").write_text(json.dumps(bootstrap))
        group.start(
            "envoy",
            [str(envoy_binary()), "-c", str(tmp / "envoy.json"), "--disable-hot-restart", "-l", "warning"],
            ready_url=f"http://127.0.0.1:{admin}/ready",
        )
        group.wait_ready(60)
        hits: list[str] = []
        recorder = type("Recorder", (_Recorder,), {"hits": hits})
        private = http.server.ThreadingHTTPServer(("127.0.0.70", 0), recorder)
        threading.Thread(target=private.serve_forever, daemon=True).start()
        try:
            yield Stack(
                pods,
                router,
                f"http://127.0.0.1:{http_port}",
                f"127.0.0.1:{grpc_port}",
                f"http://127.0.0.1:{closed}",
                f"http://127.0.0.1:{opened}",
                f"http://127.0.0.1:{lean}",
                group,
                f"127.0.0.70:{private.server_address[1]}",
                hits,
            )
        finally:
            private.shutdown()
            private.server_close()


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        with e:  # the error holds the response's connection open until closed
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def served(pods: list[Endpoint]) -> dict[str, float]:
    """Prompt tokens each pod has processed, from its own /metrics."""
    out = {}
    for pod in pods:
        with urllib.request.urlopen(pod.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out[pod.id] = sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prompt_tokens_total")
        )
    return out


def prompt(group: int, words: int = 200) -> str:
    return " ".join(f"g{group}w{i}" for i in range(words))


def test_traffic_follows_the_picker(stack: Stack) -> None:
    for group in range(6):
        before = served(stack.pods)
        status, headers, _ = post(stack.closed, {"model": MODEL, "prompt": prompt(group), "max_tokens": 2})
        assert status == 200
        after = served(stack.pods)
        grew = [pod for pod in before if after[pod] > before[pod]]
        picked = get_json(stack.router_http + "/debug/decisions?n=1")[0]["targets"][0]
        assert grew == [picked] == [headers["x-kvflow-endpoint"]]


def test_shared_prefix_sticks_to_one_pod(stack: Stack) -> None:
    picks = set()
    for i in range(4):
        status, headers, _ = post(
            stack.closed, {"model": MODEL, "prompt": prompt(99) + f" question {i}", "max_tokens": 2}
        )
        assert status == 200
        picks.add(headers["x-kvflow-endpoint"])
    assert len(picks) == 1
    last = get_json(stack.router_http + "/debug/decisions?n=1")[0]
    assert last["cached_tokens"] >= 192


def test_streaming_passes_through_and_ends_accounting(stack: Stack) -> None:
    req = urllib.request.Request(
        stack.closed + "/v1/completions",
        json.dumps({"model": MODEL, "prompt": prompt(7), "max_tokens": 5, "stream": True}).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert len(events) >= 5 and events[-1] == "data: [DONE]"
    endpoints = get_json(stack.router_http + "/debug/endpoints")
    assert [e["in_flight"] for e in endpoints] == [0, 0, 0]


def in_flight(stack: Stack) -> dict[str, int]:
    return {e["endpoint"]: e["in_flight"] for e in get_json(stack.router_http + "/debug/endpoints")}


def stream_request(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                  {"content-type": "application/json"})


def test_a_lean_listener_routes_and_streams_past_the_picker(stack: Stack) -> None:
    before = served(stack.pods)
    with urllib.request.urlopen(stream_request(stack.lean, {"model": MODEL, "prompt": prompt(8), "max_tokens": 5}),
                                timeout=30) as r:
        picked = r.headers["x-kvflow-endpoint"]
        events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert len(events) >= 5 and events[-1] == "data: [DONE]"
    after = served(stack.pods)
    assert [pod for pod in before if after[pod] > before[pod]] == [picked]
    eventually_blocking(lambda: set(in_flight(stack).values()) == {0}, what="every pod's in-flight count back at 0")


def test_a_lean_listener_holds_a_request_in_flight_until_its_answer_ends(stack: Stack) -> None:
    """The picker sees none of the answer's body: Envoy ending the ext_proc stream is its end."""
    for pod in stack.pods:
        request(pod.url, "/_sim/faults", "POST", json.dumps({"stall_after_tokens": 2}).encode())
    try:
        with urllib.request.urlopen(stream_request(stack.lean, {"model": MODEL, "prompt": prompt(9),
                                                                "max_tokens": 50}), timeout=30) as r:
            picked = r.headers["x-kvflow-endpoint"]
            assert r.readline().startswith(b"data: ")  # answering, and stalled before its end
            assert in_flight(stack)[picked] == 1
        # the client hung up: Envoy resets the answer and ends the picker's stream
        eventually_blocking(lambda: in_flight(stack)[picked] == 0, what="the stalled request released")
    finally:
        for pod in stack.pods:
            request(pod.url, "/_sim/faults", "POST", json.dumps({"stall_after_tokens": None}).encode())


def test_fail_open_listener_routes_through_the_picker_too(stack: Stack) -> None:
    before = served(stack.pods)
    status, headers, _ = post(stack.open, {"model": MODEL, "prompt": prompt(42), "max_tokens": 2})
    after = served(stack.pods)
    assert status == 200
    assert [pod for pod in before if after[pod] > before[pod]] == [headers["x-kvflow-endpoint"]]


def test_no_endpoint_fits_is_503(stack: Stack) -> None:
    status, _, body = post(stack.closed, {"model": "no-such-model", "prompt": "hi", "max_tokens": 1})
    assert status == 503
    assert json.loads(body)["error"]["type"] == "ServiceUnavailableError"


def test_bad_json_is_400(stack: Stack) -> None:
    req = urllib.request.Request(stack.closed + "/v1/completions", b"{not json", {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    info.value.close()  # the error holds the response's connection open until closed
    assert info.value.code == 400


def test_router_metrics(stack: Stack) -> None:
    with urllib.request.urlopen(stack.router_http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'kvflow_router_decisions_total{pool="default",profile="default",result="aggregated"}' in text
    assert "kvflow_router_scheduling_seconds_bucket" in text
    assert 'kvflow_router_endpoint_score{endpoint="127.0.0.60' in text
    assert "kvflow_router_kv_events_total" in text


def test_grpc_health_says_serving(stack: Stack) -> None:
    import grpc

    pytest.importorskip("grpc_health", reason="grpcio-health-checking not installed")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(stack.router_grpc) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def request(url: str, path: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, body, {"content-type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def routing_headers(stack: Stack) -> dict[str, str]:
    """Everything a client could send to choose a pod, all pointing at the private server."""
    return {"x-gateway-destination-endpoint": stack.private, "x-prefiller-host-port": stack.private,
            "x-prefiller-url": f"http://{stack.private}", "x-kvflow-profile": "no-such-profile"}


@pytest.mark.parametrize("listener", ["closed", "open"])
def test_client_routing_headers_never_choose_the_pod(stack: Stack, listener: str) -> None:
    url = getattr(stack, listener)
    before = served(stack.pods)
    status, headers, body = post(url, {"model": MODEL, "prompt": prompt(11), "max_tokens": 2}, routing_headers(stack))
    after = served(stack.pods)
    assert status == 200, body  # an honoured x-kvflow-profile would have named an unknown profile: 503
    assert [pod for pod in before if after[pod] > before[pod]] == [headers["x-kvflow-endpoint"]]
    assert stack.private_hits == []


@pytest.mark.parametrize("listener", ["closed", "open"])
def test_only_openai_routes_reach_the_pods(stack: Stack, listener: str) -> None:
    url = getattr(stack, listener)
    for method, path in (("GET", "/_sim/faults"), ("POST", "/_sim/faults"), ("GET", "/metrics"),
                         ("POST", "/reset_prefix_cache"), ("GET", "/v1/completions/../../_sim/state")):
        status, body = request(url, path, method, b'{"fail_rate": 1}' if method == "POST" else None)
        assert (status, json.loads(body)["error"]["type"]) == (404, "NotFoundError"), path
    assert all(json.loads(pod_get(pod, "/_sim/faults"))["fail_rate"] == 0 for pod in stack.pods)
    status, body = request(url, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL


def pod_get(pod: Endpoint, path: str) -> bytes:
    with urllib.request.urlopen(pod.url + path, timeout=10) as r:
        return bytes(r.read())


@pytest.mark.parametrize("key", ["kv_transfer_params", "kv_transfer_p\\u0061rams"], ids=["plain", "escaped"])
@pytest.mark.parametrize("listener", ["closed", "open"])
def test_client_kv_transfer_params_are_refused(stack: Stack, listener: str, key: str) -> None:
    params = {"do_remote_prefill": True, "remote_host": stack.private.split(":")[0],
              "remote_port": int(stack.private.split(":")[1]), "remote_engine_id": "x", "remote_block_ids": [1]}
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "PARAMS": params}).replace("PARAMS", key)
    assert "kv_transfer_params" in json.loads(raw)  # what a pod would read
    req = urllib.request.Request(getattr(stack, listener) + "/v1/completions", raw.encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    error = json.loads(body)["error"]
    assert (status, error["type"], error["param"]) == (400, "BadRequestError", "kv_transfer_params")
    assert stack.private_hits == []


@pytest.mark.parametrize("listener", ["closed", "open"])
def test_the_router_caps_buffered_bodies(stack: Stack, listener: str) -> None:
    status, _, body = post(getattr(stack, listener), {"model": MODEL, "prompt": "x " * MAX_BODY, "max_tokens": 1})
    assert (status, json.loads(body)["error"]["code"]) == (413, 413)


def test_fail_closed_and_fail_open_without_router(stack: Stack) -> None:
    stack.group.stop(stack.router)
    status, _, _ = post(stack.closed, {"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert status >= 500
    status, _, body = post(stack.open, {"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert status == 200 and json.loads(body)["object"] == "text_completion"


def test_without_router_fail_close_is_503_and_fail_open_ignores_client_destinations(stack: Stack) -> None:
    status, headers, body = post(stack.closed, {"model": MODEL, "prompt": "hello", "max_tokens": 1},
                                 routing_headers(stack))
    error = json.loads(body)["error"]
    assert (status, error["type"], error["code"], headers["retry-after"]) == (503, "ServiceUnavailableError", 503, "1")
    assert "router" in error["message"]
    for _ in range(3):
        status, _, body = post(stack.open, {"model": MODEL, "prompt": "hello", "max_tokens": 1}, routing_headers(stack))
        assert status == 200 and json.loads(body)["object"] == "text_completion", body
    assert stack.private_hits == []
