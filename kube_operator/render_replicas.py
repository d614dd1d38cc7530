"""Pure renderers for running the control path's Deployments (router, gateway) as several
replicas: the rolling update, where the replicas go, and the disruption budget.

Every replica of a router or gateway routes on its own (active-active; docs/operator.md,
"Replicas: what each one knows"), telling the others what it routed (``render_peers.py``), so
the aim here is plain availability: never fewer ready replicas
than asked for during an update, replicas on different nodes where the cluster has them, and
at least one left during a voluntary disruption (a node drain) without ever blocking one.

The placement is in the pod template at every replica count, one included: a template that
changed with ``replicas`` would roll every running replica on a mere scale change. (The peers
change it once, from one replica to two: a single replica has no one to tell.)
"""

from __future__ import annotations

from kvflow.operator import names
from kvflow.operator.objects import Obj, new
from kvflow.operator.spec import LLMService

HOSTNAME = "kubernetes.io/hostname"


def rolling_update() -> Obj:
    """A new pod is ready before an old one goes. Routers and gateways take no accelerator, so
    the surge pod always has somewhere to run, and a single replica is never down for an update."""
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def spread_over_nodes(svc: LLMService, component: names.Component) -> Obj:
    """Pod-spec fields that put ``component``'s replicas on different nodes when they can.

    Both are preferences, never requirements, so a one-node cluster (or one with room on one
    node only) still schedules every replica. The anti-affinity keeps a replica off a node that
    has one; the spread evens them out once there are more replicas than nodes. The spread counts
    one ReplicaSet's pods (``pod-template-hash``), so a rolling update spreads the new ones.
    """
    selector = {"matchLabels": names.selector_labels(svc, component)}
    return {
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"labelSelector": selector, "topologyKey": HOSTNAME}}]}},
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": HOSTNAME, "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": names.selector_labels(svc, component)},
            "matchLabelKeys": ["pod-template-hash"]}],
    }


def replica_budget(svc: LLMService, component: names.Component, replicas: int) -> list[Obj]:
    """The PodDisruptionBudget of a Deployment of ``replicas``: none for one replica, else one.

    ``maxUnavailable: 1`` rather than ``minAvailable: replicas - 1``: the same number at the
    rendered count, but it follows the Deployment's actual scale (the disruption controller reads
    it), so it stays right while someone has scaled the Deployment by hand. A single replica gets
    no budget: ``minAvailable: 1`` would refuse every eviction and block a node drain forever, and
    ``maxUnavailable: 1`` of one protects nothing. ``AlwaysAllow`` lets a drain evict a replica
    that is not ready (crash-looping, or stuck starting) even while the budget is exhausted, so a
    broken rollout cannot hold a node either.
    """
    if replicas < 2:
        return []
    budget = new(svc, "policy/v1", "PodDisruptionBudget", names.child_name(svc, component), component)
    budget["spec"] = {"maxUnavailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                      "selector": {"matchLabels": names.selector_labels(svc, component)}}
    return [budget]
