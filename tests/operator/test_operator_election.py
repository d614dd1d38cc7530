"""Leader election decisions (pure) and the elector's stepping down, with its client faked at
our own seam (``KubeClient``); tests/operator/test_operator_ha.py runs real replicas."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.operator.election import ElectionConfig, LeaderElector, LeadershipLost, Observation, may_take, record_of
from kvflow.operator.kube import ApiError


def lease(holder: str | None, renew: str = "t0", transitions: int = 0, duration: int = 10) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "kvflow", "namespace": "ns", "resourceVersion": "1"},
            "spec": {"holderIdentity": holder, "renewTime": renew, "leaseTransitions": transitions,
                     "leaseDurationSeconds": duration}}


MAY_TAKE = {
    # id: (lease, seen (record, at) or None, now, expected)
    "no-lease-yet": (None, None, 0.0, True),
    "released": (lease(None), None, 0.0, True),
    "mine": (lease("me"), None, 0.0, True),
    "held-first-sight": (lease("other"), None, 100.0, False),
    "held-and-renewed-since": (lease("other", "t1"), (("other", "t0", 0), 0.0), 100.0, False),
    "held-unchanged-briefly": (lease("other"), (("other", "t0", 0), 95.0), 100.0, False),
    "held-unchanged-a-lease-long": (lease("other"), (("other", "t0", 0), 90.0), 100.0, True),
    "holder-duration-wins": (lease("other", duration=30), (("other", "t0", 0), 80.0), 100.0, False),
}


@pytest.mark.parametrize("case", sorted(MAY_TAKE))
def test_may_take(case: str) -> None:
    current, seen, now, expected = MAY_TAKE[case]
    observation = Observation(seen[0], seen[1]) if seen else None
    assert may_take(current, "me", observation, now, default_duration=10.0) is expected


def test_the_candidate_times_the_record_by_its_own_clock() -> None:
    """A renewTime from a skewed clock means nothing; only an unchanged record for the lease's
    duration, seen by this replica, does."""
    held = lease("other", renew="2099-01-01T00:00:00.000000Z")
    assert may_take(held, "me", Observation(record_of(held), 0.0), 10.0, 10.0)


class FakeClient:
    """The Lease API of our KubeClient: get, create, replace with resourceVersion checks."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.fail = False

    async def get(self, *_: Any) -> dict[str, Any] | None:
        if self.fail:
            raise ApiError(503, "unreachable")
        return None if self.lease is None else {**self.lease, "spec": dict(self.lease["spec"])}

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.lease is not None:
            raise ApiError(409, "exists")
        return self._store(obj)

    async def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.lease is not None
        if obj["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "conflict")
        return self._store(obj)

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        return self.lease


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


def elector(client: FakeClient, clock: Clock, identity: str) -> LeaderElector:
    return LeaderElector(client, ElectionConfig(namespace="ns", identity=identity, name="kvflow"),  # type: ignore[arg-type]
                         clock=clock, sleep=clock.sleep)


async def test_second_candidate_waits_a_lease_duration_after_the_leader_stops_renewing() -> None:
    client, clock = FakeClient(), Clock()
    a, b = elector(client, clock, "a"), elector(client, clock, "b")
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()  # b starts watching the record now
    clock.now += 9.0
    assert not await b.try_acquire_or_renew()
    clock.now += 1.0  # unchanged for the full 10 s: a is gone
    assert await b.try_acquire_or_renew()
    assert client.lease is not None and client.lease["spec"]["holderIdentity"] == "b"
    assert client.lease["spec"]["leaseTransitions"] == 1


async def test_a_leader_that_cannot_renew_steps_down_before_the_lease_runs_out() -> None:
    client, clock = FakeClient(), Clock()
    a = elector(client, clock, "a")
    await a.acquire()
    client.fail = True
    with pytest.raises(LeadershipLost, match="could not renew"):
        await a.hold()
    assert 7.0 < clock.now <= 10.0  # renew deadline 7 s, checked every 2 s: before anyone may take over


async def test_a_leader_whose_lease_was_taken_steps_down() -> None:
    client, clock = FakeClient(), Clock()
    a = elector(client, clock, "a")
    await a.acquire()
    assert client.lease is not None
    client.lease["spec"]["holderIdentity"] = "b"
    with pytest.raises(LeadershipLost, match="b holds the lease"):
        await a.hold()


async def test_release_hands_the_lease_back() -> None:
    client, clock = FakeClient(), Clock()
    a, b = elector(client, clock, "a"), elector(client, clock, "b")
    await a.acquire()
    await a.release()
    assert client.lease is not None and client.lease["spec"]["holderIdentity"] is None
    assert await b.try_acquire_or_renew()  # at once, no lease duration to wait out
