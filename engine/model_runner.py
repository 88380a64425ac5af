"""The worker side of the engine: owns the model and the KV cache tensor, turns a
SchedulerOutput into one forward pass, and samples.

A step's inputs are built once on the host and copied to the device in one transfer
(engine.step_inputs); the forward pass has no per-sequence Python (the attention
backend reads the step's metadata tensors). On CUDA, decode-only steps replay CUDA
graphs per batch size (engine.cuda_graphs), mixed and prefill steps up to
max_graph_tokens graphs per token count (engine.mixed_graphs), and the KV pool is sized
from free GPU memory after a profiled forward pass of the largest batch.

With tensor_parallel_size N the runner of rank 0 (the engine's) spawns ranks 1..N-1
(engine/distributed.py); each builds this same runner over its shard of the model
and of the KV cache (its KV heads), and then follows rank 0's commands
(engine/tp_ranks.py): a step's forward, the logits of some rows, block copies, and
on CUDA the KV hand-off's gathers and scatters of whole blocks (engine/runner_staging.py,
whose KVStaging methods the runner has). On CPU each rank's cache is a named shared-memory segment rank 0 maps
(`rank_caches`, engine/rank_segments.py): the hand-off and the tiers move each rank's
heads straight between its cache and the wire.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.async_step import StepLogits, StepTokens, fill_placeholders
from engine.attention import AttentionMetadata, make_backend
from engine.config import EngineConfig, ModelConfig
from engine.input_batch import HOLD_KV, PROMPT_LOGPROBS, InputBatch
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.kv_scales import calibrating, make_kv_scales
from engine.kv_sizing import kv_block_bytes, kv_cache_dtype, kv_cache_shape, num_kv_blocks
from engine.models.loader import TORCH_DTYPES, load_model
from engine.outputs import RankedLogprobs
from engine.rank_segments import RankSegment
from engine.request import Request
from engine.runner_graphs import (
    capture_graph_sets,
    forward_graph,
    graph_pool_bytes,
    make_graph_sets,
)
from engine.runner_staging import KVStaging
from engine.sampler import Logprobs, Sampler, token_logprobs
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_inputs import StepInputBuilder

if TYPE_CHECKING:
    from engine.distributed import TPGroup

log = logging.getLogger(__name__)

Sampled = tuple[int, Logprobs | None]


class ModelRunner(KVStaging):
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig,
                 kv_cache: torch.Tensor | None = None, tp: TPGroup | None = None) -> None:
        """`kv_cache`, if given, is a preallocated block-major tensor (e.g. in shared
        memory for the shm transport); otherwise one is allocated here. `tp`: given to
        ranks 1..N-1 (engine/tp_ranks.py); rank 0 starts the group itself."""
        self.config = config
        self.model_cfg = model_cfg
        size = config.tensor_parallel_size
        self.device = torch.device(config.device)
        if size > 1 and tp is None:
            model_cfg.check_tensor_parallel(size)
            if kv_cache is not None:
                raise ValueError("a preallocated KV cache holds one rank's heads: not with "
                                 "tensor parallelism")
            from engine.distributed import start_group

            if self.device.type == "cuda":  # NCCL's communicator binds the current device
                torch.cuda.set_device(self.device)
            tp = start_group(config, self.device)
            weakref.finalize(self, tp.close)
        self.tp = tp
        self.kv_staging: torch.Tensor | None = None  # see `staging`
        # blocks moved through `staging` (gathers and scatters, for the hand-off and the
        # tiers): the one count, exported as splitserve:kv_staging_blocks_total
        self.staged_blocks = 0
        # Every rank's KV cache, rank 0's own first, where rank 0 can address them (CPU:
        # engine/rank_segments.py); None where it cannot (CUDA: the staging path)
        self.rank_caches: list[torch.Tensor] | None = None
        self._segments: list[RankSegment] = []
        try:
            self._init(config, model_cfg, kv_cache)
        except BaseException:
            if tp is not None and tp.rank == 0:
                tp.close()
            raise

    def _init(self, config: EngineConfig, model_cfg: ModelConfig,
              kv_cache: torch.Tensor | None) -> None:
        tp = self.tp
        if tp is not None:
            from engine.distributed import rank_device, share_cpu_threads

            self.device = rank_device(self.device, tp.rank)
            share_cpu_threads(self.device, tp.size)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
        # Device memory other processes (and this one's CUDA context) held before this
        # runner: not ours, so the profile does not count it against our share.
        self._used_at_start = 0
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self._used_at_start = total - free - torch.cuda.memory_reserved(self.device)
        # this rank's shape: its KV heads size the KV cache
        self.rank_cfg = model_cfg.shard(tp.size) if tp is not None else model_cfg
        self.dtype = TORCH_DTYPES[config.dtype or model_cfg.dtype]
        self.kv_dtype = kv_cache_dtype(config, model_cfg)
        self.block_size = config.cache.block_size
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        self.model = load_model(config.model_dir, model_cfg, self.dtype, self.device,
                                config.load_format, tp=tp)
        self.attention = make_backend(config.backend)
        self.model.set_kernels(self.attention, config.backend == "triton",
                               self.max_model_len)
        self.kv_scales = make_kv_scales(self) if config.fp8_kv else None
        self.inputs = StepInputBuilder(self.block_size, self.device, model_cfg.sliding_window)
        # rank 0: the running requests' step state between steps (engine.input_batch)
        self.batch = InputBatch(config.scheduler.max_num_seqs,
                                cdiv(self.max_model_len, self.block_size))
        self.step_holds_kv = False  # the last step forwarded has a prefill producer
        self.graphs, self.mixed_graphs = make_graph_sets(self)  # (engine.runner_graphs)
        if kv_cache is None:
            kv_cache = self._allocate_kv()
        expected = kv_cache_shape(self.rank_cfg, kv_cache.shape[0], self.block_size)
        if tuple(kv_cache.shape) != expected or kv_cache.dtype != self.kv_dtype:
            raise ValueError(f"kv cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match "
                             f"the model's layout {expected} {self.kv_dtype}")
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.shape[0]
        self._map_rank_caches()
        self.sampler = Sampler(self.device, config.seed)
        if config.tunes_attention and model_cfg.mla is None:
            self._tune_attention()
        capture_graph_sets(self)

    def _tune_attention(self) -> None:
        """Split-K decode's launch configuration per batch shape and the unified
        kernel's per query length, timed on this rank's own cache (engine.attention.
        tuning; reads it only). Runs before any graph is captured, so each graph keeps
        its bucket's choice."""
        from engine.attention.triton_backend import TritonBackend
        from engine.attention.tuning import tune_attention

        if not isinstance(self.attention, TritonBackend):
            return
        tables = tune_attention(
            self.kv_cache[:, 0], self.rank_cfg.num_heads, self.dtype,
            self.model_cfg.sliding_window, self.config.scheduler.max_num_seqs,
            self.max_model_len, self.config.scheduler.max_num_batched_tokens)
        self.attention.decode_table = tables.decode
        self.attention.prefill_table = tables.prefill

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, meta))

    # -- the KV pool ------------------------------------------------------------------
    def close(self) -> None:
        """Stops ranks 1..N-1 under tensor parallelism (rank 0); else nothing."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.close()

    def _tell(self, command: tuple) -> None:
        """Rank 0: a command ranks 1..N-1 run along (engine/tp_ranks.py)."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send(command)

    def _allocate_kv(self) -> torch.Tensor:
        num_blocks = num_kv_blocks(self.config, self.rank_cfg, self.kv_dtype)
        if num_blocks is None:
            budget = self._profile_kv_budget()
            per_block = kv_block_bytes(self.rank_cfg, self.block_size, self.kv_dtype)
            if self.config.kv_staging and self.tp is not None and self.tp.rank == 0:
                per_block += kv_block_bytes(self.model_cfg, self.block_size, self.kv_dtype)
            num_blocks = budget // per_block
            if self.tp is not None:  # every rank's pool has rank 0's block ids: the least
                num_blocks = int(self.tp.all_reduce_min(
                    torch.tensor([num_blocks], device=self.device))[0])
            if num_blocks < cdiv(self.max_model_len, self.block_size):
                raise ValueError(
                    f"{budget / 2**30:.2f} GiB left for the KV cache holds {num_blocks} blocks, "
                    f"fewer than one max_model_len ({self.max_model_len}) request needs; "
                    "raise --gpu-memory-utilization or lower --max-model-len")
            log.info("KV cache: %d blocks (%.2f GiB) from gpu_memory_utilization=%.2f",
                     num_blocks, budget / 2**30, self.config.cache.gpu_memory_utilization)
        shape = kv_cache_shape(self.rank_cfg, num_blocks, self.block_size)
        if self.tp is not None and self.device.type == "cpu":  # zeroed by the kernel
            seg = RankSegment(self.tp.segments[self.tp.rank], shape, self.kv_dtype, True)
            self._segments.append(seg)
            return seg.tensor
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _map_rank_caches(self) -> None:
        """Rank 0 maps every other rank's KV segment once all exist (every rank passes
        here in lockstep: the barrier is a collective)."""
        if self.tp is None:
            self.rank_caches = [self.kv_cache]
            return
        if not self._segments:  # CUDA, or a cache the caller allocated
            return
        self.tp.all_reduce(torch.zeros(1, device=self.device))  # every segment exists
        if self.tp.rank == 0:
            shape, names = tuple(self.kv_cache.shape), self.tp.segments
            self._segments += [RankSegment(n, shape, self.kv_dtype, False) for n in names[1:]]
            self.rank_caches = [s.tensor for s in self._segments]

    @torch.inference_mode()
    def _profile_kv_budget(self) -> int:
        """Bytes the KV pool may take on CUDA: gpu_memory_utilization of the device,
        less the weights, the peak of a forward pass of the largest prefill batch (and
        its logits for max_num_seqs rows), memory outside torch this process took since
        the runner started (what other processes sharing the GPU hold is theirs, not
        counted: each worker's utilization is its own share of the GPU), and the CUDA
        graphs' pool (shared by every graph: estimated by the larger of a decode forward
        of the largest batch bucket and a forward of the largest mixed bucket)."""
        dev = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        sched = self.config.scheduler
        t = min(sched.max_num_batched_tokens, self.max_model_len)
        scratch = torch.zeros(kv_cache_shape(self.rank_cfg, cdiv(t, self.block_size) + 1,
                                             self.block_size), dtype=self.kv_dtype, device=dev)
        self.kv_cache = scratch
        hidden = self.model(*self._dummy_batch(t, 1))
        self.model.compute_logits(hidden[:sched.max_num_seqs]).sort(dim=-1)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        graph_bytes = graph_pool_bytes(self, t)
        del scratch, hidden, self.kv_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(dev)
                        - self._used_at_start)
        budget = int(self.config.cache.gpu_memory_utilization * total - peak - non_torch
                     - graph_bytes)
        log.info("memory profile: peak %.2f GiB, outside torch %.2f GiB, graphs ~%.2f GiB",
                 peak / 2**30, non_torch / 2**30, graph_bytes / 2**30)
        return max(budget, 0)

    def _dummy_batch(self, t: int, b: int,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`b` sequences sharing `t` tokens (all in the first one when b == 1, else one
        each), written to the scratch cache's first blocks (the profile's input)."""
        dev, bs = self.device, self.block_size
        i32: dict = {"dtype": torch.int32, "device": dev}
        q_lens = [t] if b == 1 else [1] * b
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], **i32)
        seq_lens = torch.tensor(q_lens, **i32)
        width = cdiv(max(q_lens), bs)
        tables = torch.arange(width, **i32).repeat(b, 1)
        slots = torch.arange(t, **i32) if b == 1 else torch.zeros(b, **i32)
        meta = AttentionMetadata(
            num_seqs=b, num_tokens=t, slot_mapping=slots, query_start_loc=qsl,
            seq_lens=seq_lens, block_tables=tables, max_query_len=max(q_lens),
            max_seq_len=max(q_lens), query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=q_lens, sliding_window=self.model_cfg.sliding_window)
        positions = torch.arange(t, **i32) if b == 1 else torch.zeros(b, **i32)
        return torch.zeros(len(positions), **i32), positions, self.kv_cache, meta

    # -- a step -------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> Mapping[str, Sampled]:
        """Runs one step; returns {request_id: (token, logprobs)} for requests whose
        computed tokens reach their end this step (partial prefill chunks sample nothing).
        """
        return self.launch(out, kv).result()

    def launch(self, out: SchedulerOutput, kv: KVCacheManager,
               prev: StepTokens | None = None) -> StepTokens:
        """Queues one step on the device and returns its sampled tokens (on the device,
        their copy to the host started). `prev`: the step still in flight, whose sampled
        ids are this step's placeholder inputs (async scheduling), read on the device."""
        return self.sample(self.forward(out, kv, prev), prev)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, kv: KVCacheManager,
                prev: StepTokens | None = None) -> StepLogits:
        """Queues the step's forward pass; returns the logits of its sampling rows."""
        plan = self.batch.plan(out.scheduled, kv)
        self.step_holds_kv = bool(plan.any_flags & HOLD_KV)
        calibrate = self.kv_scales is not None and self.kv_scales.pending
        graphed = None if calibrate else forward_graph(self, plan, prev)
        if graphed is not None:
            return graphed
        step = self.inputs.build_planned(plan, self.batch)
        assert step.rows is not None  # (build_planned sets them)
        fill_placeholders(step, prev)
        if self.tp is not None:
            self.inputs.send(self.tp, step.meta)
        with calibrating(self.kv_scales):  # --calculate-kv-scales: the first one eagerly
            hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
        if plan.any_flags & PROMPT_LOGPROBS:  # most steps: nobody asked
            self._prompt_logprobs(hidden, out.scheduled, step.meta.query_start_loc_cpu)
        if not step.sample_reqs:
            return StepLogits([], hidden[:0], step.rows)
        self._tell(("logits", None))
        return StepLogits(step.sample_reqs, self.model.compute_logits(hidden[step.sample_rows]),
                          step.rows)

    @torch.inference_mode()
    def sample(self, step: StepLogits, prev: StepTokens | None = None) -> StepTokens:
        """Samples a forwarded step (rank 0 only); `prev` as in `launch`."""
        reqs, logits, batch_rows = step.sample_reqs, step.logits, step.rows
        plain = batch_rows.plain
        forks = [] if plain else [_first_forks(r) for r in reqs] if any(
            r.forks for r in reqs) else []
        if not plain:
            batch_rows.batch.refresh_forks(batch_rows.slots)
        if any(forks):
            # Parallel samples draw their first tokens from the one prefill's logits row.
            rows = [i for i, k in enumerate(forks) for _ in range(1 + k)]
            reqs = [x for r, k in zip(reqs, forks, strict=True) for x in (r, *r.forks[:k])]
            logits = logits[torch.tensor(rows, device=logits.device)]
            # each sampling request's row: before its forks'
            batch_rows.index = np.cumsum([0, *(1 + k for k in forks[:-1])])
        pending = prev.pending if prev is not None and not plain else None
        return StepTokens(step.sample_reqs, reqs,
                          self.sampler.sample(logits, reqs, pending, plain), batch_rows)

    def record_kv_ready(self) -> torch.cuda.Event | None:
        """An event on the compute stream after the work queued so far (the step's
        forward, which wrote its KV), for a transfer to wait on without a device-wide
        sync; None on CPU, where the forward is done when `execute` returns."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _prompt_logprobs(self, hidden: torch.Tensor, scheduled: list[ScheduledRequest],
                         query_start_loc: list[int]) -> None:
        """Appends to `prompt_logprobs` of each request that asked, for the prompt tokens
        this step's chunk predicts: position p's logits score prompt token p + 1."""
        if not [s for s in scheduled if s.request.sampling_params.prompt_logprobs is not None]:
            return  # most steps: nobody asked
        rows: list[int] = []
        owners: list[Request] = []
        targets: list[int] = []
        for i, s in enumerate(scheduled):
            r = s.request
            start = r.num_computed_tokens
            if not r.wants_prompt_logprobs or start > len(r.prompt_logprobs):
                continue  # (a gap: prompt KV that came from elsewhere has no logits)
            # | done: len(prompt_logprobs) | this chunk's rest | ... | last prompt token |
            first = len(r.prompt_logprobs)
            last = min(start + s.num_new_tokens, r.num_prompt_tokens - 1)
            rows += [query_start_loc[i] + p - start for p in range(first, last)]
            owners += [r] * max(0, last - first)
            targets += r.prompt_token_ids[first + 1:last + 1]
        if not rows:
            return
        self._tell(("logits", rows))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        ids = torch.tensor(targets, device=logits.device)
        _, lps = token_logprobs(logits, ids, [r.sampling_params.prompt_logprobs
                                              for r in owners])
        logp = logits.log_softmax(dim=-1)
        ranks = (logp >= logp.gather(1, ids.unsqueeze(1))).sum(dim=1).tolist()
        for r, lp, rank in zip(owners, lps, ranks, strict=True):
            assert lp is not None
            r.prompt_logprobs.append(RankedLogprobs(lp, rank))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """KV block copies (source, destination), e.g. a forked sample's partial block."""
        if pairs:
            self._tell(("copy", pairs))
            src, dst = zip(*pairs, strict=True)
            self.kv_cache[list(dst)] = self.kv_cache[list(src)]


def _first_forks(r: Request) -> int:
    """How many forks draw their first token from `r`'s row this step: all of them on
    its first sample; none while that sample is in flight (async scheduling: the forks
    start when the host has it)."""
    return 0 if r.num_output_placeholders else len(r.forks)

