"""Pure diagnosis of why a service's pods do not run: what the status's ``Degraded`` condition says.

A pod that cannot pull its image, keeps crashing or cannot be scheduled would otherwise only show
as a pool that never gets ready. ``problems(pods, deployments)`` turns the pods' container
waiting reasons, their ``PodScheduled`` condition and the Deployments' ``Progressing`` condition
into one ``Problem`` per component and reason; ``summary`` words them for the status.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Container waiting reasons that mean the pod will not come up by itself (the kubelet's words).
WAITING_REASONS = {
    "ErrImagePull": "cannot pull the image",
    "ImagePullBackOff": "cannot pull the image",
    "InvalidImageName": "cannot use the image name",
    "ErrImageNeverPull": "cannot find the image locally (imagePullPolicy Never)",
    "CrashLoopBackOff": "cannot stay up",
    "CreateContainerConfigError": "cannot use the container config",
    "CreateContainerError": "cannot create the container",
    "RunContainerError": "cannot start the container",
}
COMPONENT_LABEL = "app.kubernetes.io/component"
POOLS = ("aggregated", "prefill", "decode")


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    component: str  # prefill, decode, router, gateway
    reason: str  # ImagePullBackOff, Unschedulable, ProgressDeadlineExceeded, ...
    pods: tuple[str, ...]
    detail: str  # the first pod's message from Kubernetes, or the Deployment's

    def describe(self) -> str:
        what = f"{self.component} pool" if self.component in POOLS else self.component
        if not self.pods:
            return f"{what}: {self.reason}: {self.detail}"
        count = f"pod {self.pods[0]}" if len(self.pods) == 1 else f"{len(self.pods)} pods ({self.pods[0]}, ...)"
        verb = WAITING_REASONS.get(self.reason, {"Unschedulable": "cannot be scheduled",
                                                 "InsufficientAccelerators": "cannot be scheduled"}.get(self.reason, ""))
        return f"{what}: {count} {verb} ({self.reason}): {self.detail}".replace("  ", " ")


def _lacks_accelerators(message: str) -> bool:
    """The scheduler's "0/4 nodes are available: 4 Insufficient nvidia.com/gpu." names a device."""
    lacking = re.findall(r"Insufficient ([\w./-]+)", message)
    return any(name not in ("cpu", "memory", "ephemeral-storage", "pods") for name in lacking)


def _pod_issue(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in WAITING_REASONS:
            image = container.get("image", "")
            detail = waiting.get("message") or (f"image {image}" if image else reason)
            return reason, detail
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                and condition.get("reason") == "Unschedulable":
            message = condition.get("message") or "no node fits"
            return ("InsufficientAccelerators" if _lacks_accelerators(message) else "Unschedulable"), message
    return None


def problems(pods: Iterable[Mapping[str, Any]], deployments: Iterable[Mapping[str, Any]]) -> list[Problem]:
    """One problem per (component, reason), pods named in a stable order."""
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        issue = _pod_issue(pod)
        if issue is not None:
            component = (meta.get("labels") or {}).get(COMPONENT_LABEL, "?")
            found.setdefault((component, issue[0]), []).append((meta.get("name", "?"), issue[1]))
    out = [Problem(component, reason, tuple(sorted(name for name, _ in items)), sorted(items)[0][1])
           for (component, reason), items in found.items()]
    for deployment in deployments:
        for condition in (deployment.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded":
                component = ((deployment.get("metadata") or {}).get("labels") or {}).get(COMPONENT_LABEL, "?")
                out.append(Problem(component, "ProgressDeadlineExceeded", (),
                                   condition.get("message") or "the rollout made no progress"))
    order = {name: i for i, name in enumerate((*POOLS, "router", "gateway"))}
    return sorted(out, key=lambda p: (order.get(p.component, 9), p.component, p.reason))


def summary(found: Sequence[Problem]) -> tuple[str, str] | None:
    """(reason, message) for the Degraded condition; the first problem's reason leads."""
    if not found:
        return None
    return found[0].reason, "; ".join(p.describe() for p in found)
