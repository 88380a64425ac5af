"""`splitserve bench chaos`: sustained load on a local cluster (2 prefill, 2 decode, 2
gateways and Redis by default; `splitserve up`'s flags) while a seeded chaos loop, about
every `--kill-every` seconds, SIGKILLs a random prefill, decode, gateway or redis-server
(the launcher's supervision restarts it) or freezes one with SIGSTOP for `--stop-for`
seconds, then SIGCONT. Roles come in shuffled rounds (each role once per four faults),
one fault at a time: the next waits until the last victim is back.

Then the invariants, read from the outside:
- no request hung (each ended within `--request-timeout`);
- no wrong output: every complete answer equals the fault-free reference for the same
  request, token for token (greedy and seeded); a stream cut short counts as wrong, a
  broken one the client can tell (an HTTP or SSE error, a dropped connection) as a
  clean error;
- no KV block leaked on any worker once idle, and every process back and running.

Recovery time per fault kind: from the fault (a kill) or its end (the SIGCONT of a
freeze) until the victim is back (a killed one as a new process; a worker routable on
every gateway, a gateway healthy, Redis answering PING) and a request has succeeded
after that; and the service's: until the first success of a request sent after it.

The JSON (`--json`) has the issue's keys (`requests`, `succeeded`, `clean_errors`,
`wrong`, `hung`, `leaked_blocks`, `kills`, `recovery_s`), the fault list and a
per-second timeline, in the results format docs/benchmarks.md is generated from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.chaos_load import ChaosClient, Outcome, templates
from cluster.gateways import is_gateway, routable_addresses
from cluster.launcher import Child, LocalCluster

ROLES = ("prefill", "decode", "gateway", "redis")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cluster.up import add_arguments as up_arguments

    up_arguments(p)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load under faults")
    p.add_argument("--kill-every", type=float, default=15.0,
                   help="seconds between faults, on average (each 0.5x-1.5x of it)")
    p.add_argument("--stop-for", type=float, default=3.0,
                   help="seconds a frozen (SIGSTOP) process stays frozen")
    p.add_argument("--stop-share", type=float, default=0.4,
                   help="share of faults that freeze instead of kill")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="a request's deadline at the client; past it, it counts as hung")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")


@dataclass(slots=True)
class Fault:
    kind: str  # "prefill" | "decode" | "gateway" | "redis" (killed) | "stop" (frozen)
    victim: str  # child name
    pid: int  # the process the fault hit (a killed one is back as another)
    at: float  # monotonic: the kill or the SIGSTOP
    ended: float  # the kill, or the SIGCONT
    back: float | None = None  # the victim ready again
    recovery_s: float | None = None
    served_s: float | None = None  # to the first success of a request sent after it


def _role(name: str) -> str:
    return "gateway" if is_gateway(name) else name.split("-")[0]


def _redis_ping(url: str) -> bool:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False


def _healthy(cluster: LocalCluster, port: str) -> bool:
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(f"http://{cluster.spec.host}:{port}/health",
                                    timeout=1.0) as r:
            return r.status == 200
    return False


def is_back(cluster: LocalCluster, child: Child, killed_pid: int | None = None) -> bool:
    """`child` running and doing its job again (see the module's docstring); after a
    kill (`killed_pid`), as a new process."""
    from cluster.health import is_ready

    if child.proc.poll() is not None or child.proc.pid == killed_pid:
        return False
    if child.name == "redis":
        return _redis_ping(cluster.redis_url)
    if is_gateway(child.name):
        return _healthy(cluster, child.extra["http_port"])
    if not is_ready(child.grpc_address or ""):
        return False
    for gw in cluster.children:
        if is_gateway(gw.name) and gw.proc.poll() is None:
            seen = routable_addresses(cluster.spec.host, int(gw.extra["http_port"]),
                                      cluster.admin_key)
            if seen is None or child.grpc_address not in seen:
                return False
    return True


class Chaos:
    """The fault loop; `step()` runs on the thread that supervises the cluster (the
    launcher's children die with the thread that started them)."""

    def __init__(self, cluster: LocalCluster, every_s: float, stop_s: float,
                 stop_share: float, seed: int) -> None:
        self.cluster, self.every_s, self.stop_s, self.stop_share = (cluster, every_s, stop_s,
                                                                    stop_share)
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []
        self.frozen: tuple[Child, float] | None = None  # (child, SIGCONT due)
        self.pending: tuple[Fault, Child] | None = None  # a victim not back yet
        self.next_at = time.monotonic() + self._gap()
        self._deck: list[str] = []

    def _next_role(self) -> str:
        """Roles in a shuffled order, each once per round of len(ROLES) faults: a short
        run still hits every role."""
        if not self._deck:
            self._deck = self.rng.sample(ROLES, len(ROLES))
        return self._deck.pop()

    def _gap(self) -> float:
        return self.every_s * self.rng.uniform(0.5, 1.5)

    def step(self, now: float) -> None:
        if self.frozen is not None and now >= self.frozen[1]:
            self._thaw(now)
        if self.pending is not None and self.frozen is None:
            fault, child = self.pending
            if is_back(self.cluster, child, None if fault.kind == "stop" else fault.pid):
                fault.back = time.monotonic()
                self.pending = None
        if self.pending is None and now >= self.next_at:
            self._inject(now)
            self.next_at = now + self._gap()

    def _thaw(self, now: float) -> None:
        assert self.frozen is not None
        child = self.frozen[0]
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.proc.pid, signal.SIGCONT)
        self.frozen = None
        if self.pending is not None:
            self.pending[0].ended = now

    def _inject(self, now: float) -> None:
        role = self._next_role()
        pool = [c for c in self.cluster.children if _role(c.name) == role
                and c.proc.poll() is None]
        if not pool:
            return
        child = self.rng.choice(pool)
        if self.rng.random() < self.stop_share:
            os.kill(child.proc.pid, signal.SIGSTOP)
            self.frozen = (child, now + self.stop_s)
            fault = Fault("stop", child.name, child.proc.pid, now, now + self.stop_s)
        else:
            os.kill(child.proc.pid, signal.SIGKILL)
            fault = Fault(role, child.name, child.proc.pid, now, now)
        action = "SIGSTOP" if fault.kind == "stop" else "SIGKILL"
        print(f"  {time.strftime('%H:%M:%S')} {action} {child.name}", flush=True)
        self.faults.append(fault)
        self.pending = (fault, child)

    def finish(self, timeout_s: float = 120.0) -> bool:
        """Thaws a frozen victim and waits for the last one to be back; True when every
        child runs and is back."""
        deadline = time.monotonic() + timeout_s
        if self.frozen is not None:
            self._thaw(time.monotonic())
        while time.monotonic() < deadline:
            self.cluster.supervise()
            self.next_at = float("inf")  # no new fault
            self.step(time.monotonic())
            if self.pending is None and all(is_back(self.cluster, c)
                                            for c in self.cluster.children):
                return True
            time.sleep(0.2)
        return False


def _recoveries(faults: list[Fault], outcomes: list[Outcome]) -> None:
    """Each fault's recovery: from its end to the first success after the victim was
    back; and the service's: to the first success of a request sent after the fault."""
    ok = sorted((o for o in outcomes if o.result == "ok"), key=lambda o: o.end)
    for f in faults:
        served = next((o.end for o in ok if o.start >= f.ended), None)
        if served is not None:
            f.served_s = served - f.ended
        if f.back is None:
            continue
        first = next((o.end for o in ok if o.end >= f.back), None)
        if first is not None:
            f.recovery_s = max(first, f.back) - f.ended


def run_chaos(cluster: LocalCluster, duration_s: float, every_s: float, stop_s: float,
              stop_share: float, concurrency: int, timeout_s: float, seed: int
              ) -> dict[str, Any]:
    """The load and the faults on a started cluster, then the checks; the result dict."""
    from bench.invariants import idle_blocks

    model = os.path.basename(os.path.normpath(cluster.spec.model_dir))
    ports = [int(c.extra["http_port"]) for c in cluster.children if is_gateway(c.name)]
    tpls = templates(model, seed)
    client = ChaosClient(ports, tpls, timeout_s)
    client.reference()
    chaos = Chaos(cluster, every_s, stop_s, stop_share, seed)
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    end = t0 + duration_s

    def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < end:  # bounded: each request ends within timeout_s
            outcomes.append(client.send(rng.choice(tpls)))

    threads = [threading.Thread(target=loop, args=(i,), daemon=True)
               for i in range(concurrency)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        cluster.supervise()
        if time.monotonic() < end:
            chaos.step(time.monotonic())
        time.sleep(0.1)
    all_back = chaos.finish()
    blocks = idle_blocks(cluster, timeout_s=30.0)
    # A victim back only after the load ended still gets its recovery measured: one more
    # request each (not counted in the figures).
    probes = [client.send(tpls[i % len(tpls)]) for i, f in enumerate(chaos.faults)
              if f.back is not None and f.back > end]
    _recoveries(chaos.faults, outcomes + probes)
    return summarize(cluster, outcomes, chaos.faults, blocks, all_back, t0, duration_s)


def summarize(cluster: LocalCluster, outcomes: list[Outcome], faults: list[Fault],
              blocks: dict[str, Any], all_back: bool, t0: float, duration_s: float
              ) -> dict[str, Any]:
    count = {r: sum(o.result == r for o in outcomes) for r in ("ok", "error", "wrong", "hung")}
    kills = {k: sum(f.kind == k for f in faults) for k in (*ROLES, "stop")}
    recovery, served = {}, {}
    for k in kills:
        values = [f.recovery_s for f in faults if f.kind == k and f.recovery_s is not None]
        if values:
            recovery[k] = round(statistics.median(values), 2)
        values = [f.served_s for f in faults if f.kind == k and f.served_s is not None]
        if values:
            served[k] = round(statistics.median(values), 2)
    timeline = []
    for sec in range(int(duration_s) + 1):
        mine = [o for o in outcomes if sec <= o.end - t0 < sec + 1]
        timeline.append({"t": sec, "ok": sum(o.result == "ok" for o in mine),
                         "errors": sum(o.result != "ok" for o in mine)})
    leaked = sum(b.leaked for b in blocks.values() if b.total >= 0)
    unreachable = [n for n, b in blocks.items() if b.total < 0]
    return {
        "requests": len(outcomes), "succeeded": count["ok"], "clean_errors": count["error"],
        "wrong": count["wrong"], "hung": count["hung"], "leaked_blocks": leaked,
        "success_rate": round(count["ok"] / max(1, len(outcomes)), 4),
        "kills": kills, "recovery_s": recovery, "service_recovery_s": served,
        "all_back": all_back,
        "unreachable_workers": unreachable,
        "restarts": cluster.restarts,
        "faults": [{**asdict(f), "at": round(f.at - t0, 2), "ended": round(f.ended - t0, 2),
                    "back": None if f.back is None else round(f.back - t0, 2)} for f in faults],
        "problems": [asdict(o) for o in outcomes if o.result in ("wrong", "hung")][:20],
        "errors": [f"{o.kind} via gateway {o.gateway}: {o.detail}"
                   for o in outcomes if o.result == "error"][:30],
        "timeline": timeline}


def failures(result: dict[str, Any]) -> list[str]:
    out = [f"{result[k]} {k}" for k in ("wrong", "hung", "leaked_blocks") if result[k]]
    if not result["all_back"]:
        out.append("not every process came back")
    if result["unreachable_workers"]:
        out.append(f"workers not answering at the end: {result['unreachable_workers']}")
    return out


def report(result: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The results format of docs/results/*.json (bench/results_page.py renders it)."""
    from bench.report import machine

    kinds = [k for k in result["kills"] if result["kills"][k]]
    table = ["| fault | injected | median recovery s (victim back, serving) | median s to the "
             "first success of a request sent after it |", "|---|---:|---:|---:|"]
    table += [f"| {k} | {result['kills'][k]} | {result['recovery_s'].get(k, '-')} | "
              f"{result['service_recovery_s'].get(k, '-')} |" for k in kinds]
    summary = {k: result[k] for k in ("requests", "succeeded", "clean_errors", "wrong", "hung",
                                      "leaked_blocks", "success_rate")}
    summary |= {f"recovery_s_{k}": v for k, v in result["recovery_s"].items()}
    cmd = (f"splitserve bench chaos --duration {config['duration_s']:g} --kill-every "
           f"{config['kill_every_s']:g} --seed {config['seed']} --json docs/results/chaos.json")
    return {"name": "chaos", "title": "Chaos: every role killed or frozen under sustained "
            "load", "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": machine(), "config": config, "command": cmd, "summary": summary,
            "tables": [table], "notes": [
                "Faults one at a time, about every kill_every_s seconds: SIGKILL (the "
                "launcher restarts the process) or SIGSTOP for stop_for_s seconds, then "
                "SIGCONT. Recovery: from the kill or the SIGCONT until the victim is back "
                "(routable on every gateway, healthy, or answering PING) and a request has "
                "succeeded after that. A killed worker is back once the launcher has "
                "started a new process and it has loaded the model; the other workers "
                "serve meanwhile (last column).",
                "Clean errors are requests the client saw fail (a dropped connection when "
                "a gateway dies, an HTTP or SSE error); wrong and hung are none of those."],
            "plots": [], **result}


FAULT_COLORS = {"prefill": "tab:blue", "decode": "tab:green", "gateway": "tab:purple",
                "redis": "tab:red", "stop": "tab:gray"}


def timeline_plot(result: dict[str, Any], path: str) -> str:
    """Requests finished per second (succeeded, failed) with the faults marked."""
    from bench.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    t = [p["t"] for p in result["timeline"]]
    ax.plot(t, [p["ok"] for p in result["timeline"]], color="black", lw=1, label="succeeded/s")
    ax.bar(t, [p["errors"] for p in result["timeline"]], color="tab:orange", width=1.0,
           label="failed/s")
    for f in result["faults"]:
        ax.axvline(f["at"], color=FAULT_COLORS[f["kind"]], ls="--", lw=1)
        ax.text(f["at"], ax.get_ylim()[1] * 0.95, f["victim"] if f["kind"] != "stop"
                else f"{f['victim']} (stop)", rotation=90, va="top", fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests per second")
    ax.set_title("bench chaos: load with faults (dashed: kill or freeze)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from cluster.launcher import ClusterError
    from cluster.up import build_spec

    for key, default in (("prefill", 2), ("decode", 2), ("gateways", 2)):
        if getattr(args, key) is None:
            setattr(args, key, default)
    spec = build_spec(args)  # a bad setting: one line (cluster/cli.py)
    spec = replace(spec, http_port=args.http_port or 0, grpc_port=args.grpc_port or 0)
    if args.duration <= 0 or args.kill_every <= 0 or args.stop_for <= 0:
        raise ValueError("--duration, --kill-every and --stop-for must be > 0")
    cluster = LocalCluster(spec)
    print(f"starting {spec.num_prefill} prefill, {spec.num_decode} decode, "
          f"{spec.num_colocated} colocated, {spec.num_gateways} gateway(s) and redis "
          f"(logs: {cluster.log_dir})", flush=True)
    config = {"duration_s": args.duration, "kill_every_s": args.kill_every,
              "stop_for_s": args.stop_for, "stop_share": args.stop_share,
              "concurrency": args.concurrency, "request_timeout_s": args.request_timeout,
              "seed": args.seed, "prefill": spec.num_prefill, "decode": spec.num_decode,
              "gateways": spec.num_gateways, "transport": spec.transport}
    try:
        cluster.start()
        print(f"load for {args.duration:g} s, a fault about every {args.kill_every:g} s",
              flush=True)
        result = run_chaos(cluster, args.duration, args.kill_every, args.stop_for,
                           args.stop_share, args.concurrency, args.request_timeout, args.seed)
    except (ClusterError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    print(json.dumps({k: result[k] for k in (
        "requests", "succeeded", "clean_errors", "wrong", "hung", "leaked_blocks",
        "success_rate", "kills", "recovery_s", "service_recovery_s", "all_back")}, indent=1))
    broken = failures(result)
    print("invariants: " + ("all hold" if not broken else "BROKEN: " + "; ".join(broken)))
    if args.json:
        page = report(result, config)
        plot = os.path.join(os.path.dirname(os.path.abspath(args.json)), "chaos-timeline.png")
        page["plots"] = [os.path.basename(timeline_plot(result, plot))]
        with open(args.json, "w") as f:
            json.dump(page, f, indent=1)
            f.write("\n")
    return 1 if broken else 0
