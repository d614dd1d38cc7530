"""The simulator process: faults, LoRA adapters, client disconnects and idleness."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import pytest

from kvflow.sim.profiles import PROFILES
from tests.conftest import SimPod
from tests.waiting import eventually_blocking

COMPLETION = {"model": "sim-model", "prompt": "hello there", "max_tokens": 3}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle(pod: SimPod) -> dict[str, Any] | None:
    """The pod's ``/_sim/state`` once it runs and queues nothing."""
    state: dict[str, Any] = json.loads(pod.get("/_sim/state"))
    return state if state["running"] == state["waiting"] == 0 else None


def test_fail_rate_one_answers_500_in_openai_shape_and_zero_recovers(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--fault-fail-rate", "1")
    status, body = pod.post_json("/v1/completions", COMPLETION)
    assert (status, body["error"]["type"], body["error"]["code"]) == (500, "InternalServerError", 500)
    assert pod.post_json("/_sim/faults", {"fail_rate": 0})[1]["fail_rate"] == 0
    assert pod.post_json("/v1/completions", COMPLETION)[0] == 200


@pytest.mark.parametrize(("patch", "message"), [
    ({"fail_rate": 2}, "fail_rate must be a number in [0, 1]"),
    ({"slow_factor": 0}, "slow_factor must be a positive number"),
    ({"explode": True}, "unknown fault(s): explode"),
])
def test_bad_fault_updates_are_rejected_whole(sim_pods: Any, patch: dict[str, Any], message: str) -> None:
    [pod] = sim_pods(1, "--profile", "instant")
    status, body = pod.post_json("/_sim/faults", {"stall_after_tokens": 5, **patch})
    assert (status, body["error"]["message"]) == (400, message)
    assert json.loads(pod.get("/_sim/faults"))["stall_after_tokens"] is None


def test_stall_after_n_tokens_stops_the_stream(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--fault-stall-after", "2")
    body = json.dumps({**COMPLETION, "max_tokens": 10, "stream": True}).encode()
    with socket.create_connection((pod.host, pod.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.settimeout(1.0)
        received = b""
        with pytest.raises(TimeoutError):
            while True:
                received += s.recv(65536)
    assert received.count(b"data: {") == 2 and b"[DONE]" not in received
    # the hung stream's request went on in the engine and finished; the pod stays healthy
    assert pod.get("/health") == b""


def test_slow_factor_stretches_every_step(sim_pods: Any) -> None:
    # a lower bound only: a step may overrun its modelled time, never undercut it
    [pod] = sim_pods(1, "--profile", "cpu-tiny")
    pod.post_json("/_sim/faults", {"slow_factor": 20})
    started = time.monotonic()
    pod.post_json("/v1/completions", {**COMPLETION, "max_tokens": 5})
    assert time.monotonic() - started >= 5 * 20 * PROFILES["cpu-tiny"].step_base_s


def test_crash_exits_the_process_with_status_1(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--fault-crash-after", "1")
    assert pod.post_json("/v1/completions", COMPLETION)[0] == 200
    with pytest.raises(OSError):
        pod.post_json("/v1/completions", COMPLETION)
    assert pod.child.popen.wait(timeout=5) == 1


def test_lora_adapters_are_served_listed_and_reported(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat")
    models = json.loads(pod.get("/v1/models"))["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in models] == [
        ("sim-model", "sim-model", None),
        ("sql", "/adapters/sql", "sim-model"),
        ("chat", "/adapters/chat", "sim-model"),
    ]
    assert pod.post_json("/v1/completions", {**COMPLETION, "model": "sql"})[0] == 200
    metrics = pod.get("/metrics").decode()
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}' in metrics


def test_a_client_that_disconnects_mid_stream_frees_its_request(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "h100-llama8b")
    body = json.dumps({**COMPLETION, "max_tokens": 5000, "stream": True}).encode()
    with socket.create_connection((pod.host, pod.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        assert json.loads(pod.get("/_sim/state"))["running"] == 1
    state = eventually_blocking(lambda: idle(pod), timeout=5, what="the pod to drop the cut-off request")
    assert state["kv_cache_usage"] == 0.0
    # as in vLLM, an aborted request is no finished request; its cut-off stream was a 2xx
    metrics = pod.get("/metrics").decode()
    assert 'finished_reason="abort",model_name="sim-model"} 0.0' in metrics
    assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="sim-model"} 0.0' in metrics
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 1.0' in metrics


def test_an_idle_simulator_uses_no_cpu(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant")
    pod.post_json("/v1/completions", COMPLETION)
    eventually_blocking(lambda: idle(pod), what="the pod to finish the request")
    before = cpu_seconds(pod.child.popen.pid)
    time.sleep(1.5)  # the window the CPU is measured over: time passing, with nothing to do, is the test
    assert cpu_seconds(pod.child.popen.pid) - before < 0.05


def test_role_is_reported(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant", "--role", "decode")
    assert json.loads(pod.get("/_sim/state"))["role"] == "decode"


def test_sim_pods_with_kv_events_publish_on_a_socket_subscribers_connect_to(sim_pods: Any) -> None:
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    [pod] = sim_pods(1, "--profile", "instant", kv_events=True)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(pod.kv_events)
    try:
        # connected: the subscription goes out right after the handshake, long before the request below
        assert monitor.poll(5000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        sub.disable_monitor()
        pod.post_json("/v1/completions", {"model": "sim-model", "prompt": list(range(40)), "max_tokens": 1})
        assert sub.poll(5000)
        topic, seq, _ = sub.recv_multipart()
        assert (topic, seq) == (f"kv@{pod.host}:{pod.port}".encode(), bytes(8))
    finally:
        monitor.close(linger=0)
        sub.close(linger=0)


def test_greedy_answers_repeat_and_choice_j_samples_with_seed_plus_j(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant")
    greedy = {**COMPLETION, "temperature": 0, "max_tokens": 6}
    assert len({pod.post_json("/v1/completions", greedy)[1]["choices"][0]["text"] for _ in range(3)}) == 1
    three = pod.post_json("/v1/completions", {**COMPLETION, "max_tokens": 6, "n": 3, "seed": 40})[1]["choices"]
    alone = [pod.post_json("/v1/completions", {**COMPLETION, "max_tokens": 6, "seed": 40 + j})[1]["choices"][0]
             for j in range(3)]
    assert [c["text"] for c in three] == [c["text"] for c in alone]  # vLLM's ParentRequest: seed + index


def test_a_stop_string_ends_the_text_and_stays_in_it_only_when_asked(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant")
    greedy = {**COMPLETION, "temperature": 0, "max_tokens": 6}
    stop = pod.post_json("/v1/completions", greedy)[1]["choices"][0]["text"][:4]
    plain = pod.post_json("/v1/completions", {**greedy, "stop": stop})[1]["choices"][0]
    kept = pod.post_json("/v1/completions", {**greedy, "stop": stop, "include_stop_str_in_output": True})[1]
    assert (plain["text"], plain["finish_reason"], plain["stop_reason"]) == ("", "stop", stop)
    assert kept["choices"][0]["text"] == stop


def test_load_stays_0_without_load_tracking(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "h100-llama8b")
    body = json.dumps({**COMPLETION, "max_tokens": 2000, "stream": True}).encode()
    with socket.create_connection((pod.host, pod.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        assert json.loads(pod.get("/load")) == {"server_load": 0}  # as vLLM without the flag


def test_chats_with_parts_no_content_and_developer_render_with_the_builtin_tokenizer(sim_pods: Any) -> None:
    [pod] = sim_pods(1, "--profile", "instant")
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief"}]},
                {"role": "user", "content": "hi"}, {"role": "assistant"}]
    status, tokens = pod.post_json("/tokenize", {"messages": messages, "add_generation_prompt": False})
    _, text = pod.post_json("/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200
    assert text["prompt"] == ("<|im_start|>system\nBe\nbrief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                              "<|im_start|>assistant\n<|im_end|>\n")
    status, body = pod.post_json("/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                          "add_generation_prompt": False, "return_token_ids": True})
    assert (status, body["prompt_token_ids"], body["choices"][0]["message"]["role"]) == (200, tokens["tokens"],
                                                                                          "assistant")


def test_tool_choices_take_vllms_tool_flags(sim_pods: Any) -> None:
    tools = [{"type": "function", "function": {"name": "weather"}}]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools}
    [plain, tooled] = sim_pods(1, "--profile", "instant") + sim_pods(
        1, "--profile", "instant", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    status, body = plain.post_json("/v1/chat/completions", chat)  # tools imply tool_choice "auto"
    assert (status, body["error"]["message"]) == (
        400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    assert [tooled.post_json("/v1/chat/completions", {**chat, "tool_choice": c})[0]
            for c in ("auto", "required", {"type": "function", "function": {"name": "weather"}})] == [200] * 3


def test_auto_tool_choice_without_a_parser_is_refused_at_start_up() -> None:
    from kvflow.sim.cli import main

    assert main(["--enable-auto-tool-choice", "--port", "0"]) == 2
