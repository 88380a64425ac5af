"""`splitserve bench host`: the engine's host (CPU) time per decode step, split by phase.

A real engine on a tiny random-weight Llama (CPU) runs a batch of decode requests at
workload c's lengths (prompts and outputs U[100, 1024], nano-vllm's benchmark); once
every request has `--decoded` output tokens (past its prefill), `--steps` decode steps
are timed. Each phase is timed
(the engine thread's CPU time) around the engine's own calls (the bench wraps them on the one
engine instance it builds; nothing in the engine changes):

    # | schedule | inputs | forward | sample | update | outputs | other |

`schedule`: Scheduler.schedule; `inputs`: the persistent batch's plan of the step and
StepInputBuilder.build_planned (engine/input_batch.py); `forward`: the model
call and its LM head (the tiny model's CPU forward, the reference, not host overhead);
`sample`: ModelRunner.sample and reading the tokens; `update`:
Scheduler.update_from_output; `outputs`: stop checks, detokenization and RequestOutputs
(DELTA, as a worker streams them); `other`: the rest of `LLMEngine.step`. Host time is
the step minus `forward`; on a GPU it is what the device waits for unless async scheduling hides it behind the forward.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

PHASES = ("schedule", "inputs", "forward", "sample", "update", "outputs")
# CPU time of the engine's thread: time the shared machine gives other processes is not
# counted. Torch and the tokenizer run on that thread alone (`run`), so it is all the
# step's work.
CLOCK = time.thread_time


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1 (every prefill done)")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=256, help="running decode requests")
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024],
                   metavar=("MIN", "MAX"), help="output tokens left when timing starts "
                   "(ignore_eos)")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps (medians)")
    p.add_argument("--decoded", type=_at_least_one, default=8,
                   help="output tokens every request has when timing starts (all prefills "
                   "done): per-token work that grows with the output shows at large values")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the tokenizer's and model's vocabulary, its words random "
                   "(bench.engine_bench.widen_tokenizer), e.g. 128256 as Llama 3: "
                   "detokenization's cost depends on it (default: the default "
                   "tokenizer's, about 700)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine schedules step n+1 before it reads step n's tokens")
    p.add_argument("--gc-churn", type=float, default=0.0, metavar="SECONDS",
                   help="then serve a stream of requests (each replaced as it finishes) "
                   "for SECONDS with the start-up heap unfrozen, then as long frozen "
                   "(engine.gc_heap), and compare the collector's full collections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results here")


class PhaseTimer:
    """Accumulates seconds per phase while `active`, exclusive: a phase timed inside
    another (the outputs inside an async step's resolve) counts for itself only."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.active = False
        self._inner: list[float] = []  # per open phase: seconds of phases inside it

    def time(self, phase: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        self._inner.append(0.0)
        t0 = CLOCK()
        try:
            return fn(*a, **kw)
        finally:
            elapsed = CLOCK() - t0
            inner = self._inner.pop()
            if self._inner:
                self._inner[-1] += elapsed
            if self.active:
                self.seconds[phase] += elapsed - inner

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        fn: Callable[..., Any] = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*a: Any, **kw: Any) -> Any:
            return self.time(phase, fn, *a, **kw)

        setattr(obj, name, timed)


def instrument(engine: Any, timer: PhaseTimer | None = None) -> PhaseTimer:
    """Times `engine`'s phases with `timer` (default a new PhaseTimer; instance attributes
    shadow the methods). `sample` also covers reading the sampled tokens; under async
    scheduling `update` is the resolve of the step in flight (appending its tokens)."""
    timer = PhaseTimer() if timer is None else timer
    runner = engine.runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(runner.batch, "plan", "inputs")
    timer.wrap(runner.inputs, "build_planned", "inputs")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "forward")  # the LM head: device work too
    timer.wrap(engine.scheduler, "update_from_output", "update")
    timer.wrap(engine, "_step_outputs", "outputs")
    if engine.async_steps is not None:
        timer.wrap(engine.async_steps, "_resolve", "update")
    sample = runner.sample

    def timed_sample(*a: Any, **kw: Any) -> Any:
        tokens = timer.time("sample", sample, *a, **kw)
        result = tokens.result
        tokens.result = lambda: timer.time("sample", result)
        return tokens

    runner.sample = timed_sample
    return timer


