"""`splitserve sim calibrate --engine-json`: a GPU profile from measurements taken on the
GPU (../shared/GPU.md; bench/gpu_checks.sh takes them):

- the engine's steps, recorded by `bench engine --device cuda --json`: efficiencies and
  fixed costs fitted against the peaks the same runs measured (`fit_roofline`, combine
  max), the KV pool and batch limits as the engine sized them;
- its links (`--links-json`): a `splitserve sim links` file (sim/links.py);
- its serving overheads (`--serving-json`): the one-at-a-time requests of
  tests/gpu/test_sim_validation_gpu.py's record, fitted as the CPU calibration's serving
  step fits its own (`serving_overheads`).

What is not measured stays `--like`'s, and the profile's notes say which.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from sim.calibrate import fit_roofline, serving_overheads
from sim.profile import HardwareProfile, save_profile


def engine_json_rows(paths: list[str]) -> tuple[list[tuple[float, int, float, float]],
                                                 dict[str, Any], list[dict[str, Any]]]:
    """The steps every `bench engine --device cuda --json` file recorded, as fit rows
    (seconds, sampled rows, FLOPs, bytes) by bench/engine_roofline.py's cost model;
    returns (rows, the first file's config, every file's limits)."""
    from bench.engine_roofline import ModelCost
    from engine.config import ModelConfig
    from engine.model_shapes import model_shape_dir

    rows: list[tuple[float, int, float, float]] = []
    config: dict[str, Any] = {}
    limits = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        c = data["config"]
        if config and (c["model_shape"], c["dtype"]) != (config["model_shape"],
                                                         config["dtype"]):
            raise ValueError(f"{path}: another model shape or dtype than {paths[0]}")
        config = config or c
        limits.append(data["limits"])
        cost = ModelCost.from_config(ModelConfig.from_model_dir(
            model_shape_dir(c["model_shape"])), 2 if c["dtype"] != "float32" else 4)
        for w in data["workloads"].values():
            steps = w["ours"].get("steps")
            if steps is None:
                raise ValueError(f"{path} has no step records (bench engine before they "
                                 "were kept): run it again")
            for sec, tokens, sampled, pairs, kv, _ in steps:
                rows.append((sec, max(1, sampled), float(cost.step_flops(tokens, sampled, pairs)),
                             float(cost.step_bytes(kv))))
    return rows, config, limits


def device_profile(name: str, paths: list[str], like: HardwareProfile,
                   outlier: float = 2.0) -> tuple[HardwareProfile, list[str]]:
    """A GPU profile fitted from `bench engine --device cuda --json` files: peaks as
    measured in those runs (the best of them), efficiencies and fixed costs by
    `fit_roofline`, the KV pool and batch limits as the engine sized them. Steps slower
    than `outlier` x the first fit (Triton compiling a kernel specialization on first
    use, ~0.5 s) are dropped and the fit redone. Links and serving overheads are not
    measured by `bench engine`: they stay `like`'s."""
    from dataclasses import replace

    rows, config, limits = engine_json_rows(paths)
    coef, _, _ = fit_roofline(rows)
    model = [coef[0] + coef[1] * s + max(coef[2] * f, coef[3] * m) for _, s, f, m in rows]
    kept = [r for r, t in zip(rows, model, strict=True) if r[0] <= outlier * t]
    (a, b, c, d), err, iters = fit_roofline(kept)
    peak = max(lim["matmul_flop_s"] for lim in limits)
    bw = max(lim["bandwidth_bytes_s"] for lim in limits)
    eng = config["engine"]
    prof = replace(
        like, name=name, peak_flop_s=peak, bandwidth_bytes_s=bw,
        compute_efficiency=1.0 / (c * peak) if c > 0 else 1e6,
        memory_efficiency=1.0 / (d * bw) if d > 0 else 1e6,
        step_overhead_s=a, seq_overhead_s=b, combine="max", dtype=config["dtype"],
        model={}, model_shape=config["model_shape"], num_blocks=eng["num_kv_blocks"],
        block_size=eng["block_size"], max_num_seqs=eng["max_num_seqs"],
        max_num_batched_tokens=eng["max_num_batched_tokens"],
        source=f"splitserve sim calibrate --engine-json: bench engine --device cuda on "
               f"{limits[0]['device']}",
        fit={"steps": len(rows), "outliers_dropped": len(rows) - len(kept),
             "relative_rms_error": round(err, 4), "iterations": iters,
             "limits": limits[0], "engine": eng, "torch": config.get("torch"),
             "files": [os.path.basename(p) for p in paths],
             "calibrated_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    notes = [f"Fitted by `splitserve sim calibrate --engine-json` from {len(kept)} of "
             f"{len(rows)} engine steps of `bench engine --device cuda --model-shape "
             f"{config['model_shape']}` ({config['dtype']}, {eng['attention_backend']} "
             f"attention, CUDA graphs {'on' if eng['cuda_graphs'] else 'off'}) on "
             f"{limits[0]['device']}; {len(rows) - len(kept)} steps over {outlier:g}x the "
             f"first fit dropped (Triton compiling a kernel specialization on first use).",
             "Peaks: the same runs' device-to-device copy and bf16 GEMM "
             f"({bw / 1e12:.3g} TB/s, {peak / 1e12:.3g} TFLOP/s); combine max (roofline).",
             f"request_overhead_s and token_overhead_s are {like.name}'s "
             "(bench engine does not measure them)."]
    return prof, notes


def serving_json_results(path: str) -> tuple[list[Any], str]:
    """The one-at-a-time requests ("before" and "after" phases) of a GPU validation
    record, as `serving_overheads` reads them; and the device they ran on."""
    from types import SimpleNamespace

    with open(path) as f:
        d = json.load(f)
    try:
        rows = [r for name in ("before", "after") for r in d["phases"][name]["requests"]]
    except KeyError as e:
        raise SystemExit(f"{path}: not a sim validation record (no {e} phase)") from e
    return [SimpleNamespace(**r) for r in rows], d.get("device", "?")


def run_device(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from sim.profile import load_profile

    like = load_profile(args.like)
    prof, notes = device_profile(args.name, args.engine_json, like)
    over = {k: v for k, v in (("peak_flop_s", args.peak_flop_s),
                              ("bandwidth_bytes_s", args.bandwidth_bytes_s),
                              ("num_blocks", args.num_blocks)) if v is not None}
    if over:
        prof = replace(prof, **over, source=prof.source + f"; {args.name}'s own " +
                       ", ".join(over) + " (--" + " --".join(k.replace("_", "-")
                                                          for k in over) + ")")
    measured: set[str] = set()
    if args.links_json:
        from sim.links import load_links

        links, link_notes, fits = load_links(args.links_json, args.links.split(","))
        measured = set(links)
        prof = replace(prof, links={**prof.links, **links},
                       fit={**prof.fit, "links": fits})
        notes += link_notes
    if args.serving_json:
        results, device = serving_json_results(args.serving_json)
        serving = serving_overheads(prof, results)  # on this device's own step model
        prof = replace(prof, request_overhead_s=serving["request_overhead_s"],
                       token_overhead_s=serving["token_overhead_s"],
                       fit={**prof.fit, "serving": {**serving, "device": device, "file":
                                                    os.path.basename(args.serving_json)}})
        notes = [n for n in notes if not n.startswith("request_overhead_s and token")]
        notes.append(f"request_overhead_s {serving['request_overhead_s'] * 1e3:.2f} ms and "
                     f"token_overhead_s {serving['token_overhead_s'] * 1e3:.2f} ms: medians of "
                     f"measured minus modelled TTFT and TPOT of {len(results)} requests sent "
                     f"one at a time to one real worker on {device} "
                     f"({os.path.basename(args.serving_json)}, tests/gpu/"
                     "test_sim_validation_gpu.py): the gateway, the RPC and what the "
                     "roofline leaves out of a short prompt's eager prefill (kernel launches).")
    if kept := sorted(set(prof.links) - measured):
        notes.append(f"Links {', '.join(kept)}: {like.name}'s (not measured on this device).")
    save_profile(prof, args.out, notes + list(args.note))
    f = prof.fit
    print(f"wrote {args.out}: step {prof.step_overhead_s * 1e3:.3f} ms + "
          f"{prof.seq_overhead_s * 1e3:.3f} ms/seq, compute eff {prof.compute_efficiency:.3g} "
          f"of {prof.peak_flop_s / 1e12:.4g} TFLOP/s, memory eff {prof.memory_efficiency:.3g} "
          f"of {prof.bandwidth_bytes_s / 1e12:.4g} TB/s (fit error "
          f"{f['relative_rms_error']:.1%} over {f['steps'] - f['outliers_dropped']} steps, "
          f"{f['outliers_dropped']} dropped)")
    return 0
