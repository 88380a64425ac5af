"""`bench profile`'s engine part: workload c (bench/engine_shape_bench.py) on the real
engine, profiled over a window of mixed steps (prefills still running) and a window of
decode steps once every prefill is done.

The engine is built, warmed up and fed as `bench engine --device cuda` does it (the same
functions); each request gets a few output tokens more than c draws, so that every one of
them is still running when the decode window ends. Phases are profiler ranges opened by
the bench around the engine's own calls on this one instance (bench/host_bench.py's
`instrument`; nothing in the engine changes: a range costs ~5 µs even with the profiler
off on a 2-vCPU machine, against a small model's host time per step):

    engine.step > engine.schedule, engine.inputs, engine.forward, engine.sample,
                  engine.update, engine.outputs
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from bench import profile_trace as pt
from bench.host_bench import PHASES, PhaseTimer, instrument

PHASE_RANGES = tuple(f"engine.{p}" for p in PHASES)


class RangeTimer(PhaseTimer):
    """Opens a profiler range `engine.<phase>` around each phase (times nothing)."""

    def time(self, phase: str, fn: Any, *a: Any, **kw: Any) -> Any:
        from torch.profiler import record_function

        with record_function(f"engine.{phase}"):
            return fn(*a, **kw)


def model_dir_for(args: argparse.Namespace, root: str) -> str:
    """A known shape's config (dummy weights), or on CPU a tiny random Llama in `root`."""
    from bench.engine_bench import build_model
    from engine.model_shapes import model_shape_dir

    if args.model_shape is not None:
        return str(model_shape_dir(args.model_shape))
    return build_model(root, args.hidden_size, args.num_layers)[0]


def _prefills_done(engine: Any) -> bool:
    s = engine.scheduler
    return not s.waiting and all(r.num_output_tokens >= 1 for r in s.running)


def profile_window(engine: Any, recorder: Any, steps: int, device: Any,
                   trace: str) -> dict[str, Any]:
    """Profiles the next `steps` engine steps; writes their Chrome trace to `trace` and
    returns the median figures and each step's."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.engine_shape_bench import _sync

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    kinds = []
    overlap = engine.async_steps is not None
    with profile(activities=acts) as prof:
        for _ in range(steps):
            with record_function("engine.step"):
                engine.step()
            if not overlap:  # outside the step's range: its wall is the engine's own
                _sync(device)
            before = len(recorder.steps)
            recorder.record(0.0)
            r = recorder.steps[-1] if len(recorder.steps) > before else None
            kinds.append({"kind": "idle" if r is None else "decode" if r.decode_only
                          else "prefill" if r.sampled == 0 else "mixed",
                          "tokens": r.tokens if r else 0, "sampled": r.sampled if r else 0})
    prof.export_chrome_trace(trace)
    events = pt.load(trace)
    work = pt.DeviceWork(events)
    step_ranges = pt.ranges(events, "engine.step")
    per_step = [{**k, **pt.step_figures(events, s, work, PHASE_RANGES)}
                for k, s in zip(kinds, step_ranges, strict=True)]
    count = {k: sum(s["kind"] == k for s in per_step) for k in ("prefill", "mixed", "decode")}
    return {"summary": pt.summarize_steps(per_step), "kinds": count, "steps": per_step,
            "top_kernels": pt.top_kernels(step_ranges, events, work),
            "kernel": "CUDA kernel" if work.cuda else "top-level aten op (CPU)",
            "trace": os.path.abspath(trace)}


def profile_engine(args: argparse.Namespace, trace_dir: str) -> dict[str, Any]:
    """Workload c on our engine: the mixed window (`args.mixed_steps`, after the first
    step) and the decode window (`args.decode_steps`, once every prefill is done)."""
    import torch

    from bench.engine_shape_bench import (
        Workload,
        _free,
        _Recorder,
        make_llm,
        make_workloads,
        warm_up,
    )
    from engine.config import ModelConfig
    from engine.sampling_params import RequestOutputKind, SamplingParams

    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    with tempfile.TemporaryDirectory() as root:
        model_dir = model_dir_for(args, root)
        cfg = ModelConfig.from_model_dir(model_dir)
        name = getattr(args, "workload", "c")
        (c,) = make_workloads([name], args.scale, cfg.vocab_size,
                              cfg.max_position_embeddings, args.seed)
        extra = 2 + args.mixed_steps + args.decode_steps
        w = Workload(name, c.prompts, [o + extra for o in c.out_lens], c.temperature)
        llm = make_llm(model_dir, device, dtype, [w], args)
        warm_up(llm, w)
        engine = llm.engine
        instrument(engine, RangeTimer())
        # Async scheduling: no synchronize per step (profile_window). A step's range
        # counts the kernels its call launched, wherever they ran (the device runs them
        # while the next call's host work goes on), and its kind is that step's.
        recorder = _Recorder()
        recorder.attach(engine)
        for i, (p, o) in enumerate(zip(w.prompts, w.out_lens, strict=True)):
            engine.add_request(f"profile-{i}", p, SamplingParams(
                max_tokens=o, temperature=w.temperature, ignore_eos=True,
                output_kind=RequestOutputKind.DELTA))  # as a worker streams
        engine.step()  # the first prefills: the mixed window starts after it
        windows: dict[str, Any] = {}
        if args.mixed_steps:
            windows["mixed"] = profile_window(engine, recorder, args.mixed_steps, device,
                                              os.path.join(trace_dir, "engine-mixed.json"))
        while not _prefills_done(engine):
            engine.step()
        windows["decode"] = profile_window(engine, recorder, args.decode_steps, device,
                                           os.path.join(trace_dir, "engine-decode.json"))
        batch = len(engine.scheduler.running)
        del llm, engine, recorder
        _free(device)  # the KV pool's memory back to the device for the hand-off's caches
    return {"workload": c.describe(), "workload_name": name, "extra_output_tokens": extra,
            "decode_batch": batch,
            "device": str(device),
            "dtype": dtype, "model": args.model_shape or
            f"random llama, hidden {args.hidden_size}, {args.num_layers} layers",
            "windows": windows}