class GCTimer:
    """CPU seconds the cyclic garbage collector took while `active` (within the phases
    it interrupted), and how many full (generation 2) collections ran."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self.active = False
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = CLOCK()
        elif self.active:
            self.seconds += CLOCK() - self._t0
            self.full += info["generation"] == 2

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def gc_churn(engine: Any, seconds: float, batch: int, rng: random.Random) -> dict[str, float]:
    """Serves for `seconds` a stream of short requests (prompts of 16..128 tokens, 8..64
    output tokens), `batch` in flight, each replaced as it finishes; the collector's
    full collections meanwhile: how many, their wall time in all and the longest (the
    step loop stands still through each)."""
    from engine.sampling_params import RequestOutputKind, SamplingParams

    full: list[float] = []
    t0 = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            t0[0] = time.perf_counter()
        elif info["generation"] == 2:
            full.append(time.perf_counter() - t0[0])

    sched = engine.scheduler
    added = steps = 0
    gc.callbacks.append(timed)
    try:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            while len(sched.running) + len(sched.waiting) < batch:
                engine.add_request(f"churn-{added}", [rng.randrange(10, 250) for _ in range(
                    rng.randint(16, 128))], SamplingParams(
                        max_tokens=rng.randint(8, 64), temperature=0, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA))
                added += 1
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
    finally:
        gc.callbacks.remove(timed)
    stop_all(engine)
    return {"seconds": wall, "steps": steps, "requests": added, "full_collections": len(full),
            "full_ms": sum(full) * 1e3, "full_max_ms": max(full, default=0.0) * 1e3,
            "full_share": sum(full) / wall}


@contextlib.contextmanager
def _frozen_while_timed() -> Iterator[None]:
    """The collector's frozen heap given back on the way out: the process that ran the
    bench (a test's) collects the engine it built once it is let go."""
    try:
        yield
    finally:
        gc.unfreeze()


def stop_all(engine: Any) -> None:
    """Aborts every request still running or waiting, then runs the engine idle."""
    sched = engine.scheduler
    for req in [*sched.running, *sched.waiting]:
        engine.abort(req.request_id)
    while engine.has_work():
        engine.step()


def build_engine(root: str, args: argparse.Namespace, total_tokens: int) -> Any:
    from bench.engine_bench import build_model
    from engine.llm import LLM

    model_dir, _ = build_model(root, args.hidden_size, args.num_layers, args.vocab_size)
    llm = LLM(model_dir, dtype="float32", block_size=16,
              num_blocks=total_tokens // 16 + 2 * args.batch, max_num_seqs=args.batch,
              max_num_batched_tokens=16384, max_model_len=4096,
              async_scheduling=args.async_scheduling)
    return llm.engine


def run(args: argparse.Namespace) -> int:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before the tokenizer's first use
    import torch

    from engine.gc_heap import freeze_startup_heap
    from engine.sampling_params import RequestOutputKind, SamplingParams

    torch.set_num_threads(1)

    rng = random.Random(args.seed)
    lo, hi = args.input_len
    prompts = [[rng.randrange(10, 250) for _ in range(rng.randint(lo, hi))]
               for _ in range(args.batch)]
    # Each request has its U[MIN, MAX] output tokens still to go when timing starts.
    extra = args.decoded + 2 * args.steps
    outs = [rng.randint(*args.output_len) + extra for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as root, _frozen_while_timed():
        engine = build_engine(root, args, sum(map(len, prompts)) + sum(outs))
        freeze_startup_heap()  # as a worker does once it is up, before its first request
        timer = instrument(engine)
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            # streamed, as a worker serves them: each output carries its step's delta
            engine.add_request(f"r{i}", p, SamplingParams(
                max_tokens=o, temperature=0, ignore_eos=True,
                output_kind=RequestOutputKind.DELTA))
        while engine.scheduler.waiting or any(
                r.num_output_tokens < args.decoded for r in engine.scheduler.running):
            engine.step()  # prefills, then a few decode steps
        decoded = [r.num_output_tokens for r in engine.scheduler.running]
        steps = []
        gct = GCTimer()
        timer.active = gct.active = True
        for _ in range(args.steps):
            timer.seconds = dict.fromkeys(PHASES, 0.0)
            gct.seconds = 0.0
            t0 = CLOCK()
            engine.step()
            steps.append({**timer.seconds, "step": CLOCK() - t0, "gc": gct.seconds})
            assert engine.last_step_tokens == args.batch, "not a full decode step"
        timer.active = gct.active = False
        gct.close()
        churn = {}
        if args.gc_churn > 0:
            stop_all(engine)
            gc.unfreeze()  # the same process, first without the freeze, then with it
            churn["unfrozen"] = gc_churn(engine, args.gc_churn, args.batch, rng)
            freeze_startup_heap()
            churn["frozen"] = gc_churn(engine, args.gc_churn, args.batch, rng)
    # Medians over steps: a step the shared machine slowed down does not move them.
    per_step = {k: statistics.median(s[k] for s in steps) * 1e6 for k in (*PHASES, "step")}
    host = statistics.median((s["step"] - s["forward"]) for s in steps) * 1e6
    per_step["other"] = host - sum(per_step[k] for k in PHASES if k != "forward")
    gc_mean = statistics.fmean(s["gc"] for s in steps) * 1e6
    result = {"summary": {"host_us_per_step": host, "host_us_per_request": host / args.batch,
                          "forward_us_per_step": per_step["forward"],
                          "gc_us_per_step_mean": gc_mean, "gc_full_collections": gct.full,
                          "step_us": per_step["step"],
                          "decoded_at_start": [min(decoded), max(decoded)]},
              "phases_us_per_step": per_step, "gc_churn": churn,
              "config": {k: v for k, v in vars(args).items() if not k.startswith("_")}}
    print(f"batch {args.batch}: host {host:.0f} us/step ({host / args.batch:.2f} us/request), "
          f"forward {per_step['forward']:.0f} us/step")
    print("  " + "  ".join(f"{k} {per_step[k]:.0f}" for k in (*PHASES, "other")))
    print(f"  garbage collector: {gc_mean:.0f} us/step on average (within the phases), "
          f"{gct.full} full collections in {args.steps} steps")
    for name, c in churn.items():
        print(f"  serving {c['requests']} requests for {c['seconds']:.0f} s, start-up heap "
              f"{name}: {c['full_collections']} full collections, {c['full_ms']:.0f} ms in "
              f"all ({c['full_share']:.1%} of the time), the longest {c['full_max_ms']:.0f} ms")
    if len(churn) == 2 and churn["frozen"]["full_ms"] > 0:
        print(f"  full collections' time, unfrozen / frozen: "
              f"{churn['unfrozen']['full_ms'] / churn['frozen']['full_ms']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))


if __name__ == "__main__":
    main()
