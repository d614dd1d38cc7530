"""Validate objects as an API server would: built-in kinds with kubernetes-validate (strict),
CRD-backed kinds against their structural schema — unknown fields, list-map keys, defaults and
CEL ``x-kubernetes-validations`` rules included (CEL evaluated with cel-python)."""

from __future__ import annotations

import copy
import functools
import pathlib
import re
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import yaml
from operator_tools import CHART
from referencing import Registry, Resource

HERE = pathlib.Path(__file__).resolve().parent
K8S_VERSIONS = ("1.35.0", kubernetes_validate.latest_version())  # the target and the newest shipped


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    crd = yaml.safe_load((CHART / "crds" / "llmservices.kvflow.io.yaml").read_text())
    for version in crd["spec"]["versions"]:
        out[(f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])] = \
            version["schema"]["openAPIV3Schema"]
    for path in sorted((HERE / "schemas").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        out[(doc["apiVersion"], doc["kind"])] = doc["openAPIV3Schema"]
    return out


CRD_SCHEMAS = _crd_schemas()


def to_jsonschema(node: Any) -> Any:
    """OpenAPI v3 (structural) -> JSON Schema draft 4, closing objects like strict validation."""
    if isinstance(node, list):
        return [to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_jsonschema(v) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k not in ("nullable", "default", "format")}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting, as the API server does before validation."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def _cel_and_list_maps(schema: dict[str, Any], value: Any, path: str, errors: list[str]) -> None:
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        try:
            ok = program.evaluate({"self": celpy.json_to_cel(value)})
        except celpy.CELEvalError as exc:  # a missing field: the rule is not satisfiable
            ok = False
            rule = {**rule, "message": rule.get("message", rule["rule"]) + f" ({exc})"}
        if not bool(ok):
            errors.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, list) and schema.get("x-kubernetes-list-type") == "map":
        keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"]) for item in value]
        if len(keys) != len(set(keys)):
            errors.append(f"{path}: duplicate entries for list-map keys {schema['x-kubernetes-list-map-keys']}")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                _cel_and_list_maps(sub, value[name], f"{path}.{name}" if path else name, errors)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                _cel_and_list_maps(extra, item, f"{path}.{name}", errors)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _cel_and_list_maps(schema["items"], item, f"{path}[{i}]", errors)


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """Errors an API server would report for a CRD-backed object (empty if it is accepted)."""
    schema = CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])]
    value = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft4Validator(to_jsonschema(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in validator.iter_errors(value)]
    if not errors:  # CEL runs on schema-valid objects only, as in the API server
        _cel_and_list_maps(schema, value, "", errors)
    return errors


def validate(obj: dict[str, Any]) -> None:
    """Raise AssertionError with every problem of ``obj``; built-ins for every K8S_VERSIONS."""
    if (obj["apiVersion"], obj["kind"]) in CRD_SCHEMAS:
        errors = crd_errors(obj)
        assert not errors, f"{obj['kind']} {obj['metadata']['name']}: {errors}"
        for name, template in embedded_pod_templates(obj):  # upstream embeds core's PodTemplateSpec
            validate({"apiVersion": "v1", "kind": "PodTemplate",
                      "metadata": {"name": f"{obj['metadata']['name']}-{name}"}, "template": template})
        return
    for version in K8S_VERSIONS:
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in _builtin_validator(version, obj["apiVersion"], obj["kind"]).iter_errors(obj)]
        assert not errors, f"{obj['kind']} {obj['metadata']['name']} (k8s {version}, strict): {errors}"


def embedded_pod_templates(obj: dict[str, Any]) -> list[tuple[str, Any]]:
    """The core PodTemplateSpecs a CRD-backed object carries (a LeaderWorkerSet's two)."""
    if obj["kind"] != "LeaderWorkerSet":
        return []
    lwt = obj["spec"]["leaderWorkerTemplate"]
    return [(name, lwt[field]) for name, field in (("leader", "leaderTemplate"), ("worker", "workerTemplate"))
            if field in lwt]


@functools.cache
def _builtin_validator(version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict schema for one kind, built once (its validate() re-reads
    the definitions file on every call, which costs seconds per object). Same files, same
    Draft 2020-12 validation; a kind it lacks raises FileNotFoundError."""
    exact = [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) <= kv_utils.major_minor(version)][-1]
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{exact}-local-strict"
    schema = kv_utils.schema_contents(f"{folder}/{kind.lower()}-{group_version}.json", version)
    definitions = _definitions(folder, version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


@functools.cache
def _definitions(folder: str, version: str) -> Any:
    return kv_utils.schema_contents(f"{folder}/_definitions.json", version)
