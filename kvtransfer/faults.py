"""Seeded fault injection for tests and chaos runs: on the kvtransfer wire (the tcp
sender's WRITE frames, one per chunk) and on worker RPCs (worker/faults.py), off by default.

A worker started with `SPLITSERVE_FAULTS` (or `--faults`) set injects faults. The spec
is comma-separated `name=value` items:

    seed=7                 the RNG seed (every decision is drawn from it, in order)
    wire.<kind>=P          each WRITE frame suffers <kind> with probability P (kinds
                           are drawn in the order given, at most one per frame):
        drop               frame and payload never sent (the transfer cannot complete)
        delay              sent `delay` seconds late
        duplicate          sent twice
        reorder            a multi-block region sent as one row per block, last first
        corrupt            one payload byte flipped after the checksum was taken
        truncate           half the payload sent, then the connection closed
    rpc.<kind>=P           each worker call (Generate/Prefill/FetchKV) suffers <kind>:
        drop               refused UNAVAILABLE before it runs (the message was lost)
        delay              every response (each streamed one) `delay` seconds late
        duplicate          unary calls run a second time, `delay` s after answering
                           (a retransmission arriving late: its writes must be fenced)
    delay=S                seconds of a delay (default 0.05)
    kill.write=N           SIGKILL this process as it sends its N-th WRITE frame
    kill.token=N           SIGKILL this process as a Generate stream is about to send
                           output token N (a stream resumed past N is spared)

With nothing set the layers are not installed at all: zero cost when off.
Injected faults are counted in `splitserve:{wire,rpc}_faults_injected_total{kind}`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from kvtransfer.layout import Region

log = logging.getLogger(__name__)

WIRE_KINDS = ("drop", "delay", "duplicate", "reorder", "corrupt", "truncate")
RPC_KINDS = ("drop", "delay", "duplicate")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    seed: int = 0
    wire: tuple[tuple[str, float], ...] = ()  # (kind, probability), in WIRE_KINDS
    rpc: tuple[tuple[str, float], ...] = ()
    delay_s: float = 0.05
    kill_write: int | None = None
    kill_token: int | None = None

    def __post_init__(self) -> None:
        for layer, kinds, items in (("wire", WIRE_KINDS, self.wire),
                                    ("rpc", RPC_KINDS, self.rpc)):
            for kind, p in items:
                if kind not in kinds:
                    raise ValueError(f"unknown {layer} fault {kind!r} (one of {kinds})")
                if not 0 <= p <= 1:
                    raise ValueError(f"{layer}.{kind}: probability must be in [0, 1]")
        if self.delay_s < 0:
            raise ValueError("delay must be >= 0")
        if any(n is not None and n < 1 for n in (self.kill_write, self.kill_token)):
            raise ValueError("kill steps count from 1")

    @classmethod
    def parse(cls, text: str) -> FaultSpec | None:
        """The spec in the module doc; None for an empty string (no faults)."""
        kw: dict[str, Any] = {"wire": [], "rpc": []}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"fault item {item!r} is not name=value")
            layer, _, kind = name.partition(".")
            try:
                if layer in ("wire", "rpc"):
                    kw[layer].append((kind, float(value)))
                elif name in ("seed", "kill.write", "kill.token"):
                    kw[name.replace(".", "_")] = int(value)
                elif name == "delay":
                    kw["delay_s"] = float(value)
                else:
                    raise ValueError(f"unknown fault setting {name!r}")
            except ValueError as e:
                raise ValueError(f"fault item {item!r}: {e}") from None
        if kw == {"wire": [], "rpc": []}:
            return None
        kw["wire"], kw["rpc"] = tuple(kw["wire"]), tuple(kw["rpc"])
        return cls(**kw)


class Faults:
    """The decisions of one layer ("wire" or "rpc") of one process: a seeded RNG, the
    counter of what was injected, the kill step."""

    def __init__(self, spec: FaultSpec, layer: str,
                 registry: CollectorRegistry | None = None) -> None:
        self.spec = spec
        self.layer = layer
        self.rng = random.Random(f"{spec.seed}-{layer}")
        self._kinds = dict(spec.wire if layer == "wire" else spec.rpc)
        self.writes = 0
        self.injected = Counter(f"splitserve:{layer}_faults_injected",
                                f"Faults injected on the {layer} (testing)", ["kind"],
                                registry=registry if registry is not None
                                else CollectorRegistry())

    def hit(self, kind: str) -> bool:
        """One draw: does this message suffer `kind`? (counted when it does)"""
        p = self._kinds.get(kind, 0.0)
        if p and self.rng.random() < p:
            self.injected.labels(kind).inc()
            return True
        return False

    def draw(self, kinds: Sequence[str]) -> str | None:
        """The first of `kinds` this message suffers, if any."""
        return next((k for k in kinds if self.hit(k)), None)

    def kill(self, why: str) -> None:
        self.injected.labels("kill").inc()
        log.warning("event=fault_kill reason=%r: SIGKILL self", why)
        os.kill(os.getpid(), signal.SIGKILL)

    # -- the wire (the tcp sender calls these) ------------------------------------------
    def reorder(self, pairs: Sequence[tuple[Region, Region]]) -> list[tuple[Region, Region]]:
        """The (src, dst) regions of one write in sending order: a multi-block region
        drawn for `reorder` goes as one region per block, last block first (rows out of
        order in the frame: the receiver lands each where it names)."""
        out = []
        for src, dst in pairs:
            if src.num_blocks > 1 and self.hit("reorder"):
                out += [(replace(src, block_id=src.block_id + i, num_blocks=1),
                         replace(dst, block_id=dst.block_id + i, num_blocks=1))
                        for i in reversed(range(src.num_blocks))]
            else:
                out.append((src, dst))
        return out

    async def send_write(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                         head: bytes, data: Any) -> bool:
        """Sends one WRITE frame (header, then payload) with the drawn fault; False
        when the fault is that it never goes out (dropped)."""
        from kvtransfer import wire

        self.writes += 1
        if self.spec.kill_write is not None and self.writes >= self.spec.kill_write:
            self.kill(f"WRITE frame {self.writes}")
        kind = self.draw([k for k in self._kinds if k != "reorder"])  # in spec order
        if kind == "drop":
            return False
        if kind == "delay":
            await asyncio.sleep(self.spec.delay_s)
        payload = memoryview(data).cast("B")
        if kind == "corrupt" and len(payload):
            flipped = bytearray(payload)
            flipped[self.rng.randrange(len(flipped))] ^= 0xFF
            payload = memoryview(flipped)
        if kind == "truncate":
            await wire.send_all(loop, sock, head)
            await wire.send_all(loop, sock, payload[:len(payload) // 2])
            sock.shutdown(socket.SHUT_RDWR)  # the stream cannot be resynchronised
            return True
        for _ in range(2 if kind == "duplicate" else 1):
            await wire.send_all(loop, sock, head)
            await wire.send_all(loop, sock, payload)
        return True


def on_wire(spec: FaultSpec | None) -> bool:
    """True when `spec` injects something on the wire."""
    return spec is not None and (bool(spec.wire) or spec.kill_write is not None)
