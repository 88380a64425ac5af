"""deploy/kubernetes: every overlay renders, every object is valid for Kubernetes (core
schemas + vendored CRD schemas), and what the objects say agrees with our CLI and with each
other (probes, ports, grace periods, labels, selectors, autoscaling targets)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.cli import build_parser
from tests.unit.deploy.k8s_schema import (
    DEPLOY,
    K8S_VERSIONS,
    KUBE,
    OVERLAYS,
    expand,
    load_docs,
    render,
    validate,
)

KV_LEASE_DEFAULT_S = 30.0  # worker/cli.py --kv-lease default (vLLM's 30 s)


def overlay(name: str) -> list[dict[str, Any]]:
    return render(os.path.join(KUBE, "overlays", name))


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod_templates(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) for every workload in the render."""
    out = []
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            out.append((o, o["spec"]["template"]))
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            out += [(o, t) for t in (lwt.get("leaderTemplate"), lwt["workerTemplate"]) if t]
    return out


def container_env(objs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """The environment Kubernetes would give `c` (downward API fields as sample values)."""
    env: dict[str, str] = {}
    cms = by_kind(objs, "ConfigMap")
    for src in c.get("envFrom", []):
        env.update(cms[src["configMapRef"]["name"]]["data"])
    samples = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0"}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = samples[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def splitserve_args(objs: list[dict[str, Any]], c: dict[str, Any]) -> Any:
    """The container's command line parsed by our real CLI parser (SystemExit if invalid)."""
    argv = [expand(a, container_env(objs, c)) for a in c["args"]]
    assert not any("$(" in a for a in argv), f"unresolved variable in {argv}"
    return build_parser(argv).parse_args(argv)


def our_containers(objs: list[dict[str, Any]]):
    for w, t in pod_templates(objs):
        for c in t["spec"]["containers"]:
            if c["image"].split(":")[0] == "splitserve":
                yield w, t, c


# -- schema validity ---------------------------------------------------------------------------
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", OVERLAYS)
def test_every_rendered_object_is_valid(name: str, version: str) -> None:
    objs = overlay(name)
    assert len(objs) >= 14
    for o in objs:
        validate(o, version)


def test_examples_are_valid() -> None:
    for name in sorted(os.listdir(os.path.join(KUBE, "examples"))):
        for o in load_docs(os.path.join(KUBE, "examples", name)):
            validate(o, K8S_VERSIONS[0])


def _broken(objs: list[dict[str, Any]], kind: str, mutate) -> dict[str, Any]:
    o = copy.deepcopy(next(x for x in objs if x["kind"] == kind))
    mutate(o)
    return o


@pytest.mark.parametrize("case", ["core-typo", "probe-service-type", "lws-pod-typo",
                                  "scaledobject-no-triggers", "pool-duplicate-port",
                                  "pool-unreleased-picker", "pool-picker-without-port",
                                  "crd-unknown"])
def test_validation_rejects_broken_objects(case: str) -> None:
    """The validators can fail: one broken field per kind is caught."""
    objs = overlay("cuda-lws")
    breakers = {
        "core-typo": ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0]
                      .__setitem__("imagePullPolicyy", "Always")),
        "probe-service-type": ("Deployment", lambda o: o["spec"]["template"]["spec"]
                               ["containers"][0]["readinessProbe"]["grpc"]
                               .__setitem__("port", "grpc")),
        "lws-pod-typo": ("LeaderWorkerSet", lambda o: o["spec"]["leaderWorkerTemplate"]
                         ["workerTemplate"]["spec"].__setitem__("containerz", [])),
        "scaledobject-no-triggers": ("ScaledObject", lambda o: o["spec"].pop("triggers")),
        "pool-duplicate-port": ("InferencePool", lambda o: o["spec"]["targetPorts"]
                                .append({"number": 8000})),
        # the spelling of an unreleased GIE commit, which no release's CRD accepts
        "pool-unreleased-picker": ("InferencePool", lambda o: o["spec"].__setitem__(
            "extensionRef", {"name": "epp", "portNumber": 9002})),
        "pool-picker-without-port": ("InferencePool", lambda o: o["spec"]
                                     ["endpointPickerRef"].pop("port")),
        "crd-unknown": ("ScaledObject", lambda o: o["spec"].__setitem__("maxReplicas", 3)),
    }
    kind, mutate = breakers[case]
    with pytest.raises(jsonschema.ValidationError):
        validate(_broken(objs, kind, mutate), K8S_VERSIONS[0])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: the "
                    "Python renderer is checked against real Kustomize only where it exists")
