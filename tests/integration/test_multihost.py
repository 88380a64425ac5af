"""splitserve across "hosts" on one machine: Linux network namespaces joined by veth links
to a bridge (in a namespace of its own, so the host's network is never touched).

    [redis] [gateway + client] [prefill] [decode]     one netns each, eth0 = veth,
        \\          |              |        /           an address on one /24;
         +------------ br0 (switch netns) ---+         the KV goes prefill -> decode
                                                        over these links

Every worker also runs in its own PID namespace (`unshare --pid`), as on separate machines,
so UCX cannot take its same-host shortcut (cross-memory attach) and has to use the network.
The test checks that greedy outputs equal the offline engine's (`engine.llm.LLM`), that
every request was prefilled remotely (the decode uses --kv-failure-policy fail, so a failed
transfer is an error, not a silent local recompute), and that the decode's veth received at
least the KV bytes its receiver counted. Root only; skipped with the reason where network
namespaces cannot be made. Every namespace and process is removed at the end (and stale
ones from a crashed earlier run are removed at the start).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import child_env, tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFIX = "ssmh"
ROLES = ("sw", "redis", "gw", "prefill", "decode")
WORKER_ARGS = ("--num-blocks", "96", "--max-num-seqs", "8", "--max-model-len", "512",
               "--max-num-batched-tokens", "128", "--log-level", "INFO")
HTTP, GRPC = 8000, 50051  # the gateway's
# Workers of each transport get their own ports: the gateway must not mistake the ucx pair
# for the tcp pair it saw a moment ago at the same address.
PORTS = {"tcp": (50061, 9101, 7001), "ucx": (50071, 9102, 7002)}  # grpc, metrics, kv
TOKEN = "multihost-test-token-" + "ab" * 16


def sh(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "unshare", "redis-server"):
        if shutil.which(tool) is None:
            return f"`{tool}` not installed (make sysdeps installs iproute2 and redis-server)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    try:
        r = sh("ip", "netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"cannot create a network namespace here: {r.stderr.strip()}"
        r = sh("ip", "netns", "exec", probe, "unshare", "--pid", "--fork", "true", check=False)
        if r.returncode != 0:
            return f"cannot run in a namespace here: {r.stderr.strip()}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None


def _remove_stale() -> None:
    """Namespaces a killed earlier run left behind (their creator pid is gone)."""
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"({PREFIX}-(\d+)-\w+)", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            sh("ip", "netns", "del", m.group(1), check=False)


class NetLab:
    """Owns the namespaces, links and processes of one test run; close() removes all."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.tag = f"{PREFIX}-{os.getpid()}"
        self.net = f"10.{random.randint(64, 127)}.{random.randint(0, 255)}"
        self.ns = {r: f"{self.tag}-{r}" for r in ROLES}
        self.ip = {r: f"{self.net}.{10 + i}" for i, r in enumerate(ROLES)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.model = ""

    def build(self) -> None:
        for ns in self.ns.values():
            sh("ip", "netns", "add", ns)
        sw = self.ns["sw"]
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for role in ROLES[1:]:
            ns, port = self.ns[role], f"p-{role}"
            sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
               "netns", ns)
            sh("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip[role]}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def start(self, name: str, role: str, argv: list[str]) -> subprocess.Popen:
        """`argv` in `role`'s network namespace and a PID namespace of its own. Without the
        PID namespace UCX sees a same-host peer and moves the KV by cross-memory attach:
        the decode's veth then receives ~9 KB for ~340 KB of KV and the rx check fails."""
        env = child_env(TOKENIZERS_PARALLELISM="false")
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[role], "unshare", "--pid",
                              "--fork", *argv], stdout=log, stderr=subprocess.STDOUT,
                             env=env, cwd=ROOT, start_new_session=True)
        log.close()
        self.procs[name] = p
        return p

    def stop(self, name: str, timeout: float = 15.0) -> int | None:
        p = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
            return None

    def log(self, name: str) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.tmp, f"{name}.log")) as f:
            return f.read()[-3000:]
        return ""

    def client(self, cmd: str, arg: dict, timeout: float = 90) -> Any:
        r = sh("ip", "netns", "exec", self.ns["gw"], sys.executable, "-m",
               "tests.integration.multihost_client", cmd, json.dumps(arg), check=False,
               timeout=timeout)
        if r.returncode != 0:
            logs = "\n".join(f"--- {n}\n{self.log(n[:-4])}" for n in
                             sorted(os.listdir(self.tmp)) if n.endswith(".log"))
            raise AssertionError(f"client {cmd} failed: {r.stderr[-2000:]}\n{logs}")
        return json.loads(r.stdout)

    def rx_bytes(self, role: str) -> int:
        out = sh("ip", "-j", "-s", "-n", self.ns[role], "link", "show", "dev", "eth0").stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name, timeout=10)
        for ns in self.ns.values():
            sh("ip", "netns", "del", ns, check=False)
        left = [ns for ns in self.ns.values()
                if ns in sh("ip", "netns", "list", check=False).stdout]
        assert not left, f"namespaces left behind: {left}"


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if (head == name or head.startswith(name + "{")) and all(
                f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    _remove_stale()
    model = tiny_model_dir("llama")
    tmp = str(tmp_path_factory.mktemp("multihost"))
    lab = NetLab(tmp)
    try:
        lab.build()
        with open(os.path.join(tmp, "routing.yaml"), "w") as f:
            # threshold 0: every prompt is prefilled remotely (the path under test).
            f.write("routing:\n  scorers: [{name: queue, weight: 1.0}]\n  picker: max_score\n"
                    "  decider: {name: threshold, threshold: 0}\n")
        with open(os.path.join(tmp, "token"), "w") as f:
            f.write(TOKEN)
        lab.start("redis", "redis", [shutil.which("redis-server") or "redis-server",
                                     "--bind", lab.ip["redis"], "--port", "6379", "--save", "",
                                     "--appendonly", "no", "--protected-mode", "no"])
        cli = [sys.executable, "-m", "cluster.cli"]
        lab.start("gateway", "gw", [*cli, "gateway", "--model", model, "--host", "0.0.0.0",
                                    "--http-port", str(HTTP), "--grpc-port", str(GRPC),
                                    "--redis", f"redis://{lab.ip['redis']}:6379",
                                    "--routing", os.path.join(tmp, "routing.yaml"),
                                    # signs its worker calls with the workers' token
                                    "--cluster-token-file", os.path.join(tmp, "token")])
        lab.model = model
        yield lab
    finally:
        lab.close()


def start_workers(lab: NetLab, transport: str) -> None:
    grpc_port, metrics_port, kv_port = PORTS[transport]
    cli = [sys.executable, "-m", "cluster.cli", "worker", "--model", lab.model,
           "--port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--redis", f"redis://{lab.ip['redis']}:6379", "--transport", transport,
           "--cluster-token-file", os.path.join(lab.tmp, "token"), *WORKER_ARGS]
    for role in ("prefill", "decode"):
        extra = ["--transfer-host", lab.ip["decode"], "--transfer-port", str(kv_port),
                 "--kv-failure-policy", "fail"] if role == "decode" else []
        lab.start(f"{role}-{transport}-0", role,
                  [*cli, "--role", role, "--host", lab.ip[role], "--worker-id",
                   f"{role}-{transport}-0", *extra])


def prompts() -> tuple[list[list[int]], list[int]]:
    lengths = (150, 210, 96, 180)
    ps = [[(11 * i + 7 * j) % 400 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    return ps, [12, 7, 16, 9]


@pytest.fixture(scope="module")
def reference(lab) -> list[list[int]]:
    ps, max_tokens = prompts()
    llm = LLM(lab.model, num_blocks=96, max_num_seqs=8, max_model_len=512,
              max_num_batched_tokens=128)
    return [o.token_ids for o in llm.generate(ps, [SamplingParams(max_tokens=m, temperature=0)
                                                   for m in max_tokens])]


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_kv_crosses_the_veth_link_and_greedy_output_matches_one_host(
        lab: NetLab, reference, transport: str) -> None:
    if transport == "ucx":
        pytest.importorskip("ucxx", reason="ucxx (UCX Python bindings) not installed")
    start_workers(lab, transport)
    try:
        lab.client("wait", {"http": f"127.0.0.1:{HTTP}", "roles": ["prefill", "decode"],
                            "timeout": 90})
        dec_metrics = f"http://{lab.ip['decode']}:{PORTS[transport][1]}/metrics"
        before = lab.client("metrics", {"url": dec_metrics})
        rx0 = lab.rx_bytes("decode")
        ps, max_tokens = prompts()
        out = lab.client("generate", {"grpc": f"127.0.0.1:{GRPC}", "prompts": ps,
                                      "max_tokens": max_tokens})
        rx = lab.rx_bytes("decode") - rx0
        after = lab.client("metrics", {"url": dec_metrics})
    finally:
        codes = [lab.stop(f"{r}-{transport}-0") for r in ("decode", "prefill")]
    assert out == reference
    ok = (metric(after, "splitserve:remote_prefill_total", outcome="ok")
          - metric(before, "splitserve:remote_prefill_total", outcome="ok"))
    assert ok == len(ps), "every request must be prefilled on the prefill host"
    kv = (metric(after, "splitserve:kv_transfer_bytes_total", transport=transport)
          - metric(before, "splitserve:kv_transfer_bytes_total", transport=transport))
    # 2 layers x K,V x 2 kv heads x head_dim 16 x 4 bytes per prompt token, at least.
    assert kv >= 512 * sum(len(p) for p in ps) * 0.9
    assert rx >= kv, f"decode's veth received {rx} B but {kv} B of KV arrived: not via the link"
    assert codes == [0, 0], "workers must drain and exit cleanly on SIGTERM"
