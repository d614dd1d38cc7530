"""Fixtures for P/D transfer tests: free side-channel ports and in-process NixlTransfer pods.

The pods of one test share a ``FakeClock`` that moves only when the test moves it (``clock``):
leases and heartbeats happen when the test says. The bytes, handshakes and notifications between
pods are real NIXL and ZMQ I/O on other threads, which no clock controls: the tests wait for
their effects with ``tests/waiting.py``'s ``eventually``.
"""

from __future__ import annotations

import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from kvflow.sim.clock import FakeClock
from kvflow.sim.kv_transfer import TransferConfig


def side_channel_port(host: str = "127.0.0.1") -> int:
    """A free port below Linux's ephemeral range (32768+), where nothing else picks ports at random."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


@dataclass
class FakeHost:
    """The engine side of ``KVHost``: a pool geometry and a record of what was unpinned."""

    num_blocks: int = 64
    block_size: int = 16
    bytes_per_block: int = 4096
    unpinned: list[str] = field(default_factory=list)

    def unpin(self, request_id: str) -> None:
        self.unpinned.append(request_id)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(jump=False)


@pytest.fixture
async def nixl_pods(clock: FakeClock) -> AsyncIterator[Callable[..., Awaitable[tuple[object, FakeHost]]]]:
    """``await nixl_pods(engine_id, **options)`` → a started NixlTransfer on ``clock`` and its FakeHost."""
    from kvflow.sim.nixl import NixlOptions, NixlTransfer

    started: list[NixlTransfer] = []

    async def make(engine_id: str, *, pin_timeout_s: float = 60.0, port: int | None = None,
                   num_blocks: int = 64, **options: object) -> tuple[NixlTransfer, FakeHost]:
        config = TransferConfig(engine_id=engine_id, host="127.0.0.1", port=port or side_channel_port(),
                                pin_timeout_s=pin_timeout_s)
        transfer = NixlTransfer(config, NixlOptions(**{"handshake_timeout": 1.0, **options}),  # type: ignore[arg-type]
                                clock=clock)
        host = FakeHost(num_blocks=num_blocks)
        transfer.attach(host)
        await transfer.start()
        started.append(transfer)
        return transfer, host

    yield make
    for transfer in reversed(started):
        await transfer.stop()