@pytest.mark.parametrize("name", OVERLAYS)
def test_renderer_matches_kubectl_kustomize(name: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", os.path.join(KUBE, "overlays", name)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out) if o}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in overlay(name)}
    assert ours == theirs


# -- consistency with the CLI and between objects -----------------------------------------------
@pytest.mark.parametrize("name", OVERLAYS)
def test_commands_parse_with_our_cli_and_match_ports_probes_and_mounts(name: str) -> None:
    objs = overlay(name)
    roles = set()
    for _w, t, c in our_containers(objs):
        args = splitserve_args(objs, c)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        grpc_port = args.grpc_port if args.command == "gateway" else args.port
        assert ports["grpc"] == grpc_port
        for probe, service in (("startupProbe", None), ("readinessProbe", "readiness"),
                               ("livenessProbe", "liveness")):
            grpc = c[probe]["grpc"]
            assert grpc["port"] == grpc_port
            assert grpc["service"] in (("readiness", "liveness") if service is None
                                       else (service,))
        assert os.path.dirname(args.model) in {os.path.dirname(m) for m in mounts} or \
            args.model in mounts
        if args.command == "gateway":
            assert ports["http"] == args.http_port
            assert os.path.dirname(args.routing) in mounts
            continue
        roles.add(args.role)
        assert args.host == "0.0.0.0" and args.advertise_host == "10.1.2.3"
        assert ports["metrics"] == args.metrics_port
        assert os.path.dirname(args.cluster_token_file) in mounts
        if args.role == "decode":
            assert ports["kv-transfer"] == args.transfer_port
            assert args.transfer_host == "10.1.2.3"  # the pod IP, which the prefill dials
        grace = t["spec"]["terminationGracePeriodSeconds"]
        assert grace > args.drain_timeout + args.kv_lease >= 30 + KV_LEASE_DEFAULT_S
        assert args.transport in ("tcp", "ucx")  # shm cannot cross pods
    assert roles == {"prefill", "decode"}


@pytest.mark.parametrize("name", OVERLAYS)
def test_labels_selectors_and_secrets_line_up(name: str) -> None:
    objs = overlay(name)
    pods = [(w, t["metadata"]["labels"]) for w, t in pod_templates(objs)]
    for kind in ("Service", "PodDisruptionBudget"):
        for o in by_kind(objs, kind).values():
            sel = o["spec"]["selector"]
            sel = sel.get("matchLabels", sel)
            assert any(sel.items() <= lbl.items() for _, lbl in pods), o["metadata"]["name"]
    for np in by_kind(objs, "NetworkPolicy").values():
        sels = [np["spec"]["podSelector"]] + [f["podSelector"] for r in np["spec"]["ingress"]
                                              for f in r.get("from", [])]
        for sel in sels:
            assert any(sel["matchLabels"].items() <= lbl.items() for _, lbl in pods)
    for w, t in pod_templates(objs):
        sel = w["spec"].get("selector", {}).get("matchLabels", {})
        assert sel.items() <= t["metadata"]["labels"].items()
    for _w, t, c in our_containers(objs):
        args = splitserve_args(objs, c)
        labels = t["metadata"]["labels"]
        if args.command == "worker":
            assert labels["llm-d.ai/role"] == args.role
            assert labels["llm-d.ai/inferenceServing"] == "true"
            assert labels["llm-d.ai/model"] == args.served_model_name
        assert t["spec"]["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    example = load_docs(os.path.join(KUBE, "examples", "secret.example.yaml"))[0]
    for _w, t, _c in our_containers(objs):
        for v in t["spec"]["volumes"]:
            if "secret" in v:
                assert v["secret"]["secretName"] == example["metadata"]["name"]
                assert {i["key"] for i in v["secret"]["items"]} <= example["stringData"].keys()


@pytest.mark.parametrize("name", ["cuda", "cuda-lws", "external-redis"])
def test_prefill_and_decode_autoscale_separately_on_their_own_metrics(name: str) -> None:
    objs = overlay(name)
    scalers = by_kind(objs, "ScaledObject") or by_kind(objs, "HorizontalPodAutoscaler")
    targets = {}
    for s in scalers.values():
        ref = s["spec"]["scaleTargetRef"]
        target = by_kind(objs, ref["kind"])[ref["name"]]
        assert target["apiVersion"] == ref["apiVersion"]
        spec = s["spec"]
        lo = spec.get("minReplicaCount", spec.get("minReplicas"))
        hi = spec.get("maxReplicaCount", spec.get("maxReplicas"))
        assert 1 <= lo <= hi  # also the CRD's CEL rule for ScaledObject
        targets[target["metadata"]["labels"]["llm-d.ai/role"]] = s
    assert set(targets) == {"prefill", "decode"}
    for role, s in targets.items():
        text = yaml.safe_dump(s["spec"].get("triggers") or s["spec"]["metrics"])
        assert "num_requests_waiting" in text
        assert ("kv_cache_usage_perc" in text) == (role == "decode")
        for t in s["spec"].get("triggers", []):
            assert f'pod=~"splitserve-{role}-.*"' in t["metadata"]["query"]
    metrics_src = open(os.path.join(os.path.dirname(DEPLOY), "worker", "metrics.py")).read()
    for metric in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f'"{metric}"' in metrics_src  # the workers export what we scale on


def test_inference_pool_selects_the_gateway_http_port() -> None:
    objs = overlay("cuda")
    pool = by_kind(objs, "InferencePool")["splitserve"]
    gw = by_kind(objs, "Deployment")["splitserve-gateway"]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= gw["metadata"]["labels"].items()
    ports = {p["containerPort"] for p in gw["spec"]["containers"][0]["ports"]}
    assert pool["spec"]["targetPorts"][0]["number"] in ports


def test_overlays_differ_where_they_should() -> None:
    cpu, cuda, ext = overlay("cpu"), overlay("cuda"), overlay("external-redis")
    assert "splitserve-redis" in by_kind(cpu, "StatefulSet")
    assert not by_kind(ext, "StatefulSet")
    assert by_kind(ext, "ConfigMap")["splitserve-engine"]["data"]["SPLITSERVE_REDIS_URL"] \
        != by_kind(cpu, "ConfigMap")["splitserve-engine"]["data"]["SPLITSERVE_REDIS_URL"]
    for _w, _t, c in our_containers(cuda):
        assert c["image"].endswith("-cuda")
        if splitserve_args(cuda, c).command == "worker":
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert splitserve_args(cuda, c).device == "cuda"
    for _w, _t, c in our_containers(cpu):
        assert c["image"].endswith("-cpu")
    assert {o["metadata"]["namespace"] for o in cpu} == {"splitserve"}


@pytest.mark.parametrize("name", OVERLAYS)
def test_gpus_per_worker_pod_equal_its_tensor_parallel_size(name: str) -> None:
    """A TP N worker's ranks run on its pod's GPUs: nvidia.com/gpu (request = limit) is the
    --tensor-parallel-size its command line gives (one flag, no stale duplicate)."""
    objs = overlay(name)
    sizes = {}
    for _w, _t, c in our_containers(objs):
        args = splitserve_args(objs, c)
        if args.command != "worker":
            continue
        assert sum(a.startswith(("--tensor-parallel-size", "-tp")) for a in c["args"]) <= 1
        res = c.get("resources", {})
        gpus = res.get("limits", {}).get("nvidia.com/gpu")
        assert res.get("requests", {}).get("nvidia.com/gpu") == gpus
        if gpus is None:  # CPU pods: the ranks are gloo processes on the pod's cores
            assert args.device == "cpu"
            continue
        assert args.device == "cuda" and int(gpus) == args.tensor_parallel_size
        sizes[args.role] = args.tensor_parallel_size
    expected = {"cuda": {"prefill": 1, "decode": 1}, "cuda-lws": {"prefill": 1, "decode": 1},
                "cuda-tp": {"prefill": 2, "decode": 4}}
    assert sizes == expected.get(name, {})


def test_routing_configmap_is_the_example_profile(tmp_path) -> None:
    from gateway.routing.profile import RoutingProfile

    cm = by_kind(overlay("cpu"), "ConfigMap")["splitserve-routing"]["data"]["routing.yaml"]
    with open(os.path.join(DEPLOY, "routing.example.yaml")) as f:
        assert yaml.safe_load(cm) == yaml.safe_load(f), (
            "deploy/kubernetes/base/config.yaml (ConfigMap splitserve-routing) must carry the "
            "profile of deploy/routing.example.yaml: copy it over")
    path = tmp_path / "routing.yaml"
    path.write_text(cm)
    assert RoutingProfile.from_yaml(str(path)) == RoutingProfile.from_yaml(
        os.path.join(DEPLOY, "routing.example.yaml"))


def test_pod_monitor_scrapes_every_splitserve_pod_on_a_port_it_has() -> None:
    objs = overlay("cuda")
    (mon,) = by_kind(objs, "PodMonitor").values()
    selector = mon["spec"]["selector"]
    ports = {e["port"] for e in mon["spec"]["podMetricsEndpoints"]}
    scraped = 0
    for _w, t in pod_templates(objs):
        labels = t["metadata"]["labels"]
        if not selector["matchLabels"].items() <= labels.items() or not all(
                labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]):
            continue
        names = {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
        assert ports & names, t["metadata"]["labels"]  # some endpoint finds this pod
        scraped += 1
    assert scraped >= 3  # gateway, prefill, decode
    with pytest.raises(jsonschema.ValidationError):
        validate(_broken(objs, "PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0]
                         .__setitem__("targetPort", 9100)), K8S_VERSIONS[0])
