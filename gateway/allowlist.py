"""Which prefill pods a decode pod's sidecar may send a prompt to (llm-d's SSRF protection).

The endpoint picker names the prefill pod in ``x-prefiller-host-port``. Envoy removes that header
from client requests before the picker runs, but the sidecar's port can be reached inside the
cluster without Envoy, so the sidecar also checks the address against this list: an IP literal
only (a client-chosen host name is never resolved), allowed by an entry that is

* an address ``10.0.3.7`` (any port) or ``10.0.3.7:8000``;
* a network ``10.0.0.0/16``;
* a DNS name ``prefill.ns.svc.cluster.local`` (or ``NAME:PORT``): the addresses it resolves to,
  re-resolved every ``refresh`` seconds, as a headless Service lists its pods.

An empty list allows nothing: the sidecar then refuses the header with a 400.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
from collections.abc import Sequence

from kvflow.endpoints import parse_host_port

log = logging.getLogger("kvflow.sidecar")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_DNS_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def _ip(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class PrefillerAllowList:
    def __init__(self, entries: Sequence[str], refresh: float = 10.0) -> None:
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.addresses: set[tuple[Address, int | None]] = set()
        self.names: list[tuple[str, int | None]] = []
        self.resolved: set[tuple[Address, int | None]] = set()
        self.refresh = refresh
        for entry in entries:
            self._add(entry.strip())

    def _add(self, entry: str) -> None:
        if "/" in entry:
            self.networks.append(ipaddress.ip_network(entry, strict=False))  # ValueError names the entry
            return
        ip = _ip(entry.strip("[]"))
        if ip is not None:
            self.addresses.add((ip, None))
            return
        host, port = parse_host_port(entry, default_port=0)
        ip = _ip(host)
        if ip is not None:
            self.addresses.add((ip, port or None))
        elif _DNS_NAME.fullmatch(host):
            self.names.append((host, port or None))
        else:
            raise ValueError(f"not an address, network or DNS name: {entry!r}")

    @property
    def empty(self) -> bool:
        return not (self.networks or self.addresses or self.names)

    def allows(self, host: str, port: int) -> bool:
        ip = _ip(host)
        if ip is None:
            return False
        for allowed in (self.addresses, self.resolved):
            if (ip, None) in allowed or (ip, port) in allowed:
                return True
        return any(ip in network for network in self.networks)

    async def resolve(self) -> None:
        """Look the DNS names up once (off the event loop: getaddrinfo runs in a thread)."""
        loop = asyncio.get_running_loop()
        found: set[tuple[Address, int | None]] = set()
        for name, port in self.names:
            try:
                infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("cannot resolve allowed prefiller %s: %s", name, exc)
                continue
            for info in infos:
                ip = _ip(str(info[4][0]))
                if ip is not None:
                    found.add((ip, port))
        self.resolved = found

    async def keep_resolving(self) -> None:
        while self.names:
            await self.resolve()
            await asyncio.sleep(self.refresh)
