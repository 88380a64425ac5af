"""Hardware profiles: what one simulated worker's device can do, as fitted by
`splitserve sim calibrate`: cpu.json from this machine's CPU engine, h200.json and
h100.json from `bench engine --device cuda` on an H200 and on an H100.

A profile is a checked-in JSON file, never hand-typed constants in code: the roofline's
peaks, the efficiency factors and fixed costs fitted from measured engine steps, the
serving overheads (gateway + RPC per request, streaming per token) and the links that
time KV transfers and tier restores (bandwidth plus a fixed cost per transfer).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.config import ModelConfig

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
HARDWARE = ("cpu", "h100", "h200")
COMBINE = ("sum", "max")


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One kind of link: `seconds = latency_s + bytes / bandwidth_bytes_s`."""

    bandwidth_bytes_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_s > 0 or self.latency_s < 0:
            raise ValueError("a link needs bandwidth > 0 and latency >= 0")

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_s


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One device running the engine. Step time (sim/latency.py):

        step_overhead_s + seq_overhead_s * seqs + combine(flops / (peak * compute_eff),
                                                          bytes / (bandwidth * memory_eff))

    `combine` is "max" (a GPU overlaps compute and memory: the roofline) or "sum" (the
    CPU engine does not). `links`: "kv" (prefill -> decode and peer pushes), "host" and
    "disk" (tier restores into the device)."""

    name: str
    peak_flop_s: float
    bandwidth_bytes_s: float
    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float
    seq_overhead_s: float
    combine: str
    dtype: str  # the KV and weight dtype the profile was fitted for
    model: dict[str, Any]  # config.json of the model the profile times by default
    links: dict[str, LinkSpec]
    request_overhead_s: float = 0.0  # gateway + RPC on the way to the first token
    token_overhead_s: float = 0.0  # delivery of each streamed token (added to ITL)
    num_blocks: int = 4096  # KV blocks per worker
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    model_shape: str = "llama3-8b"  # engine/model_shapes name, when `model` is empty
    source: str = ""
    fit: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.combine not in COMBINE:
            raise ValueError(f"combine must be one of {COMBINE}, got {self.combine!r}")
        if min(self.peak_flop_s, self.bandwidth_bytes_s, self.compute_efficiency,
               self.memory_efficiency) <= 0:
            raise ValueError("peaks and efficiencies must be > 0")
        if min(self.step_overhead_s, self.seq_overhead_s, self.request_overhead_s,
               self.token_overhead_s) < 0:
            raise ValueError("overheads must be >= 0")
        for k in ("kv", "host", "disk"):
            if k not in self.links:
                raise ValueError(f"profile {self.name!r} lacks link {k!r}")

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def model_config(self) -> ModelConfig:
        """The profile's model: its own config.json data, else `model_shape`."""
        data = self.model
        if not data:
            from engine.model_shapes import load_shape

            data = load_shape(self.model_shape)
        return ModelConfig.from_dict({**data, "torch_dtype": self.dtype})

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["links"] = {k: asdict(v) for k, v in self.links.items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HardwareProfile:
        d = dict(d)
        d.pop("notes", None)
        d["links"] = {k: LinkSpec(**v) for k, v in d["links"].items()}
        return cls(**d)


def at_speed(profile: HardwareProfile, speed: float,
             compute_speed: float | None = None) -> HardwareProfile:
    """`profile` on a machine `speed` times slower: every modelled step time multiplied
    by `speed` (peaks divided, per-step and per-sequence costs multiplied); links and
    serving overheads unchanged. `compute_speed`, when given, slows the FLOP term alone
    by its own factor (the peak FLOP/s divided by it): a shared machine can slow a
    step's fixed costs and memory traffic (what a small model's decode step is made of)
    more than its matmuls (a prefill's)."""
    from dataclasses import replace

    compute = speed if compute_speed is None else compute_speed
    if speed <= 0 or compute <= 0:
        raise ValueError(f"speeds must be > 0, got {speed} and {compute}")
    return replace(profile, peak_flop_s=profile.peak_flop_s / compute,
                   bandwidth_bytes_s=profile.bandwidth_bytes_s / speed,
                   step_overhead_s=profile.step_overhead_s * speed,
                   seq_overhead_s=profile.seq_overhead_s * speed)


def with_block_size(profile: HardwareProfile, block_size: int) -> HardwareProfile:
    """`profile` with `block_size`-token KV blocks in the same device memory: its pool
    holds as many tokens (num_blocks scaled, rounded down), as an engine sizing its
    cache from free memory would (engine/config.py)."""
    from dataclasses import replace

    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    tokens = profile.num_blocks * profile.block_size
    return replace(profile, block_size=block_size, num_blocks=max(1, tokens // block_size))


def profile_path(name: str) -> str:
    return os.path.join(PROFILE_DIR, f"{name}.json")


def load_profile(name_or_path: str) -> HardwareProfile:
    """`cpu`, `h100`, `h200` (the checked-in files) or the path of a profile JSON."""
    path = profile_path(name_or_path) if name_or_path in HARDWARE else name_or_path
    if not os.path.isfile(path):
        raise ValueError(f"no hardware profile {name_or_path!r} (known: {HARDWARE}, or a "
                         "path); `splitserve sim calibrate` writes the cpu one")
    with open(path) as f:
        return HardwareProfile.from_json(json.load(f))


def save_profile(profile: HardwareProfile, path: str, notes: list[str] | None = None) -> None:
    data = profile.to_json()
    if notes:
        data["notes"] = notes
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
