"""The router's HTTP port (``--metrics-port``): ``POST /tokenize`` shows the tokens it routes by."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvflow.router import Router, load_config
from kvflow.router.cli import metrics_app
from kvflow.endpoints import Endpoint
from kvflow.tokenizer import BuiltinTokenizer, prompt_token_ids

PROMPT = "You are a careful assistant. Summarise the report below in three lines."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture
async def router_url() -> AsyncIterator[str]:
    router = Router(load_config(None), [Endpoint("127.0.0.2", 8000)])
    server = TestServer(metrics_app(router), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("/tokenize"))
    finally:
        await server.close()


async def post(url: str, body: object) -> tuple[int, dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": PROMPT, "return_token_strs": True},
    {"model": "m", "prompt": PROMPT, "add_special_tokens": False},
    {"model": "m", "messages": MESSAGES},
], ids=["prompt", "prompt-no-specials", "chat"])
async def test_the_router_tokenizes_as_a_pod_of_its_pool_would(router_url: str, body: dict) -> None:  # type: ignore[type-arg]
    status, answer = await post(router_url, body)
    expected = prompt_token_ids(BuiltinTokenizer(), body)  # the simulator's tokenizer, the router's default
    assert status == 200
    assert answer["tokens"] == expected and answer["count"] == len(expected)
    assert answer["max_model_len"] > 0
    if body.get("return_token_strs"):
        assert "".join(answer["token_strs"][1:]) == PROMPT  # after <s>: the prompt's pieces, every one
    else:
        assert answer["token_strs"] is None


@pytest.mark.parametrize(("body", "says"), [
    ({"model": "m"}, "validation error"),  # neither a prompt nor messages
    ({"model": "m", "prompt": 7}, "validation error"),
    ({"model": "m", "messages": MESSAGES, "chat_template": "{{ 'x' }}"}, "--trust-request-chat-template"),
], ids=["empty", "not-a-string", "request-chat-template"])
async def test_bad_bodies_get_vllm_s_400(router_url: str, body: dict, says: str) -> None:  # type: ignore[type-arg]
    status, answer = await post(router_url, body)
    assert status == 400
    assert answer["error"]["code"] == 400 and says in answer["error"]["message"]


async def test_a_body_that_is_not_json_is_a_400_not_a_500(router_url: str) -> None:
    async with aiohttp.ClientSession() as session, session.post(router_url, data=b"{nope") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "Bad Request"
