"""`splitserve bench engine --device cuda --model-shape S`: our engine and transformers'
`generate` on a known model shape with random weights (load format dummy), next to the
machine's limits measured in the same run.

Workloads (each scaled by --scale):
  a  1 request, 512 prompt + 256 output tokens            decode-bound latency
  b  64 concurrent requests, 512 + 128                      batched decode
  c  nano-vllm's throughput workload: 256 requests, prompt and output lengths uniform
     in [100, 1024], ignore_eos, temperature 0.6 (as nano-vllm's bench.py)
  d  one 8k-token prompt's prefill (1 output token)         compute-bound prefill

Every request ignores eos, so both engines produce exactly the tokens asked for;
transformers pads a batch (left) to its longest prompt and generates until the longest
output is done, and we count for it, as for us, only the tokens each request asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.engine_roofline import (
    MachineLimits,
    ModelCost,
    StepRecord,
    causal_pairs,
    measure_limits,
    roofline_label,
    step_summary,
)
from bench.jit_compiles import jit_compiles
from engine.cli import cache_dtype_kwargs, parallel_kwargs
from engine.config import ModelConfig
from engine.gc_heap import freeze_startup_heap

WORKLOADS = ("a", "b", "c", "d", "e")
STEP_FIELDS = ("seconds", "tokens", "sampled", "attn_pairs", "kv_tokens_read", "decode_only")
PREFILL_LEN = 8192
LONG_CONTEXT = 7168  # workload e's prompts


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    out_lens: list[int]
    temperature: float = 0.0

    @property
    def kind(self) -> str:
        """What tok/s counts: output tokens, or prompt tokens for the prefill workload."""
        return "prefill" if self.name == "d" else "output"

    def describe(self) -> str:
        """'64 x (512 + 128)': requests x (prompt + output tokens), ranges where they vary."""
        return f"{len(self.prompts)} x ({_span(list(map(len, self.prompts)))} + " \
            f"{_span(self.out_lens)})"

    @property
    def counted_tokens(self) -> int:
        if self.kind == "prefill":
            return sum(map(len, self.prompts))
        return sum(self.out_lens)


def _span(xs: list[int]) -> str:
    lo, hi = min(xs), max(xs)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def make_workloads(names: list[str], scale: float, vocab: int, max_len: int,
                   seed: int = 0) -> list[Workload]:
    """The chosen workloads with request counts and lengths multiplied by `scale`;
    token ids uniform in [0, min(vocab, 10000)) as nano-vllm's bench draws them."""
    rng = random.Random(seed)
    hi = min(vocab, 10000)

    def n(x: int) -> int:
        return max(1, round(x * scale))

    def prompt(length: int) -> list[int]:
        return [rng.randrange(hi) for _ in range(length)]

    out = []
    for name in names:
        if name == "a":
            out.append(Workload("a", [prompt(n(512))], [n(256)]))
        elif name == "b":
            out.append(Workload("b", [prompt(n(512)) for _ in range(n(64))], [n(128)] * n(64)))
        elif name == "c":
            lens = [(rng.randint(n(100), n(1024)), rng.randint(n(100), n(1024)))
                    for _ in range(n(256))]
            out.append(Workload("c", [prompt(p) for p, _ in lens], [o for _, o in lens],
                                temperature=0.6))
        elif name == "d":
            out.append(Workload("d", [prompt(min(n(PREFILL_LEN), max_len - 1))], [1]))
        elif name == "e":  # decode over long contexts (for `sim calibrate --engine-json`):
            # on an 8B model the KV a step reads ~ its weights, where a-d read < 1k per row
            out_len = n(128)
            length = min(n(LONG_CONTEXT), max_len - out_len - 1)
            out.append(Workload("e", [prompt(length) for _ in range(n(16))], [out_len] * n(16)))
        else:
            raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    return out


# -- our engine ------------------------------------------------------------------------

