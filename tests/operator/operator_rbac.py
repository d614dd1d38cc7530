"""Check API calls recorded by the emulator against the chart's ClusterRole.

Two directions: every call must be allowed (the operator works with the chart's RBAC), and
every granted verb must be used or be listed in ``GRANTED_FOR_DELEGATION`` (least privilege).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from typing import Any

import yaml
from operator_emulator import AuditEntry
from operator_tools import CHART, tool

# Verbs the operator never calls but must hold to create each picker's Role with them
# (Kubernetes' RBAC escalation check), and verbs used only on paths the e2e run does not take.
GRANTED_FOR_DELEGATION = {
    ("", "pods", "get"), ("", "pods", "watch"),
    ("inference.networking.k8s.io", "inferencepools", "get"),
    ("inference.networking.k8s.io", "inferencepools", "watch"),
    # GIE's EPP (routing.picker gie).
    *(("inference.networking.x-k8s.io", "inferenceobjectives", v) for v in ("get", "list", "watch")),
}
GRANTED_FOR_OTHER_PATHS = {
    # HTTPRoute children (gateway.mode httpRoute), HPAs and KEDA ScaledObjects (autoscaling).
    *(("gateway.networking.k8s.io", "httproutes", v) for v in ("create", "patch", "delete")),
    *(("autoscaling", "horizontalpodautoscalers", v) for v in ("create", "patch", "delete")),
    *(("keda.sh", "scaledobjects", v) for v in ("list", "create", "patch", "delete")),
    # Multi-node pools (LeaderWorkerSets) and the model cache claim (model.cacheSize).
    *(("leaderworkerset.x-k8s.io", "leaderworkersets", v) for v in ("list", "create", "patch", "delete")),
    *(("", "persistentvolumeclaims", v) for v in ("create", "patch", "delete")),
    ("networking.k8s.io", "networkpolicies", "delete"),
    # Held for the OwnerReferencesPermissionEnforcement admission plugin (blockOwnerDeletion).
    ("kvflow.io", "llmservices/finalizers", "update"),
    # Leader election: a replica creates the Lease only when none exists yet (the e2e test's
    # first replica does; the lifecycle test runs kopf in-process, without the election).
    ("coordination.k8s.io", "leases", "create"), ("coordination.k8s.io", "leases", "get"),
    ("coordination.k8s.io", "leases", "update"),
    # Deleting children that a spec change removes: exercised for the gateway's kinds only.
    *((g, r, "delete") for g, r in (("", "serviceaccounts"),
                                    ("rbac.authorization.k8s.io", "roles"),
                                    ("rbac.authorization.k8s.io", "rolebindings"),
                                    ("inference.networking.k8s.io", "inferencepools"))),
}


RELEASE_NAMESPACE = "kvflow-system"
Grant = tuple[str, str, str, str | None]  # group, resource, verb, resource name (None: any)


def chart_documents(*values: str) -> list[dict[str, Any]]:
    """The chart's RBAC objects from ``helm template`` (or the raw templates if helm is missing)."""
    helm = tool("helm")
    if helm is not None:
        out = subprocess.run([str(helm), "template", "kvflow", str(CHART), "--namespace", RELEASE_NAMESPACE,
                              *values], check=True, capture_output=True, text=True).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    # Without helm: the default values by hand. The operator's rules are a plain YAML file the
    # ClusterRole includes; the leader-election Role's template loses its guard and template lines.
    docs: list[dict[str, Any]] = [{"kind": "ClusterRole", "rules": yaml.safe_load(
        (CHART / "files" / "operator-rules.yaml").read_text())}]
    lines = (CHART / "templates" / "leader-election.yaml").read_text().splitlines()[1:-1]
    text = "\n".join(lines).replace('{{ include "kvflow.fullname" . | quote }}', '"kvflow"')
    text = text.replace('{{ include "kvflow.fullname" . }}', "kvflow").replace("{{ .Release.Namespace }}", RELEASE_NAMESPACE)
    for part in text.split("\n---\n"):
        docs.append(yaml.safe_load("\n".join(line for line in part.splitlines() if "{{" not in line)))
    return docs


def cluster_role_rules(*values: str) -> list[dict[str, Any]]:
    roles = [d for d in chart_documents(*values) if d.get("kind") == "ClusterRole"]
    assert len(roles) == 1, "the chart must render exactly one ClusterRole"
    rules: list[dict[str, Any]] = roles[0]["rules"]
    return rules


def namespaced_role_rules(*values: str) -> dict[str, list[dict[str, Any]]]:
    """The chart's Roles (leader election; the watched namespaces'), by namespace."""
    out: dict[str, list[dict[str, Any]]] = {}
    for role in (d for d in chart_documents(*values) if d.get("kind") == "Role"):
        out.setdefault(role["metadata"]["namespace"], []).extend(role["rules"])
    return out


def granted(rules: Iterable[dict[str, Any]]) -> set[Grant]:
    out: set[Grant] = set()
    for rule in rules:
        assert "*" not in rule.get("verbs", []) and "*" not in rule.get("resources", []), "no wildcards"
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    for name in rule.get("resourceNames") or [None]:
                        out.add((group, resource, verb, name))
    return out


def _resource(call: AuditEntry) -> str:
    return call.resource + (f"/{call.subresource}" if call.subresource else "")


def _allowed(call: AuditEntry, grants: set[Grant]) -> Grant | None:
    for name in (None, call.name):
        grant = (call.group, _resource(call), call.verb, name)
        if grant in grants and (name is None or call.verb != "create"):
            return grant
    return None


def audit_against_chart(calls: Iterable[AuditEntry], *, check_unused: bool = True) -> None:
    """Every call allowed by the ClusterRole or, in its namespace, by a Role; and (optionally)
    every granted verb used or listed above."""
    cluster = granted(cluster_role_rules())
    roles = {ns: granted(rules) for ns, rules in namespaced_role_rules().items()}
    used: set[Grant] = set()
    denied = []
    for call in calls:
        grant = _allowed(call, cluster) or _allowed(call, roles.get(call.namespace or "", set()))
        if grant is None:
            denied.append((call.group, _resource(call), call.verb, call.namespace, call.name))
        else:
            used.add(grant)
    assert not denied, f"calls the chart's RBAC does not allow: {sorted(set(denied))}"
    if check_unused:
        spare = {(g, r, v) for g, r, v, _ in cluster | set().union(*roles.values())
                 if not any(u[:3] == (g, r, v) for u in used)}
        unused = sorted(spare - GRANTED_FOR_DELEGATION - GRANTED_FOR_OTHER_PATHS)
        assert not unused, f"the chart grants verbs the operator never used: {unused}"
