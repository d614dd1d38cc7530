"""Lease-based leader election: of the operator's replicas, exactly one reconciles.

It works like client-go's ``leaderelection``: a ``coordination.k8s.io/v1`` Lease names the
holder, which renews it every ``retry_period``. A candidate takes the Lease over when the holder
released it (empty ``holderIdentity``), or when it has watched the same record stay unchanged
for the Lease's ``leaseDurationSeconds`` *by its own clock*: no timestamps are compared across
machines, so clock skew cannot hand the Lease to two replicas. Every write carries the
``resourceVersion`` it read, so when two candidates race, the API server lets one win and
answers the other 409 Conflict.

The holder that cannot renew for ``renew_deadline`` (shorter than the lease duration) stops
reconciling before anyone else may start: ``hold`` raises ``LeadershipLost`` and the process
exits, to stand by afresh after its restart.

``may_take`` is the pure decision; ``LeaderElector`` does the I/O around it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvflow.operator.kube import ApiError, KubeClient
from kvflow.operator.objects import Obj

log = logging.getLogger(__name__)

LEASE_API = "coordination.k8s.io/v1"


class LeadershipLost(Exception):
    """The Lease could not be renewed in time, or another replica holds it now."""


@dataclasses.dataclass(frozen=True, slots=True)
class ElectionConfig:
    namespace: str
    identity: str
    name: str = "kvflow-operator"
    lease_duration: float = 10.0  # a dead leader is replaced after this (+ one retry period)
    renew_deadline: float = 7.0  # a leader that cannot renew this long steps down
    retry_period: float = 2.0  # renew, or try to acquire, this often


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    """A Lease record as this candidate last saw it, and when (its own monotonic clock)."""

    record: tuple[str, str, int]  # holder, renewTime, transitions: any change is a sign of life
    at: float


def record_of(lease: Mapping[str, Any]) -> tuple[str, str, int]:
    spec = lease.get("spec") or {}
    return (str(spec.get("holderIdentity") or ""), str(spec.get("renewTime") or ""),
            int(spec.get("leaseTransitions") or 0))


def may_take(lease: Mapping[str, Any] | None, identity: str, seen: Observation | None, now: float,
             default_duration: float) -> bool:
    """May ``identity`` write itself into this Lease now?"""
    if lease is None:
        return True
    holder, _, _ = record_of(lease)
    if not holder or holder == identity:
        return True
    if seen is None or seen.record != record_of(lease):
        return False  # the holder showed a sign of life since we last looked
    duration = float((lease.get("spec") or {}).get("leaseDurationSeconds") or default_duration)
    return now - seen.at >= duration


def _micro_time() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, client: KubeClient, config: ElectionConfig, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.client = client
        self.config = config
        self.clock = clock
        self.sleep = sleep
        self.seen: Observation | None = None
        self.leading = False
        self.last_renewed = float("-inf")

    def _observe(self, lease: Mapping[str, Any]) -> None:
        record = record_of(lease)
        if self.seen is None or self.seen.record != record:
            self.seen = Observation(record, self.clock())

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True if this replica holds the Lease afterwards."""
        cfg = self.config
        lease = await self.client.get(LEASE_API, "Lease", cfg.namespace, cfg.name)
        if lease is not None:
            self._observe(lease)
        if not may_take(lease, cfg.identity, self.seen, self.clock(), cfg.lease_duration):
            self.leading = False
            return False
        now = _micro_time()
        spec = {"holderIdentity": cfg.identity, "leaseDurationSeconds": int(cfg.lease_duration),
                "renewTime": now}
        try:
            if lease is None:
                written = await self.client.create({
                    "apiVersion": LEASE_API, "kind": "Lease",
                    "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                    "spec": {**spec, "acquireTime": now, "leaseTransitions": 0}})
            else:
                new: Obj = copy.deepcopy(dict(lease))
                old_holder = record_of(lease)[0]
                if old_holder != cfg.identity:
                    spec["acquireTime"] = now
                    spec["leaseTransitions"] = record_of(lease)[2] + 1  # as client-go counts
                new["spec"] = {**(new.get("spec") or {}), **spec}
                written = await self.client.replace(new)  # carries the resourceVersion we read
        except ApiError as exc:
            if exc.status in (409, 422):  # another candidate wrote first
                self.leading = False
                return False
            raise
        self._observe(written)
        if not self.leading:
            log.info("leader election: %s now holds lease %s/%s", cfg.identity, cfg.namespace, cfg.name)
        self.leading = True
        self.last_renewed = self.clock()
        return True

    async def acquire(self) -> None:
        """Stand by until this replica holds the Lease."""
        announced = False
        while True:
            try:
                if await self.try_acquire_or_renew():
                    return
            except ApiError as exc:
                log.warning("leader election: %s", exc)
            if not announced and self.seen is not None:
                log.info("leader election: standing by; %s holds lease %s/%s",
                         self.seen.record[0] or "nobody", self.config.namespace, self.config.name)
                announced = True
            await self.sleep(self.config.retry_period)

    async def hold(self) -> None:
        """Renew until the Lease is lost (raises ``LeadershipLost``); runs beside the operator."""
        while True:
            await self.sleep(self.config.retry_period)
            try:
                if not await self.try_acquire_or_renew():
                    raise LeadershipLost(f"{self.seen.record[0] if self.seen else 'another replica'} "
                                         "holds the lease now")
            except ApiError as exc:
                log.warning("leader election: renewing failed: %s", exc)
            if self.clock() - self.last_renewed > self.config.renew_deadline:
                self.leading = False
                raise LeadershipLost(f"could not renew the lease for {self.config.renew_deadline:g}s")

    async def release(self) -> None:
        """Hand the Lease back at shutdown, so a standby takes over at once."""
        if not self.leading:
            return
        self.leading = False
        cfg = self.config
        try:
            lease = await self.client.get(LEASE_API, "Lease", cfg.namespace, cfg.name)
            if lease is None or record_of(lease)[0] != cfg.identity:
                return
            new: Obj = copy.deepcopy(dict(lease))
            new["spec"] = {**(new.get("spec") or {}), "holderIdentity": None, "renewTime": _micro_time()}
            await self.client.replace(new)
            log.info("leader election: released lease %s/%s", cfg.namespace, cfg.name)
        except ApiError as exc:
            log.warning("leader election: releasing failed (%s); the standby waits for expiry", exc)
