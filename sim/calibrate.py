"""`splitserve sim calibrate`: fits a hardware profile from measurements, writes JSON.

1. Engine steps: the real engine runs `bench engine`'s step recorder
   (bench/engine_shape_bench.run_ours_workload) over workloads that span batch sizes
   and prompt lengths; the machine's limits come from the same run
   (bench/engine_roofline.measure_limits). Fitted, non-negative least squares:

       step seconds = a + b * seqs + c * FLOPs + d * bytes

   so `step_overhead_s = a`, `seq_overhead_s = b`, `compute_efficiency = 1 / (c * peak)`,
   `memory_efficiency = 1 / (d * bandwidth)`, combine "sum" (the CPU engine does not
   overlap its matmuls with its memory traffic).
   The profile is one worker on one core with one thread (bench/pin.py's convention).
2. Serving (unless --no-serving): a real `splitserve up` cluster (one colocated worker,
   pinned to core 0) answers sequential requests; the gateway + RPC time on the way to the first token
   (`request_overhead_s`) and the streaming cost per token (`token_overhead_s`) are the
   medians of measured minus modelled TTFT and TPOT.

With `--engine-json`, a GPU profile from runs recorded on the GPU instead:
sim/calibrate_gpu.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from sim.profile import PROFILE_DIR, HardwareProfile, LinkSpec, save_profile

# (requests, prompt tokens, output tokens) per workload: batches 1..32, prompts 16..1536
WORKLOADS = ((1, 64, 48), (4, 128, 48), (16, 64, 32), (32, 32, 24), (2, 1024, 8),
             (1, 1536, 4), (8, 512, 16))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: embedded model, "
                   "the one `splitserve up` serves)")
    p.add_argument("--out", default=os.path.join(PROFILE_DIR, "cpu.json"))
    p.add_argument("--name", default="cpu")
    p.add_argument("--no-serving", action="store_true",
                   help="skip the cluster run (serving overheads stay 0)")
    p.add_argument("--serving-requests", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("a GPU profile from `bench engine --device cuda --json` files")
    g.add_argument("--engine-json", nargs="+", default=None, metavar="PATH",
                   help="fit from these runs' step records instead of running the CPU "
                        "engine here (links and serving overheads: --like's)")
    g.add_argument("--like", default="h100", help="profile whose links and serving "
                   "overheads the fitted one keeps")
    g.add_argument("--peak-flop-s", type=float, default=None,
                   help="another device of the same chip: its own measured peaks and KV "
                        "pool, with the efficiencies and fixed costs fitted from the files")
    g.add_argument("--bandwidth-bytes-s", type=float, default=None)
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument("--links-json", default=None, metavar="PATH",
                   help="a `splitserve sim links` file measured on this device: its links "
                        "(those named by --links) replace --like's")
    g.add_argument("--links", default="kv,host,disk",
                   help="which of --links-json's links to take, comma-separated")
    g.add_argument("--serving-json", default=None, metavar="PATH",
                   help="the record of tests/gpu/test_sim_validation_gpu.py on this device "
                        "(SIM_VALIDATION_OUT): request and token overheads fitted from its "
                        "one-at-a-time requests, as the CPU calibration's serving step does")
    g.add_argument("--note", action="append", default=[], help="a note kept in the file")


def fit_steps(rows: list[tuple[float, int, float, float]]) -> tuple[list[float], float]:
    """Non-negative least squares of seconds ~ [1, seqs, flops, bytes] by trying every
    subset of columns (four columns: fifteen tiny solves). Rows are (seconds, seqs,
    flops, bytes). Returns (coefficients, the RMS of the relative errors)."""
    # Relative residuals (each row divided by its time): a 4 ms decode step weighs as
    # much as a 150 ms prefill.
    t = np.array([r[0] for r in rows])
    x = np.array([[1.0, r[1], r[2], r[3]] for r in rows]) / t[:, None]
    y = np.ones(len(rows))
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, 5):
        for cols in itertools.combinations(range(4), k):
            coef, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(4)
            full[list(cols)] = coef
            err = float(np.sqrt(np.mean((xs @ full - y) ** 2)))
            if best is None or err < best[0]:
                best = (err, full)
    assert best is not None  # the constant column alone is non-negative
    coef = best[1] / scale
    return [float(c) for c in coef], best[0]


def fit_roofline(rows: list[tuple[float, int, float, float]], max_iter: int = 50,
                 ) -> tuple[list[float], float, int]:
    """The GPU's step model, `seconds ~ a + b * seqs + max(c * flops, d * bytes)` (a
    device overlaps its matmuls with its memory traffic): each row is held against the
    term that bounds it under the current fit, the linear fit of `fit_steps` is redone on
    that split, until the split stops changing. Rows are (seconds, seqs, flops, bytes).
    Returns (coefficients, relative RMS error, iterations)."""
    coef, err = fit_steps(rows)  # start: the split the additive fit implies
    c, d = coef[2], coef[3]
    ridge = d / c if c > 0 and d > 0 else 100.0  # FLOPs per byte where the bounds cross
    bound = [f >= ridge * m for _, _, f, m in rows]
    for it in range(1, max_iter + 1):
        split = [(t, s, f if b else 0.0, 0.0 if b else m)
                 for (t, s, f, m), b in zip(rows, bound, strict=True)]
        coef, err = fit_steps(split)
        c, d = coef[2], coef[3]
        new = [c * f >= d * m for _, _, f, m in rows]
        if new == bound:
            return coef, err, it
        bound = new
    return coef, err, max_iter


def measure_engine(model_dir: str, seed: int) -> tuple[dict[str, Any], Any, list[Any], dict]:
    """Runs the workloads on the real engine; returns (model config dict, limits, steps,
    engine settings)."""
    import torch

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    # One worker = one core, one thread: as the experiments pin workers (bench/pin.py).
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    try:
        return _measure_engine(model_dir, cfg, seed)
    finally:  # the serving run's client must not share the worker's core
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def _measure_engine(model_dir: str, cfg: dict[str, Any], seed: int,
                    ) -> tuple[dict[str, Any], Any, list[Any], dict]:
    import torch

    from bench.engine_roofline import measure_limits
    from bench.engine_shape_bench import Workload, run_ours_workload
    from engine.llm import LLM

    limits = measure_limits(torch.device("cpu"), torch.float32)
    rng = random.Random(seed)
    vocab = int(cfg["vocab_size"])
    llm = LLM(model_dir, dtype="float32", enable_prefix_caching=False)
    steps = []
    for i, (n, p, o) in enumerate(WORKLOADS):
        prompts = [[rng.randrange(10, vocab) for _ in range(p)] for _ in range(n)]
        w = Workload(f"cal{i}", prompts, [o] * n, 0.0)
        run_ours_workload(llm, Workload("warm", prompts[:1], [2], 0.0), torch.device("cpu"))
        steps += run_ours_workload(llm, w, torch.device("cpu"))[1]
    eng = llm.engine
    settings = {"num_blocks": eng.runner.num_blocks, "block_size": eng.block_size,
                "max_num_seqs": eng.config.scheduler.max_num_seqs,
                "max_num_batched_tokens": eng.config.scheduler.max_num_batched_tokens,
                "torch_threads": torch.get_num_threads()}
    return cfg, limits, steps, settings


def engine_profile(name: str, cfg: dict[str, Any], limits: Any, steps: list[Any],
                   settings: dict[str, Any]) -> HardwareProfile:
    from bench.engine_roofline import ModelCost
    from engine.config import ModelConfig

    cost = ModelCost.from_config(ModelConfig.from_dict(cfg), 4)
    # One row per step shape, its median time: a loaded machine's stray slow steps
    # (another process, a GC pause) must not pull the fit. Every prompt of WORKLOADS
    # fits one step's budget, so each scheduled row samples: seqs = sampled.
    shapes: dict[tuple[bool, int, int], list[Any]] = {}
    for s in steps:
        shapes.setdefault((s.decode_only, s.tokens, s.sampled), []).append(s)
    rows = []
    for group in shapes.values():
        s = group[len(group) // 2]
        rows.append((statistics.median(g.seconds for g in group), max(1, s.sampled),
                     float(cost.step_flops(s.tokens, s.sampled, s.attn_pairs)),
                     float(cost.step_bytes(s.kv_tokens_read))))
    (a, b, c, d), rel = fit_steps(rows)
    peak, bw = limits.matmul_flop_s, limits.bandwidth_bytes_s
    return HardwareProfile(
        name=name, peak_flop_s=peak, bandwidth_bytes_s=bw,
        compute_efficiency=1.0 / (c * peak) if c > 0 else 1e6,
        memory_efficiency=1.0 / (d * bw) if d > 0 else 1e6,
        step_overhead_s=a, seq_overhead_s=b, combine="sum", dtype="float32", model=cfg,
        links={"kv": LinkSpec(1.0e9, 2e-4), "host": LinkSpec(bw / 2, 2e-5),
               "disk": LinkSpec(1.0e9, 1e-4)},
        num_blocks=settings["num_blocks"], block_size=settings["block_size"],
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        source="splitserve sim calibrate on this machine's CPU engine",
        fit={"steps": len(steps), "relative_rms_error": round(rel, 4),
             "limits": limits.to_json(), "engine": settings,
             "calibrated_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")})


def measure_serving(profile: HardwareProfile, model_dir: str, n: int, seed: int,
                    out_dir: str) -> dict[str, float]:
    """Sequential requests through a one-worker `splitserve up` cluster; the medians of
    measured minus modelled TTFT and TPOT. The client times tokens, not text (a chunk
    per token, OpenAIClient's `token_chunks`): the embedded model samples ids without
    text often enough that the first text comes tokens after the first token, and the
    simulator's TTFT is the first token's."""
    from bench.experiments.common import ExperimentConfig, measure, start_cluster
    from bench.load import LoadSpec
    from bench.runner import run_phase

    cfg = ExperimentConfig(model_dir, out_dir, seed=seed, progress=False)
    reqs = serving_requests(model_dir, n, seed)

    async def body(client: Any) -> list[Any]:
        return [await run_phase(client, reqs, LoadSpec("concurrency", concurrency=1),
                                name="serving", progress=False)]

    with start_cluster(cfg, colocated=1, pins={"colocated-0": "0"}) as cluster:
        phases, _ = measure(cfg, cluster, body, token_chunks=True)
    return serving_overheads(profile, phases[0].results)


def serving_requests(model_dir: str, n: int, seed: int) -> list[Any]:
    """Sequential requests for `serving_overheads`: prompts of 32-480 tokens, 16 out."""
    from bench.datasets import LengthDist, TokenPool, synthetic

    pool = TokenPool.from_tokenizer_dir(model_dir, seed)
    return synthetic(pool, n, LengthDist("uniform", 256, 224), LengthDist(mean=16),
                     seed=seed)


def serving_overheads(profile: HardwareProfile, results: list[Any],
                      fit_speed: bool = False) -> dict[str, float]:
    """From requests run one at a time on an idle cluster: the medians of measured minus
    modelled TTFT (`request_overhead_s`) and TPOT (`token_overhead_s`).

    With `fit_speed`, the profile's token overhead is kept and the requests measure
    instead how much slower than the profile the machine runs the engine right now, in
    two factors (sim.profile.at_speed):
      - `speed`, from the TPOTs: the median of measured over modelled TPOT (a decode
        step is engine time alone, and on a small model it is fixed costs and memory
        traffic, next to no FLOPs);
      - `compute_speed` and `request_overhead_s`, from the TTFTs: the least-squares line
        of TTFT, less the prefill's other time at `speed`, against its FLOP time (the
        prompts' 32-480 tokens spread that over a 15x range): the slope and intercept.
    A shared machine's speed drifts by tens of percent from the calibration's moment:
    left in the request overhead, the drift reads as a fixed cost per request, paid in
    full by requests whose prefill was a cache hit. And the two factors can differ (a
    decode step's fixed costs slow with whatever shares the worker's core, such as the
    gateway and client streaming its tokens, more than a prefill's matmuls do): one
    factor from the TPOTs then overstates every prefill and makes up for it with too
    small a request overhead. A line the requests do not determine (a slope or intercept
    out of range, or a profile whose terms do not add) leaves `compute_speed` at
    `speed`, the overhead the median as above."""
    from sim.latency import LatencyModel

    lat = LatencyModel(profile)
    rows = []  # (TTFT, the prefill's time, its FLOP time, its other time)
    decode = []  # (TPOT, a decode step's time, its FLOP time, its other time)
    for r in results:
        if r.ok and r.ttft_s is not None:
            p = r.prompt_len
            prefill = (p, 1, p * (p + 1) // 2, p, 1)
            rows.append((r.ttft_s, lat.seconds(*prefill), *lat.parts(*prefill)))
            if r.tpot_s is not None:
                step = (1, 1, p + 8, p + 8, 1)
                decode.append((r.tpot_s, lat.seconds(*step), *lat.parts(*step)))
    if not rows:
        raise RuntimeError("no request of the serving calibration succeeded")
    speed = compute = 1.0
    token = profile.token_overhead_s
    lo, hi = SPEED_RANGE
    if fit_speed and decode:
        speed = compute = min(hi, max(lo, statistics.median(
            tpot / (step + token) for tpot, step, _, _ in decode)))
    request = statistics.median(t - speed * prefill for t, prefill, _, _ in rows)
    if fit_speed and decode and profile.combine == "sum":
        one = speed
        # A decode step has a few FLOPs too: the two fits alternate (a contraction: a few
        # rounds settle both factors to float precision).
        for _ in range(ROUNDS):
            line = _ttft_line(rows, speed, lo, hi)
            if line is None:  # no line: the one factor, the overhead the median at it
                speed = compute = one
                request = statistics.median(t - one * prefill for t, prefill, _, _ in rows)
                break
            compute, request = line
            speed = min(hi, max(lo, statistics.median(
                (tpot - compute * c) / (m + token) for tpot, _, c, m in decode)))
    if not fit_speed:
        token = max(0.0, statistics.median(t - step for t, step, _, _ in decode)) \
            if decode else 0.0
    return {"request_overhead_s": max(0.0, request), "token_overhead_s": token,
            "speed": speed, "compute_speed": compute, "serving_requests": float(len(rows))}


SPEED_RANGE = (0.5, 4.0)  # a fitted speed outside it is a broken measurement, clamped
ROUNDS = 8


def _ttft_line(rows: list[tuple[float, float, float, float]], speed: float, lo: float,
               hi: float) -> tuple[float, float] | None:
    """(slope, intercept) of the least-squares line of TTFT less the prefill's other time
    at `speed` against its FLOP time; None where the rows set no line in range."""
    flops = np.array([c for _, _, c, _ in rows])
    if len(rows) < 3 or np.ptp(flops) == 0:
        return None
    left = np.array([t - speed * m for t, _, _, m in rows])
    (slope, intercept), *_ = np.linalg.lstsq(np.column_stack([flops, np.ones_like(flops)]),
                                             left, rcond=None)
    if not (lo <= slope <= hi and intercept >= 0):
        return None
    return float(slope), float(intercept)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from engine.cli import resolve_model

    if args.engine_json:
        from sim.calibrate_gpu import run_device

        return run_device(args)
    model_dir = resolve_model(args.model)
    print("measuring the engine's steps...", file=sys.stderr)
    cfg, limits, steps, settings = measure_engine(model_dir, args.seed)
    prof = engine_profile(args.name, cfg, limits, steps, settings)
    notes = [f"Fitted by `splitserve sim calibrate` from {len(steps)} steps of the real "
             f"CPU engine on {os.path.basename(model_dir)} ({cfg['num_hidden_layers']} "
             f"layers, hidden {cfg['hidden_size']}), float32.",
             "links are not measured by the calibration: kv is the tcp transport on "
             "loopback (~1 GB/s + 0.2 ms per transfer, bench transfer's order), host a "
             "memcpy at half the measured bandwidth, disk 1 GB/s."]
    if not args.no_serving:
        print("measuring serving overheads on a one-worker cluster...", file=sys.stderr)
        with tempfile.TemporaryDirectory() as logs:  # the cluster's logs
            serving = measure_serving(prof, model_dir, args.serving_requests, args.seed, logs)
        prof = replace(prof, request_overhead_s=serving["request_overhead_s"],
                       token_overhead_s=serving["token_overhead_s"],
                       fit={**prof.fit, "serving": serving})
    save_profile(prof, args.out, notes)
    f = prof.fit
    print(f"wrote {args.out}: step {prof.step_overhead_s * 1e3:.3f} ms + "
          f"{prof.seq_overhead_s * 1e3:.3f} ms/seq, compute eff {prof.compute_efficiency:.3g}, "
          f"memory eff {prof.memory_efficiency:.3g} (fit error {f['relative_rms_error']:.1%} "
          f"over {f['steps']} steps); request overhead {prof.request_overhead_s * 1e3:.2f} ms, "
          f"token overhead {prof.token_overhead_s * 1e3:.2f} ms")
    return 0
