"""Offline validation of Kubernetes objects: core kinds against the schemas the
`kubernetes-validate` package ships (strict: unknown fields are errors, as with
`kubectl apply --validate=strict`), custom resources against the openAPIV3Schema of their
published CRDs vendored in crd_schemas/ (see the header of each file for its source)."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils
from packaging.version import Version
from referencing import Registry, Resource

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
DEPLOY = os.path.join(ROOT, "deploy")
KUBE = os.path.join(DEPLOY, "kubernetes")
OVERLAYS = ("cpu", "cuda", "cuda-lws", "cuda-tp", "external-redis")
# Oldest version we claim (native gRPC probes are GA since 1.27) and the newest known.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
DEFS_ID = "https://kubernetes.io/api/_definitions.json"


def render(overlay_dir: str) -> list[dict[str, Any]]:
    """deploy/render.py's output for a kustomization directory."""
    return _renderer().render(overlay_dir)


@functools.cache
def _renderer() -> Any:
    sys.path.insert(0, DEPLOY)
    try:
        import render as module  # deploy/render.py (deploy/ is not a package)
    finally:
        sys.path.remove(DEPLOY)
    return module


def _schema_dir(version: str) -> str:
    known = [v for v in kv_utils.all_versions()
             if Version(kv_utils.major_minor(v)) <= Version(version)]
    return f"kubernetes-json-schema/v{known[-1]}-local-strict"


@functools.cache
def _definitions(version: str) -> dict[str, Any]:
    return kv_utils.schema_contents(f"{_schema_dir(version)}/_definitions.json", version)


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> strict JSON schema of the vendored CRDs."""
    out = {}
    for name in sorted(os.listdir(os.path.join(HERE, "crd_schemas"))):
        with open(os.path.join(HERE, "crd_schemas", name)) as f:
            crd = yaml.safe_load(f)
        schema = json.loads(json.dumps(crd["openAPIV3Schema"]))  # unshare YAML anchors
        _strict(schema)
        schema["properties"]["metadata"] = {
            "$ref": f"{DEFS_ID}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
        schema["properties"]["apiVersion"]["enum"] = [f"{crd['group']}/{crd['version']}"]
        schema["properties"]["kind"]["enum"] = [crd["kind"]]
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind"})
        out[(f"{crd['group']}/{crd['version']}", crd["kind"])] = schema
    return out


def _strict(node: Any) -> None:
    """Unknown fields are errors (the API server prunes or, with strict field validation,
    rejects them); an int-or-string is either."""
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for v in node.values():
            _strict(v)
    elif isinstance(node, list):
        for v in node:
            _strict(v)


def validate(obj: dict[str, Any], version: str) -> None:
    """Raise jsonschema.ValidationError (or SchemaNotFoundError) if `obj` is invalid."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    schema = crd_schemas().get(key)  # type: ignore[arg-type]
    if schema is None:
        kubernetes_validate.validate(obj, version, strict=True)
        return
    registry = Registry().with_resource(DEFS_ID, Resource.from_contents(_definitions(version)))
    jsonschema.Draft202012Validator(schema, registry=registry).validate(obj)
    if key == ("inference.networking.k8s.io/v1", "InferencePool"):
        _inference_pool_rules(obj["spec"])


def _inference_pool_rules(spec: dict[str, Any]) -> None:
    """The CRD's two CEL rules (x-kubernetes-validations), which JSON schema cannot say."""
    ref = spec.get("endpointPickerRef")
    if ref is not None and ref.get("kind", "Service") == "Service" and "port" not in ref:
        raise jsonschema.ValidationError("endpointPickerRef: port is required when kind is "
                                         "'Service' or unspecified (defaults to 'Service')")
    numbers = [p["number"] for p in spec["targetPorts"]]
    if len(numbers) != len(set(numbers)):
        raise jsonschema.ValidationError("targetPorts: port number must be unique")


def load_docs(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in container args (unknown names stay as written)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), arg)
