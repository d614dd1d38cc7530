"""Router replicas of one pool tell each other what they routed (router/peers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from kvflow.endpoints import Endpoint, EndpointId
from kvflow.local.procs import free_port
from kvflow.router import Router, load_config
from kvflow.router.model import SchedulingRequest
from kvflow.router.peers import PREFILLED, RELEASED, SENT, Message, PeerLink, decode, encode, read_key
from tests.waiting import eventually

KEY = b"a key the replicas share, 32+ b"
POD = EndpointId("127.0.0.9:8000")


def test_a_message_reads_back_only_with_the_key_it_was_signed_with() -> None:
    sent = Message(b"sender01", SENT, 2**64 - 1, POD, [1, 2**64 - 1, 7], True, work=300, tokens=320)
    frames = encode(KEY, sent)
    assert decode(KEY, frames) == sent
    assert decode(b"another key, just as long as it", frames) is None
    assert decode(KEY, [frames[0], frames[1][:-1]]) is None  # cut short: the MAC no longer matches
    assert decode(KEY, frames[1:]) is None
    for other in (Message(b"sender01", PREFILLED, 7), Message(b"sender01", RELEASED, 7, undone=True),
                  Message(b"sender01", SENT, 8, POD)):
        assert decode(KEY, encode(KEY, other)) == other


def test_the_config_refuses_peers_without_a_shared_key_or_a_port(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="peers.keyFile"):
        load_config({"peers": {"port": 5571}})
    with pytest.raises(ValueError, match="peers.port is not"):
        load_config({"peers": {"addresses": ["10.0.0.2:5571"]}})
    with pytest.raises(ValueError, match="HOST:PORT"):
        load_config({"peers": {"port": 5571, "keyFile": "k", "addresses": ["10.0.0.2"]}})
    short = tmp_path / "short"
    short.write_bytes(b"too short\n")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        read_key(str(short))
    with pytest.raises(ValueError, match="No such file"):
        read_key(str(tmp_path / "missing"))


def replica(key_file: Path, pods: list[Endpoint], port: int, peer_ports: list[int]) -> Router:
    config = load_config({
        "kvEvents": {"enabled": False},  # pods that publish no KV events: the approximate index is all there is
        "peers": {"port": port, "keyFile": str(key_file), "addresses": [f"127.0.0.1:{p}" for p in peer_ports]},
    })
    return Router(config, pods)


async def test_a_replica_believes_what_its_peer_routed(tmp_path: Path, sim_pods) -> None:  # type: ignore[no-untyped-def]
    """Two replicas, pods without KV events: a prompt routed by one is cached where it went in
    the other's approximate index too, with the same fingerprints, and its request counts on
    that pod in the other's load until it ends; a failed attempt is taken back."""
    key_file = tmp_path / "peers.key"
    key_file.write_bytes(KEY + b"\n")
    pods = [Endpoint(p.host, p.port) for p in sim_pods(2)]
    ports = [free_port("127.0.0.1"), free_port("127.0.0.1")]
    a, b = replica(key_file, pods, ports[0], [ports[1]]), replica(key_file, pods, ports[1], [ports[0]])
    await a.start()
    await b.start()
    try:
        link_a, link_b = a.peers, b.peers
        assert isinstance(link_a, PeerLink) and isinstance(link_b, PeerLink)
        request = SchedulingRequest("r1", "sim-model", list(range(1, 200)))
        chain = a.fingerprints(request).all()
        assert chain == b.fingerprints(request).all()  # the shared key keys blocks alike
        await eventually(lambda: link_a.counts.peers and link_b.counts.peers, what="both subscribed")

        async def routed_until_heard() -> dict[EndpointId, int]:
            # PUB/SUB drops what is sent before a subscription is up: send until one arrives
            flight = a.decide(request)
            flight.dispatch()
            flight.finish()
            return b.approx.match(chain)

        held = await eventually(routed_until_heard, what="b hearing a's routing")
        pick = next(iter(held))
        assert held[pick] == len(chain) and pick in {p.id for p in pods}
        assert a.approx.match(chain)[pick] == len(chain)

        def in_flight(router: Router) -> dict[EndpointId, int]:
            return {v.id: v.in_flight for v in router.datastore.snapshot()}

        await eventually(lambda: not any(in_flight(b).values()), what="b hearing those requests end")
        flight = a.decide(SchedulingRequest("long", "sim-model", list(range(1, 200))))
        flight.dispatch()
        there = flight.result.targets[0].id
        await eventually(lambda: in_flight(b)[there] == 1, what="b counting a's request in flight")
        flight.first_token()
        flight.finish()
        await eventually(lambda: in_flight(b)[there] == 0, what="b hearing it end")

        flight = a.decide(SchedulingRequest("r2", "sim-model", list(range(1, 200))))
        flight.dispatch()
        failed_on = flight.result.targets[0]
        flight.failed(failed_on)
        flight.finish()
        await eventually(lambda: failed_on.id not in b.approx.match(chain), what="b taking the failed attempt back")
    finally:
        await a.stop()
        await b.stop()


async def test_messages_not_signed_with_the_shared_key_are_dropped_and_counted() -> None:
    heard: list[Message] = []
    port = free_port("127.0.0.1")
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    link = PeerLink(KEY, port, addresses=[f"127.0.0.1:{pub_port}"], on_message=heard.append, host="127.0.0.1")
    await link.start()
    try:
        message = Message(b"a-peer-1", SENT, 1, POD, [5], True, work=5, tokens=16)
        forged = encode(b"not the key the replicas share!", message)
        genuine = encode(KEY, message)

        async def sent_until_heard() -> bool:
            await pub.send_multipart(forged)
            await pub.send_multipart(genuine)
            return bool(heard)

        await eventually(sent_until_heard, what="the genuine message")
        assert heard[0] == message
        assert link.counts.refused >= 1 and link.counts.heard == len(heard)
    finally:
        await link.close()
        pub.close(0)
        ctx.term()


async def test_a_port_another_replica_holds_is_refused_in_one_line() -> None:
    port = free_port("127.0.0.1")
    first = PeerLink(KEY, port, on_message=lambda m: None, host="127.0.0.1")
    await first.start()
    second = PeerLink(KEY, port, on_message=lambda m: None, host="127.0.0.1")
    try:
        with pytest.raises(OSError, match=f"peers.port {port}: .*own port"):
            await second.start()
    finally:
        await second.close()
        await first.close()
