"""The official OpenAI client against `kvflow gateway` (real router) in front of simulated pods,
all real processes on 127.0.0.x: chat and completions, streamed and not, models.list()."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from kvflow.local.procs import ProcessGroup, kvflow_argv
from tests.conftest import free_port

MODEL = "tiny"


@pytest.fixture
def stack(sim_pods, tmp_path: Path):  # type: ignore[no-untyped-def]
    """(the gateway's URL, the pods) for two simulated pods behind a real gateway."""
    pods = sim_pods(2, "--model", MODEL, "--profile", "instant")
    port = free_port()
    with ProcessGroup(tmp_path / "gw") as group:
        group.start("gateway", kvflow_argv("gateway", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                                           *[a for p in pods for a in ("--endpoint", p.id)], "--profile", "least-load"),
                    ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(30)
        yield f"http://127.0.0.1:{port}", pods


@pytest.fixture
def gateway_url(stack) -> str:  # type: ignore[no-untyped-def]
    return f"{stack[0]}/v1"


def post(url: str, body: object) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_the_gateway_tokenizes_as_its_pods_do_without_asking_them(stack) -> None:  # type: ignore[no-untyped-def]
    """vLLM's /tokenize, answered by the gateway with the tokenizer its router fingerprints with."""
    url, pods = stack
    for body in ({"model": MODEL, "prompt": "Once upon a time, in a land far away", "return_token_strs": True},
                 {"prompt": "no model named: the one served", "add_special_tokens": False},
                 {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Say something."}]}):
        status, ours = post(f"{url}/tokenize", body)
        assert status == 200, ours
        theirs = post(f"{pods[0].url}/tokenize", {"model": MODEL, **body})[1]
        assert ours["tokens"] == theirs["tokens"] and ours["count"] == len(ours["tokens"]) > 0  # type: ignore[arg-type]
        assert ours["token_strs"] == theirs["token_strs"]
    for body, status in (({"model": MODEL}, 400), ({"model": MODEL, "prompt": 7}, 400),
                         ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                           "chat_template": "{{ messages }}"}, 400),
                         ({"model": "no-such-model", "prompt": "x"}, 404),
                         ({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}],
                           "chat_template": "{{ messages }}"}, 404)):  # vLLM checks the model first
        ours, theirs = post(f"{url}/tokenize", body), post(f"{pods[0].url}/tokenize", body)
        assert ours[0] == theirs[0] == status, (ours, theirs)  # refused as the pods refuse it
        assert ours[1]["error"]["type"] == theirs[1]["error"]["type"], (ours, theirs)  # type: ignore[index]
    with pytest.raises(urllib.error.HTTPError) as wrong_method:
        urllib.request.urlopen(f"{url}/tokenize", timeout=10)
    wrong_method.value.close()  # the error holds the response's connection open until closed
    assert wrong_method.value.code == 405


def test_the_openai_client_against_the_gateway(gateway_url: str) -> None:
    client = openai.OpenAI(base_url=gateway_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]

    assert [m.id for m in client.models.list()] == [MODEL]

    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", 5)  # type: ignore[union-attr]

    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True))
    assert text

    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)


def test_pd_through_the_gateway_with_simulated_prefill_and_decode_pods(sim_pods, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (prefill,) = sim_pods(1, "--model", MODEL, "--profile", "instant", "--role", "prefill")
    (decode,) = sim_pods(1, "--model", MODEL, "--profile", "instant", "--role", "decode")
    router_config = tmp_path / "router.json"
    router_config.write_text('{"pd": {"threshold": 8}, "kvEvents": {"enabled": false}}')
    port = free_port()
    with ProcessGroup(tmp_path / "gw") as group:
        group.start("gateway", kvflow_argv("gateway", "--port", str(port), "--model", MODEL,
                                           "--endpoint", decode.id, "--prefill-endpoint", prefill.id,
                                           "--router-config", str(router_config)),
                    ready_url=f"http://127.0.0.1:{port}/health")
        group.wait_ready(30)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        prompt = "a long prompt that is well over the threshold of eight tokens " * 4
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, stream=True))
        # a different prompt: the decode pod now holds the first one's prefix, which the router knows
        whole = client.completions.create(model=MODEL, prompt="another " + prompt, max_tokens=6)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert streamed and whole.choices[0].text and whole.usage.completion_tokens == 6  # type: ignore[union-attr]
    routed = [line for line in metrics.splitlines() if line.startswith("kvflow_gateway_routed_total")]
    assert routed == [f'kvflow_gateway_routed_total{{mode="pd",model="{MODEL}"}} 2.0']
