"""Check API calls recorded by the emulator against the chart's ClusterRole.

Two directions: every call must be allowed (the operator works with the chart's RBAC), and
every granted verb must be used or be listed in ``GRANTED_FOR_DELEGATION`` (least privilege).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from typing import Any

import yaml
from operator_emulator import AuditEntry
from operator_tools import CHART, tool

# Verbs the operator never calls but must hold to create each router's Role with them
# (Kubernetes' RBAC escalation check), and verbs used only on paths the e2e run does not take.
GRANTED_FOR_DELEGATION = {
    ("", "pods", "get"), ("", "pods", "watch"),
    ("inference.networking.k8s.io", "inferencepools", "get"),
    ("inference.networking.k8s.io", "inferencepools", "watch"),
}
GRANTED_FOR_OTHER_PATHS = {
    # HTTPRoute children (gateway.mode httpRoute), HPAs and KEDA ScaledObjects (autoscaling).
    *(("gateway.networking.k8s.io", "httproutes", v) for v in ("create", "patch", "delete")),
    *(("autoscaling", "horizontalpodautoscalers", v) for v in ("create", "patch", "delete")),
    *(("keda.sh", "scaledobjects", v) for v in ("list", "create", "patch", "delete")),
    # Deleting children that a spec change removes: exercised for the gateway's kinds only.
    *((g, r, "delete") for g, r in (("", "serviceaccounts"),
                                    ("rbac.authorization.k8s.io", "roles"),
                                    ("rbac.authorization.k8s.io", "rolebindings"),
                                    ("inference.networking.k8s.io", "inferencepools"))),
}


def cluster_role_rules() -> list[dict[str, Any]]:
    """The ClusterRole rules from ``helm template`` (or the raw template if helm is missing)."""
    helm = tool("helm")
    if helm is not None:
        out = subprocess.run([str(helm), "template", "kv", str(CHART), "--namespace", "kvflow-system"],
                             check=True, capture_output=True, text=True).stdout
        docs = [d for d in yaml.safe_load_all(out) if d]
    else:
        # Without helm: the template with default values, by hand (the outer rbac.create guard
        # goes, optional inner blocks go, other template lines go).
        lines = (CHART / "templates" / "clusterrole.yaml").read_text().splitlines()[1:-1]
        text = re.sub(r"\{\{-? if .*?\{\{-? end \}\}", "", "\n".join(lines), flags=re.DOTALL)
        docs = [yaml.safe_load("\n".join(line for line in text.splitlines() if "{{" not in line))]
    roles = [d for d in docs if d.get("kind") == "ClusterRole"]
    assert len(roles) == 1, "the chart must render exactly one ClusterRole"
    rules: list[dict[str, Any]] = roles[0]["rules"]
    return rules


def granted(rules: Iterable[dict[str, Any]]) -> set[tuple[str, str, str]]:
    out = set()
    for rule in rules:
        assert "*" not in rule.get("verbs", []) and "*" not in rule.get("resources", []), "no wildcards"
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    out.add((group, resource, verb))
    return out


def needed(calls: Iterable[AuditEntry]) -> set[tuple[str, str, str]]:
    return {(c.group, c.resource + (f"/{c.subresource}" if c.subresource else ""), c.verb) for c in calls}


def audit_against_chart(calls: Iterable[AuditEntry]) -> None:
    allowed = granted(cluster_role_rules())
    used = needed(calls)
    denied = sorted(used - allowed)
    assert not denied, f"calls the chart's ClusterRole does not allow: {denied}"
    unused = sorted(allowed - used - GRANTED_FOR_DELEGATION - GRANTED_FOR_OTHER_PATHS)
    assert not unused, f"ClusterRole grants verbs the operator never used: {unused}"
