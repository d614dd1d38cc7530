"""Client bodies at every HTTP entry (gateway, sidecar), as an attacker writes them: P/D fields
under an escaped key, bodies declared over the limit, and more large bodies at once than the
process will hold. Raw sockets on 127.0.0.x; every refusal is an OpenAI error JSON."""

from __future__ import annotations

from tests.gateway import test_edge
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
