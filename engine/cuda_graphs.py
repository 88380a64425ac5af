"""CUDA graphs for decode-only steps.

On a slow host one eager kernel launch costs tens of microseconds, so a decode step of
a 32-layer model (hundreds of kernels) is bound by Python and launches, not by the
GPU. At start-up we capture the whole forward pass (embedding -> logits) once per
batch-size bucket; a decode-only step of B sequences is padded to the smallest bucket
>= B (padding rows: slot -1, seq_len 0) and replayed. Prefill and mixed steps replay
graphs of their own (engine/mixed_graphs.py) or run eagerly. Only a graph-safe attention
backend is captured (`EngineConfig.graph_safe_backend`: the Triton kernels).

Graph inputs live at fixed addresses: one int32 buffer laid out as
`engine.step_inputs` draws it for (T = B = bucket, W = the widest block table), which
the step builder fills with one host->device copy before each replay.

Under tensor parallelism every rank captures the same buckets, in the same order, at
start-up (each runner's construction; the warm-up forwards' collectives keep them in
lockstep), and the all-reduces and the logits' all-gather are captured inside the
graphs (NCCL supports capture; its non-blocking `wait` only orders streams). Per step
rank 0 broadcasts the padded buffer and names the bucket; every rank replays that one
graph. A replay's collectives run outside the NCCL watchdog, so the host waits for a
replay at most the collective timeout (`TPGroup.sync`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionMetadata
from engine.step_inputs import StepInputs, layout_size, views

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as PoolHandle

    from engine.distributed import TPGroup
    from engine.input_batch import StepPlan

log = logging.getLogger(__name__)

# (input_ids, positions, meta) -> logits [T, V] float32
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, 8, then every 8 up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


def capture_graphs(sizes: list[int], prepare: Callable[[int], Callable[[], torch.Tensor]],
                   device: torch.device, tp: TPGroup | None, pool: PoolHandle | None,
                   ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor], int]:
    """Captures `prepare(size)()` per size, largest first so the smaller ones reuse its
    memory, in `pool` (one the caller shares between graph sets, else a new one).
    Returns (graphs, their outputs, bytes the pool grew by)."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    before = torch.cuda.memory_reserved(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    with torch.cuda.stream(stream):
        for size in sorted(sizes, reverse=True):
            run = prepare(size)
            for _ in range(2):  # warm-up: Triton compiles, allocator settles
                run()
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the NCCL watchdog thread queries events meanwhile, which
            # a global-mode capture would take for an unsafe call of its own
            mode = "global" if tp is None else "thread_local"
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
                outputs[size] = run()
            graphs[size] = graph
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graphs, outputs, torch.cuda.memory_reserved(device) - before


def check_ranks_agree(tp: TPGroup, device: torch.device, mine: list[int], what: str) -> None:
    """Raises unless every rank's `mine` (a graph set's buckets and buffer layout) is
    the same: a rank replaying another graph than its peers would pair their
    collectives wrongly (a hang, or garbage)."""
    low = tp.all_reduce_min(torch.tensor(mine, device=device))
    high = tp.all_reduce_min(-torch.tensor(mine, device=device))
    if low.tolist() != mine or (-high).tolist() != mine:
        raise RuntimeError(f"tensor-parallel rank {tp.rank}: {what} differ from a peer's")


class DecodeGraphs:
    """One captured forward per bucket. With `capture=False` (CPU, tests) the same
    padded, fixed-address inputs run eagerly: everything but the capture itself."""

    def __init__(self, forward: Forward, max_num_seqs: int, width: int,
                 device: torch.device, sliding_window: int | None,
                 capture: bool = True, tp: TPGroup | None = None,
                 max_seq_len: int | None = None) -> None:
        """`max_seq_len`: the longest sequence the graphs serve (their metadata's
        bound, which picks the attention backend's tiles); None: `width`."""
        self.forward = forward
        self.tp = tp
        self.buckets = bucket_sizes(max_num_seqs)
        self.width = width
        self.max_seq_len = width if max_seq_len is None else max_seq_len
        self.device = device
        self.sliding_window = sliding_window
        self.capture_enabled = capture
        top = self.buckets[-1]
        self.buffer = torch.zeros(layout_size(top, top, width, top), dtype=torch.int32,
                                  device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0  # the graphs' private pool, measured at capture
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def pad(self, b: int) -> tuple[int, int, int]:
        """Bucket `b`'s step shape: (tokens, sequences, sampled rows)."""
        return b, b, b

    def bucket_for_plan(self, plan: StepPlan) -> int | None:
        """The bucket for a decode-only step (every sequence computes its one newest
        token and samples), else None."""
        if len(plan.slots) > self.max_batch or not (plan.q_lens == 1).all() \
                or not (plan.starts + 1 == plan.known + plan.pending).all():
            return None
        return self.bucket_for(len(plan.slots))

    def _inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, pos, slots, qsl, seq_lens, tables, _ = views(self.buffer, b, b, self.width, b)
        meta = AttentionMetadata(
            num_seqs=b, num_tokens=b, slot_mapping=slots, query_start_loc=qsl,
            seq_lens=seq_lens, block_tables=tables, max_query_len=1,
            max_seq_len=self.max_seq_len, query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[0] * b, sliding_window=self.sliding_window)
        return ids, pos, meta

    def _fill_padding(self, b: int) -> None:
        """Every row a padding row: what capture records must not touch the cache."""
        ids, pos, slots, qsl, seq_lens, tables, _ = views(self.buffer, b, b, self.width, b)
        ids.zero_(), pos.zero_(), slots.fill_(-1), seq_lens.zero_(), tables.zero_()
        qsl.copy_(torch.arange(b + 1, dtype=torch.int32, device=self.device))

    def capture(self, pool: PoolHandle | None = None) -> None:
        """Captures every bucket (in `pool`, shared with the mixed graphs if given)."""
        if self.tp is not None:
            check_ranks_agree(self.tp, self.device, [len(self.buckets), sum(self.buckets),
                                                     self.max_batch, self.width],
                              f"decode graph buckets {self.buckets} (width {self.width})")
        if not self.capture_enabled:
            return

        def prepare(b: int) -> Callable[[], torch.Tensor]:
            self._fill_padding(b)
            ids, pos, meta = self._inputs(b)
            return lambda: self.forward(ids, pos, meta)

        self._graphs, self._outputs, self.memory_bytes = capture_graphs(
            self.buckets, prepare, self.device, self.tp, pool)
        log.info("captured CUDA graphs for decode batch sizes %s (%.1f MiB)%s",
                 self.buckets, self.memory_bytes / 2**20,
                 "" if self.tp is None else f" on tensor-parallel rank {self.tp.rank}")

    def run(self, b: int, step: StepInputs) -> torch.Tensor:
        """Runs bucket `b` on `step`, which the step builder laid out in `buffer`
        (padded to `b`); returns the logits of all `b` rows (the caller keeps the real
        ones)."""
        graph = self._graphs.get(b)
        if graph is None:  # capture disabled: the same fixed-address inputs, eagerly
            return self.forward(step.input_ids, step.positions, step.meta)
        graph.replay()
        self.replays += 1
        if self.tp is not None:
            self.tp.sync("a decode graph's replay")
        return self._outputs[b]
