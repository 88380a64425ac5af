#!/usr/bin/env python3
"""Render a splitserve Kustomize overlay without kubectl: `python deploy/render.py DIR`.

The manifests under deploy/kubernetes are plain Kustomize (`kubectl apply -k DIR` or
`kubectl kustomize DIR` is the normal way to use them). This renderer implements exactly
the subset of Kustomize they use, so the suite can render and validate them on machines
without kubectl (tests/unit/deploy compares its output with `kubectl kustomize` where kubectl
is installed):

- `resources`: YAML files (multi-document) and directories holding a kustomization.yaml,
  rendered recursively; a directory or file outside the kustomization's own tree is refused
  (Kustomize's load restrictor does the same);
- `namespace`: set on every namespaced object;
- `images`: `name` -> `newName` / `newTag` / `digest` on containers and initContainers of
  every pod template (Deployment, StatefulSet, LeaderWorkerSet leader/worker templates);
- `replicas`: `name` -> `count` on the object of that name that has `spec.replicas`;
- `patches`: RFC 6902 JSON patches (`patch:` inline or `path:`), each with a `target`
  (`kind`, `name`); ops add, replace, remove, test.

Anything else in a kustomization.yaml is an error, not silently ignored.
Stdlib + PyYAML only.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import yaml

Obj = dict[str, Any]

KNOWN_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "replicas", "patches"}
# Kinds without a namespace (the only cluster-scoped kinds these manifests could contain).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}


class RenderError(ValueError):
    """The kustomization uses something this renderer does not implement, or is broken."""


def load_yaml_docs(path: str) -> list[Obj]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise RenderError(f"{path}: every document must be a Kubernetes object")
    return docs


def _inside(root: str, path: str) -> bool:
    root, path = os.path.realpath(root), os.path.realpath(path)
    return path == root or path.startswith(root + os.sep)


def render(directory: str) -> list[Obj]:
    """Objects of the kustomization in `directory`, in resource order."""
    kfile = os.path.join(directory, "kustomization.yaml")
    if not os.path.isfile(kfile):
        raise RenderError(f"{directory}: no kustomization.yaml")
    with open(kfile) as f:
        k = yaml.safe_load(f) or {}
    unknown = set(k) - KNOWN_KEYS
    if unknown:
        raise RenderError(f"{kfile}: unsupported fields {sorted(unknown)}")
    objs: list[Obj] = []
    for res in k.get("resources", []):
        path = os.path.normpath(os.path.join(directory, res))
        if os.path.isdir(path):
            objs.extend(render(path))
        elif os.path.isfile(path):
            if not _inside(directory, path):
                raise RenderError(f"{kfile}: file {res} is outside the kustomization's tree")
            objs.extend(load_yaml_docs(path))
        else:
            raise RenderError(f"{kfile}: resource {res} does not exist")
    for patch in k.get("patches", []):
        _apply_patch_entry(objs, patch, directory)
    for image in k.get("images", []):
        _set_image(objs, image)
    for rep in k.get("replicas", []):
        _set_replicas(objs, rep)
    if "namespace" in k:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = k["namespace"]
    _check_unique(objs, kfile)
    return objs


def _check_unique(objs: list[Obj], where: str) -> None:
    seen: set[tuple[str, str, str]] = set()
    for o in objs:
        key = (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
        if key in seen:
            raise RenderError(f"{where}: {key} defined twice")
        seen.add(key)


# -- patches ---------------------------------------------------------------------------------
def _apply_patch_entry(objs: list[Obj], entry: Obj, directory: str) -> None:
    target = entry.get("target") or {}
    if set(target) - {"kind", "name"} or not target:
        raise RenderError(f"patch target must name kind and/or name, got {target}")
    if "path" in entry:
        with open(os.path.join(directory, entry["path"])) as f:
            ops = yaml.safe_load(f)
    else:
        ops = yaml.safe_load(entry["patch"])
    if not isinstance(ops, list):
        raise RenderError("only RFC 6902 (JSON patch) lists are supported")
    matched = [o for o in objs if all(_field(o, f) == v for f, v in target.items())]
    if not matched:
        raise RenderError(f"patch target {target} matches nothing")
    for o in matched:
        for op in ops:
            json_patch(o, op)


def _field(o: Obj, name: str) -> Any:
    return o["kind"] if name == "kind" else o["metadata"].get("name")


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _child(node: Any, key: str) -> Any:
    if isinstance(node, list):
        return node[int(key)]
    if key not in node:
        raise RenderError(f"path element {key!r} not found")
    return node[key]


def json_patch(doc: Obj, op: Obj) -> None:
    """Apply one RFC 6902 operation to `doc` in place."""
    parts = _pointer(op["path"])
    parent: Any = doc
    for key in parts[:-1]:
        parent = _child(parent, key)
    last, kind = parts[-1], op["op"]
    if kind == "test":
        if _child(parent, last) != op["value"]:
            raise RenderError(f"test failed at {op['path']}")
    elif kind == "remove":
        _child(parent, last)
        del parent[int(last) if isinstance(parent, list) else last]
    elif kind in ("add", "replace"):
        value = copy.deepcopy(op["value"])
        if isinstance(parent, list):
            if kind == "add":
                parent.insert(len(parent) if last == "-" else int(last), value)
            else:
                parent[int(last)] = value
        else:
            if kind == "replace":
                _child(parent, last)
            parent[last] = value
    else:
        raise RenderError(f"unsupported JSON patch op {kind!r}")


# -- images and replicas ---------------------------------------------------------------------
def pod_templates(o: Obj) -> list[Obj]:
    """The pod templates inside a workload object (empty for other kinds)."""
    spec = o.get("spec", {})
    if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return [spec["template"]]
    if o["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [t for t in (lwt.get("leaderTemplate"), lwt.get("workerTemplate")) if t]
    return []


def _set_image(objs: list[Obj], image: Obj) -> None:
    name = image["name"]
    for o in objs:
        for tmpl in pod_templates(o):
            pod = tmpl["spec"]
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                ref = c["image"]
                base, tag = _split_image(ref)
                if base != name:
                    continue
                base = image.get("newName", base)
                if "digest" in image:
                    c["image"] = f"{base}@{image['digest']}"
                else:
                    new_tag = image.get("newTag", tag)
                    c["image"] = f"{base}:{new_tag}" if new_tag else base


def _split_image(ref: str) -> tuple[str, str]:
    if "@" in ref:
        return ref.split("@", 1)[0], ""
    head, sep, tag = ref.rpartition(":")
    if sep and "/" not in tag:
        return head, tag
    return ref, ""


def _set_replicas(objs: list[Obj], rep: Obj) -> None:
    hits = [o for o in objs if o["metadata"]["name"] == rep["name"] and "replicas" in
            o.get("spec", {})]
    if not hits:
        raise RenderError(f"replicas: no object {rep['name']!r} with spec.replicas")
    for o in hits:
        o["spec"]["replicas"] = int(rep["count"])


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    try:
        objs = render(argv[0])
    except (RenderError, OSError, yaml.YAMLError) as e:
        print(f"render: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objs, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
