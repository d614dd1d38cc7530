"""Client bodies at every HTTP entry (gateway, sidecar), as an attacker writes them: P/D fields
under an escaped key, bodies declared over the limit, and more large bodies at once than the
process will hold. Raw sockets on 127.0.0.x; every refusal is an OpenAI error JSON."""

from __future__ import annotations

import asyncio
import json

from tests.gateway import test_edge
from tests.gateway.test_app import COMPLETION
from tests.gateway.test_edge import answers, exchange, openai_error, post, sidecar_exchange

edge, sidecar_for = test_edge.edge, test_edge.sidecar_for  # the fixtures, shared with the edge suite

ESCAPED = b'{"model":"tiny","prompt":"hi","kv_transfer_p\\u0061rams":{"do_remote_prefill":true,"remote_host":"10.9.9.9"}}'


async def test_client_kv_transfer_params_under_an_escaped_key_are_refused_by_the_gateway(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge()
    [(status, _, body)] = answers(await exchange(stack, post(ESCAPED, headers=b"Connection: close\r\n")))
    assert (status, openai_error(body)["param"]) == (400, "kv_transfer_params")
    assert stack.pods[0].received == []


async def test_client_kv_transfer_params_under_an_escaped_key_are_refused_by_the_sidecar(sidecar_for) -> None:  # type: ignore[no-untyped-def]
    address, pod, _ = await sidecar_for()
    [(status, _, body)] = await sidecar_exchange(address, post(ESCAPED, headers=b"Connection: close\r\n"))
    assert (status, openai_error(body)["param"]) == (400, "kv_transfer_params")
    assert pod.received == []


async def test_a_body_declared_over_the_limit_is_refused_before_it_is_sent(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(max_body_bytes=4096)
    head = post(b"")[: -len(b"Content-Length: 0\r\n\r\n")] + b"Content-Length: 2147483648\r\n\r\n"
    [(status, headers, body)] = answers(await exchange(stack, head))  # not one byte of the body sent
    assert (status, headers["connection"], openai_error(body)["code"]) == (413, "close", 413)
    assert stack.pods[0].received == []


async def test_a_chunked_body_is_refused_once_it_passes_the_limit_without_reading_the_rest(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(max_body_bytes=4096)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunks = b"".join(b"400\r\n" + b"x" * 1024 + b"\r\n" for _ in range(5))  # 5 KiB, and no last chunk
    [(status, headers, body)] = answers(await exchange(stack, head + chunks))
    assert (status, headers["connection"], openai_error(body)["code"]) == (413, "close", 413)


async def open_body(stack, length: int, sent: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:  # type: ignore[no-untyped-def]
    """A connection whose request declares ``length`` body bytes and has sent ``sent`` of them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(stack.url.rsplit(":", 1)[1]))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (length, sent))
    await writer.drain()
    return reader, writer


async def test_bodies_beyond_the_shared_budget_get_503_unread_and_the_budget_frees_when_answered(edge) -> None:  # type: ignore[no-untyped-def]
    stack = await edge(max_body_bytes=1 << 20, http={"max_buffered_body_bytes": 1 << 20})
    body = json.dumps({**COMPLETION, "prompt": "x" * 600_000}).encode()
    reader, writer = await open_body(stack, len(body), body[:1000])  # admitted: it holds 600 KB of the budget
    [(status, headers, answer)] = answers(await exchange(stack, post(body)))
    assert (status, headers["retry-after"], openai_error(answer)["type"]) == (503, "1", "ServiceUnavailableError")
    writer.write(body[1000:])  # the first body completes and is answered: its bytes are given back
    assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
    writer.close()
    [(status, _, _)] = answers(await exchange(stack, post(body, headers=b"Connection: close\r\n")))
    assert status == 200
    assert len(stack.pods[0].received) == 2


async def test_the_sidecar_holds_bodies_inside_the_same_budget(sidecar_for) -> None:  # type: ignore[no-untyped-def]
    address, pod, _ = await sidecar_for(max_body_bytes=1 << 20, http={"max_buffered_body_bytes": 1 << 20})
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: s\r\nContent-Length: 600000\r\n\r\n{")
    await writer.drain()
    [(status, headers, body)] = await sidecar_exchange(address, post(b"{" + b" " * 599_998 + b"}"))
    assert (status, headers["retry-after"], openai_error(body)["code"]) == (503, "1", 503)
    writer.close()
    assert pod.received == []
