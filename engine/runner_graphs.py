"""The model runner's CUDA graphs: which graph sets it makes, their capture in lockstep,
the memory their pool takes, and a step through them.

Two sets: decode graphs per batch size (engine/cuda_graphs.py) and mixed graphs per token
count (engine/mixed_graphs.py). Each is captured on CUDA with a graph-safe attention
backend (`EngineConfig.graph_safe_backend`), or made without capture where the config
asks for the padded path (`padded_decode`, `padded_mixed`: CPU, tests). MLA models
capture both: their mixed graphs attend in the latent space (the absorbed kernel of
engine.attention.triton_mla) where that costs no more than decompressing
(engine.attention.mla.absorbed_is_cheaper); their eager steps (those, past the largest
bucket, or wanting prompt logprobs) decompress K/V per sequence.

The graphs call back into the runner that owns them through a weak reference: a cycle
would keep a dropped engine's KV cache, weights and graph pool on the GPU until the
cycle collector happened to run.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.async_step import StepLogits, StepTokens, fill_placeholders
from engine.attention.base import AttentionMetadata
from engine.attention.mla import absorbed_is_cheaper
from engine.cuda_graphs import DecodeGraphs
from engine.input_batch import PROMPT_LOGPROBS, StepPlan
from engine.kv_cache_manager import cdiv
from engine.mixed_graphs import MixedGraphs

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


def _alive(runner: weakref.ref[ModelRunner]) -> ModelRunner:
    owner = runner()
    if owner is None:
        raise RuntimeError("the model runner that owned these CUDA graphs is gone")
    return owner


def make_graph_sets(runner: ModelRunner) -> tuple[DecodeGraphs | None, MixedGraphs | None]:
    """The runner's (decode graphs, mixed graphs), each None where the config has none."""
    config = runner.config
    decode = None
    if config.use_cuda_graphs or config.padded_decode:
        decode = make_decode_graphs(runner, capture=config.use_cuda_graphs)
    mixed = None
    if config.use_mixed_graphs or (config.padded_mixed and config.max_graph_tokens > 0):
        mixed = make_mixed_graphs(runner, config.use_mixed_graphs,
                                  fixed_meta=config.graph_safe_backend)
    return decode, mixed


def make_decode_graphs(runner: ModelRunner, capture: bool) -> DecodeGraphs:
    owner = weakref.ref(runner)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return _alive(owner)._forward_logits(input_ids, positions, meta)

    return DecodeGraphs(forward, runner.config.scheduler.max_num_seqs,
                        cdiv(runner.max_model_len, runner.block_size), runner.device,
                        runner.model_cfg.sliding_window, capture=capture, tp=runner.tp,
                        max_seq_len=runner.max_model_len)


def make_mixed_graphs(runner: ModelRunner, capture: bool, fixed_meta: bool) -> MixedGraphs:
    owner = weakref.ref(runner)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor, out: torch.Tensor) -> None:
        r = _alive(owner)
        hidden = r.model(input_ids, positions, r.kv_cache, meta)
        r.model.compute_logits(hidden[rows], out=out)

    config, cfg = runner.config, runner.model_cfg
    sched = config.scheduler
    mla = cfg.mla
    return MixedGraphs(
        forward, min(config.max_graph_tokens, sched.max_num_batched_tokens),
        sched.max_num_seqs, cdiv(runner.max_model_len, runner.block_size), cfg.vocab_size,
        runner.device, cfg.sliding_window, runner.max_model_len, capture=capture,
        fixed_meta=fixed_meta, tp=runner.tp,
        takes_runs=None if mla is None else lambda runs: absorbed_is_cheaper(runs, mla))


def capture_graph_sets(runner: ModelRunner) -> None:
    """Every rank here, in the same order (lockstep): the mixed graphs, then the decode
    graphs, in one shared pool (the largest forward pass first)."""
    sets = [g for g in (runner.mixed_graphs, runner.graphs) if g is not None]
    if not sets:
        return
    pool = torch.cuda.graph_pool_handle() if any(g.capture_enabled for g in sets) else None
    with torch.inference_mode():
        for g in sets:
            g.capture(pool)


def graph_pool_bytes(runner: ModelRunner, max_tokens: int,
                     measure: Callable[[Callable[[], object]], int] | None = None) -> int:
    """The graphs' shared pool, estimated on CUDA by the larger of the forwards the
    graphs capture: a decode forward of the largest batch bucket (logits for every row:
    each is sampled) and the mixed graphs' own forward of their largest bucket (at most
    `max_tokens`, what the profile's scratch cache holds), whose logits are its S sampled
    rows only, written into the static buffer the graphs share (allocated outside the
    pool). 0 without graphs. `measure(fn)`: the peak bytes `fn` allocates (default: the
    CUDA allocator's peak; tests pass their own)."""
    measure = measure or _cuda_peak_bytes(runner.device)
    need = 0
    if runner.graphs is not None:
        b = runner.graphs.max_batch
        ids, pos, _, meta = runner._dummy_batch(b, b)
        need = measure(lambda: runner._forward_logits(ids, pos, meta))
    mixed = runner.mixed_graphs
    if mixed is not None:
        t = min(mixed.max_tokens, max_tokens)
        s = mixed.pad(t)[2]
        ids, pos, _, meta = runner._dummy_batch(t, 1)
        meta.graph_bucket = mixed.fixed_meta  # the path a capture records (MLA: absorbed)
        rows = torch.zeros(s, dtype=torch.int32, device=runner.device)
        need = max(need, measure(lambda: mixed.forward(ids, pos, meta, rows,
                                                       mixed.logits[:s])))
    return need


def _cuda_peak_bytes(dev: torch.device) -> Callable[[Callable[[], object]], int]:
    def measure(fn: Callable[[], object]) -> int:
        """Peak bytes allocated while `fn` runs, above what was allocated before."""
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base

    return measure


def forward_graph(runner: ModelRunner, plan: StepPlan,
                  prev: StepTokens | None) -> StepLogits | None:
    """A decode-only step through the decode graphs, another step that fits a mixed
    graph through those (padded to the graph's shape, built into its buffer); None when
    neither takes it (the step runs eagerly)."""
    graphs: DecodeGraphs | MixedGraphs | None = None
    size = runner.graphs.bucket_for_plan(plan) if runner.graphs is not None else None
    if size is not None:
        graphs, kind = runner.graphs, "decode"
    elif runner.mixed_graphs is not None:
        size = runner.mixed_graphs.bucket_for_plan(
            plan, bool(plan.any_flags & PROMPT_LOGPROBS))
        graphs, kind = runner.mixed_graphs, "mixed"
    if graphs is None or size is None:
        return None
    step = runner.inputs.build_planned(plan, runner.batch, pad=graphs.pad(size),
                                       width=graphs.width, out=graphs.buffer)
    assert step.rows is not None  # (build_planned sets them)
    fill_placeholders(step, prev)
    if runner.tp is not None:  # the other ranks replay the same graph
        runner.inputs.send(runner.tp, step.meta, (kind, size))
    logits = graphs.run(size, step)
    return StepLogits(step.sample_reqs, logits[:len(step.sample_reqs)], step.rows)
