"""Passive health: pods whose requests fail where the others' do not are ejected for a while.

A pod can look healthy to every scrape (its ``/metrics`` answers, its queue is short) and still
fail what it is sent: completions that hang, a 5xx, a 404 because it serves another model. The
router learns that only from the requests themselves, as Envoy's outlier detection does:

* a pod's attempt that fails (timeout, 5xx, wrong model, connection reset: whatever the gateway
  or ext_proc reports as ``Flight.failed``) counts one more consecutive failure; one that
  answers resets the count;
* at ``consecutive_failures`` the pod is **ejected**: the healthy filter drops it for
  ``base_seconds`` times the number of times it has been ejected (capped at ``max_seconds``), so
  a pod that keeps failing stays out longer each time;
* when its time is up it is readmitted and tried again (a failure then ejects it at once, for
  longer); ``forgive_seconds`` of no failure forget the pod's past ejections;
* never more than ``max_ejected_fraction`` of the pool at once (at least one pod may go, as in
  Envoy, but never the last one), so a pool-wide failure is not turned into "no endpoint".

``Outliers`` is pure (every call takes ``now``); the router owns one and applies its verdicts
to the datastore's views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvflow.endpoints import EndpointId


@dataclass(frozen=True, slots=True)
class EjectionPolicy:
    consecutive_failures: int = 3
    base_seconds: float = 10.0
    max_seconds: float = 300.0
    max_ejected_fraction: float = 0.5
    forgive_seconds: float = 300.0
    """A pod failing nothing this long after its last ejection starts again from one."""


@dataclass(slots=True)
class PodHealth:
    """What the router has seen of one pod's requests."""

    failures: int = 0
    """Consecutive failed attempts."""
    ejections: int = 0
    """Times ejected (the next ejection lasts this many + 1 base times)."""
    until: float = 0.0
    """Ejected until then (0: not ejected)."""
    readmitted_at: float = 0.0


@dataclass(slots=True)
class Outliers:
    policy: EjectionPolicy = field(default_factory=EjectionPolicy)
    pods: dict[EndpointId, PodHealth] = field(default_factory=dict)
    next_due: float = math.inf
    """When the next ejected pod's time is up (inf: none ejected): one comparison per decision."""

    def ejected(self) -> list[EndpointId]:
        return [eid for eid, pod in self.pods.items() if pod.until]

    def failed(self, eid: EndpointId, now: float, pool_size: int) -> bool:
        """An attempt on ``eid`` failed; whether that ejects it now."""
        pod = self.pods.setdefault(eid, PodHealth())
        pod.failures += 1
        if pod.until or pod.failures < self.policy.consecutive_failures:
            return False
        allowed = min(pool_size - 1, max(1, int(pool_size * self.policy.max_ejected_fraction)))
        if len(self.ejected()) >= allowed:
            return False
        if pod.ejections and now - pod.readmitted_at > self.policy.forgive_seconds:
            pod.ejections = 0
        pod.ejections += 1
        pod.until = now + min(self.policy.max_seconds, self.policy.base_seconds * pod.ejections)
        self.next_due = min(self.next_due, pod.until)
        return True

    def succeeded(self, eid: EndpointId) -> None:
        pod = self.pods.get(eid)
        if pod is not None:
            pod.failures = 0

    def due(self, now: float) -> list[EndpointId]:
        """Ejected pods whose time is up: readmitted now (one failure ejects them again)."""
        out = []
        for eid, pod in self.pods.items():
            if pod.until and now >= pod.until:
                pod.until, pod.readmitted_at = 0.0, now
                pod.failures = self.policy.consecutive_failures - 1
                out.append(eid)
        self.next_due = min((pod.until for pod in self.pods.values() if pod.until), default=math.inf)
        return out

    def forget(self, eid: EndpointId) -> None:
        """The pod left the pool."""
        self.pods.pop(eid, None)
