"""deploy/docker and deploy/docker-compose.yaml: the Dockerfiles parse with Docker's own
parser and are multi-stage, non-root, model-free and install every package; the compose
file's commands parse with our CLI and its wiring is consistent. Images are not built here
(no registry access): what they run is checked against the code instead."""

from __future__ import annotations

import os
import subprocess
import sys

import dockerfile
import pytest
import tomllib
import yaml

from cluster.cli import build_parser
from tests.unit.deploy.k8s_schema import DEPLOY, ROOT

DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
HEALTH = os.path.join(DEPLOY, "docker", "grpc_health_check.py")


def stages(name: str) -> list[list[dockerfile.Command]]:
    cmds = dockerfile.parse_file(os.path.join(DEPLOY, "docker", name))
    out: list[list[dockerfile.Command]] = []
    for c in cmds:
        if c.cmd == "FROM":
            out.append([])
        if out:
            out[-1].append(c)
    return out


def packages() -> set[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return {p.rstrip("*") for p in include}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_is_multistage_non_root_and_runs_our_cli(name: str) -> None:
    build, runtime = stages(name)
    assert build[0].value[1:] == ("AS", "build") and runtime[0].value[1:] == ("AS", "runtime")
    users = [c.value[0] for c in runtime if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entry = [c for c in runtime if c.cmd == "ENTRYPOINT"][-1]
    assert entry.json and entry.value == ("splitserve",)
    # The runtime stage gets the venv from the build stage, not the sources.
    copies = [c for c in runtime if c.cmd == "COPY"]
    assert [c.flags for c in copies] == [("--from=build",)]
    exposed = {int(p) for c in runtime if c.cmd == "EXPOSE" for p in c.value}
    assert exposed == {8000, 50051, 9100, 7000}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_every_package_and_never_the_model(name: str) -> None:
    build, runtime = stages(name)
    copied = {c.value[0] for c in build if c.cmd == "COPY"}
    for src in copied:
        assert os.path.exists(os.path.join(ROOT, src)), src
    assert packages() <= copied, "a package in pyproject.toml is missing from the image"
    assert {"pyproject.toml", "README.md"} <= set(
        next(c for c in build if c.cmd == "COPY" and "pyproject.toml" in c.value).value)
    text = " ".join(c.original for c in build + runtime).lower()
    for banned in (".safetensors", "huggingface-cli", "snapshot_download", "from_pretrained",
                   "/models"):
        assert banned not in text, f"{name} must not bake a model in ({banned})"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerignore_allows_exactly_what_the_image_copies(name: str) -> None:
    with open(os.path.join(DEPLOY, "docker", name + ".dockerignore")) as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"  # an allow-list: weights, venvs and caches never enter the context
    allowed = {ln[1:] for ln in lines if ln.startswith("!")}
    build, _ = stages(name)
    copied = {src for c in build if c.cmd == "COPY" for src in c.value[:-1]}
    assert allowed == copied
    assert "**/*.safetensors" in lines


def compose() -> dict:
    with open(os.path.join(DEPLOY, "docker-compose.yaml")) as f:
        return yaml.safe_load(f)


def test_compose_commands_parse_with_our_cli_and_wiring_is_consistent() -> None:
    c = compose()
    svcs = c["services"]
    assert set(svcs) == {"redis", "prefill", "decode", "gateway"}
    roles = {}
    for name, s in svcs.items():
        if name == "redis":
            continue
        assert s["image"].startswith("splitserve:")
        args = build_parser(s["command"]).parse_args(s["command"])
        assert args.redis == "redis://redis:6379"
        assert any(v.endswith(":/models/model:ro") for v in s["volumes"])  # mounted, ro
        assert args.model == "/models/model"
        health = s["healthcheck"]["test"]
        assert health[1] == "splitserve-health" and health[3] == "readiness"
        port = args.grpc_port if args.command == "gateway" else args.port
        assert health[2] == f"127.0.0.1:{port}"
        if args.command == "worker":
            roles[args.role] = (args, s)
            assert args.cluster_token_file == "/run/secrets/cluster_token"
            assert "cluster_token" in s["secrets"]
            assert int(s["stop_grace_period"].rstrip("s")) > args.drain_timeout + args.kv_lease
    assert set(roles) == {"prefill", "decode"}
    dec_args, dec = roles["decode"]
    # KV goes over the internal `kv` network only: the decode binds its alias there.
    assert c["networks"]["kv"]["internal"] is True
    assert dec_args.transfer_host in dec["networks"]["kv"]["aliases"]
    assert "kv" in roles["prefill"][1]["networks"]
    assert "kv" not in svcs["gateway"]["networks"] and "kv" not in svcs["redis"]["networks"]
    gw = build_parser(svcs["gateway"]["command"]).parse_args(svcs["gateway"]["command"])
    mounted = {v.split(":")[1]: v.split(":")[0] for v in svcs["gateway"]["volumes"]}
    assert os.path.isfile(os.path.join(DEPLOY, mounted[gw.routing]))


def test_health_check_script_reports_serving_and_failure(tmp_path) -> None:
    """The HEALTHCHECK command the images install, against a real grpc.health.v1 server."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("readiness", health_pb2.HealthCheckResponse.SERVING)
        servicer.set("liveness", health_pb2.HealthCheckResponse.NOT_SERVING)

        def run(*args: str) -> int:
            return subprocess.run([sys.executable, HEALTH, *args], capture_output=True,
                                  timeout=30).returncode

        assert run(f"127.0.0.1:{port}") == 0
        assert run(f"127.0.0.1:{port}", "liveness") == 1
        assert run(f"127.0.0.1:{port}", "unknown-service") == 1
        assert run("no-port") == 2
    finally:
        server.stop(None)
    assert run(f"127.0.0.1:{port}") == 1  # nobody listening: fails within its deadline