@dataclass(slots=True)
class _Recorder:
    """Sees what each engine step scheduled, by wrapping the engine's scheduler on this
    one instance (read-only: the scheduler's output is passed through untouched).

    `lag`: async scheduling, where a call to `engine.step` launches the step it
    schedules and returns once it has read the step the previous call launched: the
    time between two returns is then the previous call's step; a call that read
    nothing (the first launch) adds its time to the next step recorded."""

    steps: list[StepRecord] = field(default_factory=list)
    last: list[tuple[int, int, int, int]] = field(default_factory=list)
    lag: bool = False
    launched: list[tuple[int, int, int, int]] = field(default_factory=list)
    carried: float = 0.0

    def attach(self, engine: Any) -> None:
        inner = engine.scheduler.schedule

        def schedule() -> Any:
            out = inner()
            # (start, end, num_tokens, num_prompt_tokens) before the step updates them
            # (a token in flight under async scheduling counts: its row samples next)
            self.last = [(s.request.num_computed_tokens,
                          s.request.num_computed_tokens + s.num_new_tokens,
                          s.request.num_tokens_with_placeholders,
                          s.request.num_prompt_tokens)
                         for s in out.scheduled]
            return out

        engine.scheduler.schedule = schedule

    def record(self, seconds: float) -> None:
        last, self.last = self.last, []
        if self.lag:
            last, self.launched = self.launched, last
            if not last:
                self.carried += seconds
                return
            seconds, self.carried = seconds + self.carried, 0.0
        if not last:
            return
        self.steps.append(StepRecord(
            seconds=seconds, tokens=sum(e - s for s, e, _, _ in last),
            sampled=sum(1 for _, e, n, _ in last if e == n),
            attn_pairs=sum(causal_pairs(s, e) for s, e, _, _ in last),
            kv_tokens_read=sum(e for _, e, _, _ in last),
            decode_only=all(e - s == 1 and s >= p for s, e, _, p in last)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours_workload(llm: Any, w: Workload, device: torch.device,
                      ) -> tuple[float, list[StepRecord], list[dict[str, Any]]]:
    """Runs the workload to completion on `llm`'s engine; returns (seconds, steps, the
    Triton kernels compiled during the run: `jit_compiles`)."""
    from engine.sampling_params import RequestOutputKind, SamplingParams

    engine = llm.engine
    # Under async scheduling the host runs a step ahead of the device: no synchronize
    # per step (it would hold the next step's launch until the device is idle); each
    # step is timed by the return that reads it.
    lag = engine.async_steps is not None
    rec = _Recorder(lag=lag)
    rec.attach(engine)
    with contextlib.ExitStack() as stack:
        stack.callback(delattr, engine.scheduler, "schedule")  # back to the class's method
        # (the step whose time the current call ends up in: the next one recorded)
        compiles = stack.enter_context(jit_compiles(lambda: len(rec.steps)))
        _sync(device)
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(zip(w.prompts, w.out_lens, strict=True)):
            # one output per request, at its end: LLM.generate's (and the peers') offline run
            engine.add_request(f"bench-{w.name}-{i}", p, SamplingParams(
                max_tokens=o, temperature=w.temperature, ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY))
        produced = 0
        while engine.has_work():
            s0 = time.perf_counter()
            outs = engine.step()
            if not lag:
                _sync(device)
            rec.record(time.perf_counter() - s0)
            produced += sum(o.num_output_tokens for o in outs if o.finished)
        _sync(device)
        seconds = time.perf_counter() - t0
    if produced != sum(w.out_lens):
        raise RuntimeError(f"workload {w.name}: {produced} tokens, expected {sum(w.out_lens)}")
    return seconds, rec.steps, compiles


def make_llm(model_dir: str, device: torch.device, dtype: str, workloads: list[Workload],
             args: argparse.Namespace) -> Any:
    """Our engine sized for the workloads: every request of the largest one may run at
    once; on CPU the KV pool holds them all, on CUDA it is sized from free memory."""
    from engine.llm import LLM

    bs = 16
    max_seqs = max(len(w.prompts) for w in workloads)
    longest = max(len(p) for w in workloads for p in w.prompts)
    max_len = max(len(p) + o for w in workloads for p, o in zip(w.prompts, w.out_lens,
                                                                 strict=True))
    kw: dict[str, Any] = {}
    if device.type != "cuda":
        kw["num_blocks"] = max(sum(-(-(len(p) + o) // bs) + 1 for p, o in
                                   zip(w.prompts, w.out_lens, strict=True)) for w in workloads)
    # One step can take the whole 8k prompt, so (d) times a single prefill forward.
    budget = args.max_num_batched_tokens or max(16384 if device.type == "cuda" else 2048,
                                                longest)
    return LLM(model_dir, device=str(device), dtype=dtype, load_format="dummy",
               block_size=bs, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
               max_model_len=max_len,
               enable_prefix_caching=False, enforce_eager=args.enforce_eager,
               max_graph_tokens=getattr(args, "max_graph_tokens", 512),
               attention_backend=args.attention_backend,
               attention_tuning=getattr(args, "attention_tuning", "auto"),
               gpu_memory_utilization=args.gpu_memory_utilization,
               **cache_dtype_kwargs(args),
               async_scheduling=getattr(args, "async_scheduling", None),
               **parallel_kwargs(args), **kw)


def warm_up(llm: Any, w: Workload) -> None:
    """Runs a few of the workload's own requests, short, before it is timed: kernels
    compile and allocator caches fill for its lengths and sampling outside the figure."""
    from engine.sampling_params import SamplingParams

    k = min(len(w.prompts), 8)
    llm.generate(w.prompts[:k], [SamplingParams(max_tokens=min(o, 4), ignore_eos=True,
                                                temperature=w.temperature)
                                 for o in w.out_lens[:k]])


# -- transformers ------------------------------------------------------------------------

def make_hf(model_dir: str, device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' model of the same config, random weights from its own init, built on
    the device, SDPA attention."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    cfg = tf.AutoConfig.from_pretrained(model_dir)
    with device:
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype,
                                                    attn_implementation="sdpa")
    return model.eval()


def hf_batch_size(w: Workload, requested: int) -> int:
    # Beyond 64 rows, transformers' padded KV cache of the long workload outgrows memory.
    return requested or min(len(w.prompts), 64)


def run_hf_workload(model: Any, w: Workload, device: torch.device, batch_size: int) -> float:
    pad = 0
    _sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(w.prompts), batch_size):
        batch, lens = w.prompts[i:i + batch_size], w.out_lens[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=device)
        sample = {"do_sample": True, "temperature": w.temperature, "top_k": 0,
                  "top_p": 1.0} if w.temperature > 0 else {"do_sample": False}
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                           min_new_tokens=max(lens), pad_token_id=pad, **sample)
    _sync(device)
    return time.perf_counter() - t0


# -- results ------------------------------------------------------------------------------

# Which steps and which roofline each workload is held against (the issue's targets).
_ROOFLINE = {"a": ("decode", "memory_frac"), "b": ("decode", "memory_frac"),
             "c": ("all_steps", "roofline_frac"), "d": ("prefill", "compute_frac"),
             "e": ("decode", "memory_frac")}


def workload_result(w: Workload, ours_s: float, steps: list[StepRecord],
                    compiles: list[dict[str, Any]], hf: tuple[float, int] | None,
                    cost: ModelCost, limits: MachineLimits) -> dict[str, Any]:
    n = w.counted_tokens
    phases = {"decode": step_summary(steps, cost, limits, True),
              "prefill": step_summary(steps, cost, limits, False),
              "all_steps": step_summary(steps, cost, limits, None)}
    phase, key = _ROOFLINE[w.name]
    held = phases[phase]
    hf_tok_s = n / hf[0] if hf else None
    return {
        "summary": {"ours_tok_s": n / ours_s, "hf_tok_s": hf_tok_s,
                    "ratio_hf": (n / ours_s) / hf_tok_s if hf_tok_s else None,
                    "roofline_frac": held[key] if held else None,
                    "roofline": roofline_label(phase, key),
                    "tok_s_counts": f"{w.kind} tokens"},
        "describe": w.describe(), "requests": len(w.prompts),
        "prompt_tokens": sum(map(len, w.prompts)),
        "output_tokens": sum(w.out_lens), "temperature": w.temperature,
        "ours": {"seconds": ours_s, **phases,
                 # every step, for `sim calibrate --engine-json` to fit a profile from
                 "step_fields": list(STEP_FIELDS),
                 "steps": [[round(s.seconds, 7), s.tokens, s.sampled, s.attn_pairs,
                            s.kv_tokens_read, int(s.decode_only)] for s in steps],
                 # Triton kernels first compiled inside the timed run, by step
                 "jit_compiles": compiles},
        "hf": {"seconds": hf[0], "batch_size": hf[1]} if hf else None,
    }


def print_result(result: dict[str, Any]) -> None:
    c, lim = result["config"], result["limits"]
    print(f"shape {c['model_shape']}: {c['params'] / 1e9:.3g} B params, {c['dtype']} on "
          f"{lim['device']}; load format dummy (random weights)")
    print(f"limits (measured now): {lim['bandwidth_GB_s']:.4g} GB/s [{lim['bandwidth_method']}]"
          f"; {lim['matmul_TFLOP_s']:.4g} TFLOP/s [{lim['matmul_method']}]")
    print(f"{'workload':<38}{'ours tok/s':>12}{'hf tok/s':>11}{'ours/hf':>9}"
          f"{'step ms':>10}{'roof ms':>10}{'of roof':>9}")
    for name, r in result["workloads"].items():
        if compiled := r["ours"].get("jit_compiles"):
            steps = sorted({c["step"] for c in compiled})
            print(f"workload {name}: {len(compiled)} Triton kernel variants compiled inside "
                  f"the timed run, at steps {steps}: "
                  f"{', '.join(sorted({c['kernel'] for c in compiled}))}", file=sys.stderr)
    for name, r in result["workloads"].items():
        s = r["summary"]
        phase = _ROOFLINE[name][0]
        held = r["ours"][phase] or {}
        roof_ms = held.get({"decode": "memory_roofline_ms", "prefill": "compute_roofline_ms",
                            "all_steps": "roofline_ms"}[phase], float("nan"))
        hf = f"{s['hf_tok_s']:>11.1f}{s['ratio_hf']:>8.2f}x" if s["hf_tok_s"] else \
            f"{'-':>11}{'-':>9}"
        frac = s["roofline_frac"]
        label = f"{r['describe']} ({phase})"
        print(f"{name}  {label:<35}{s['ours_tok_s']:>12.1f}{hf}"
              f"{held.get('mean_ms', float('nan')):>10.3f}{roof_ms:>10.3f}"
              f"{frac if frac is not None else float('nan'):>9.3f}")
    print("tok/s counts output tokens (prompt tokens for d); step ms: our mean step time "
          "over the roofline's steps (decode-only for a, b, e; all for c; prefill for d)")


# -- the run -------------------------------------------------------------------------------

def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_ours_all(model_dir: str, device: torch.device, dtype: str, workloads: list[Workload],
                 args: argparse.Namespace,
                 ) -> tuple[dict[str, tuple[float, list[StepRecord], list[dict[str, Any]]]],
                            dict[str, Any]]:
    """Every workload on one engine; returns ({name: run_ours_workload's}, engine
    settings)."""
    llm = make_llm(model_dir, device, dtype, workloads, args)
    freeze_startup_heap()  # as a worker once up: full collections skip start-up's objects
    results = {}
    try:
        for w in workloads:
            warm_up(llm, w)
            results[w.name] = run_ours_workload(llm, w, device)
    finally:
        gc.unfreeze()  # this process goes on (transformers' runs): the engine collectible
    engine = llm.engine
    engine.check_integrity()
    cfg = engine.config
    info = {"num_kv_blocks": engine.runner.num_blocks, "block_size": cfg.cache.block_size,
            "max_num_seqs": cfg.scheduler.max_num_seqs, "max_model_len": engine.max_model_len,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "attention_backend": cfg.backend, "cuda_graphs": cfg.use_cuda_graphs,
            "mixed_graphs": engine.runner.mixed_graphs is not None
            and engine.runner.mixed_graphs.capture_enabled,
            "max_graph_tokens": cfg.max_graph_tokens,
            "graph_replays": {"decode": getattr(engine.runner.graphs, "replays", 0),
                              "mixed": getattr(engine.runner.mixed_graphs, "replays", 0)},
            "attention_tuning": cfg.tunes_attention,
            "async_scheduling": cfg.schedules_async,
            # whether the bench synchronised the device after every step (not under
            # async scheduling, whose overlap that would undo)
            "step_sync": not cfg.schedules_async,
            # the launch configurations chosen at start-up ("" where untuned)
            "attention_tables": {k: t.describe() for k in ("decode", "prefill")
                                 if (t := getattr(engine.runner.attention, f"{k}_table",
                                                  None)) is not None},
            "prefix_caching": cfg.cache.enable_prefix_caching}
    del llm, engine
    _free(device)
    return results, info


def run_hf_all(model_dir: str, device: torch.device, dtype: torch.dtype,
               workloads: list[Workload], batch: int) -> dict[str, tuple[float, int]]:
    model = make_hf(model_dir, device, dtype)
    results = {}
    for w in workloads:
        bs = hf_batch_size(w, batch)
        k = min(len(w.prompts), 4)  # warm-up: a few of its requests, short
        run_hf_workload(model, Workload(w.name, w.prompts[:k], [min(o, 4) for o in
                                                               w.out_lens[:k]],
                                        w.temperature), device, k)
        results[w.name] = (run_hf_workload(model, w, device, bs), bs)
    del model
    _free(device)
    return results


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise SystemExit(f"--workloads takes a comma-separated subset of {','.join(WORKLOADS)}")
    return names


def run(args: argparse.Namespace) -> int:
    from engine.model_shapes import model_shape_dir
    from engine.models.loader import TORCH_DTYPES

    if args.model_shape is None:
        raise SystemExit("bench engine --device needs --model-shape (e.g. llama3-8b)")
    if args.scale <= 0:
        raise SystemExit("--scale must be positive")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model_dir = model_shape_dir(args.model_shape)
    cfg = ModelConfig.from_model_dir(model_dir)
    workloads = make_workloads(_names(args.workloads), args.scale, cfg.vocab_size,
                               cfg.max_position_embeddings, args.seed)
    limits = measure_limits(device, TORCH_DTYPES[dtype])
    _free(device)
    fp8_kv = getattr(args, "kv_cache_dtype", "auto") != "auto"
    cost = ModelCost.from_config(cfg, TORCH_DTYPES[dtype].itemsize, 1 if fp8_kv else None)
    print(f"measured: {limits.bandwidth_bytes_s / 1e9:.4g} GB/s, "
          f"{limits.matmul_flop_s / 1e12:.4g} TFLOP/s; running our engine...", file=sys.stderr)
    ours, engine_info = run_ours_all(model_dir, device, dtype, workloads, args)
    hf: dict[str, tuple[float, int]] = {}
    if not args.skip_hf:
        print("running transformers generate...", file=sys.stderr)
        hf = run_hf_all(model_dir, device, TORCH_DTYPES[dtype], workloads, args.hf_batch_size)
    per = {w.name: workload_result(w, *ours[w.name], hf.get(w.name), cost, limits)
           for w in workloads}
    result = {"summary": {k: r["summary"] for k, r in per.items()}, "workloads": per,
              "limits": limits.to_json(),
              "config": {**_config(args, cfg, cost, device, dtype), "engine": engine_info,
                         "hf_batch_size": {w.name: hf[w.name][1] for w in workloads
                                           if w.name in hf}}}
    print_result(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _config(args: argparse.Namespace, cfg: ModelConfig, cost: ModelCost,
            device: torch.device, dtype: str) -> dict[str, Any]:
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {"model_shape": args.model_shape, "device": str(device), "dtype": dtype,
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
            "params": cost.params, "weight_bytes_per_step": cost.weight_bytes,
            "kv_bytes_per_token": cost.kv_bytes_per_token, "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "scale": args.scale, "seed": args.seed,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "torch": torch.__version__, "transformers": tf_version,
            "torch_threads": torch.get_num_threads()}
