"""CUDA graphs for decode-only steps.

On a slow host one eager kernel launch costs tens of microseconds, so a decode step of
a 32-layer model (hundreds of kernels) is bound by Python and launches, not by the
GPU. At start-up we capture the whole forward pass (embedding -> logits) once per
batch-size bucket; a decode-only step of B sequences is padded to the smallest bucket
>= B (padding rows: slot -1, seq_len 0) and replayed. Prefill and mixed steps run
eagerly.

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
    from engine.distributed import TPGroup

log = logging.getLogger(__name__)

# (input_ids, positions, meta) -> logits [T, V] float32
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, 8, then every 8 up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


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

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

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

    def capture(self) -> None:
        """Captures every bucket, largest first so the smaller ones reuse its pool."""
        if self.tp is not None:
            self._check_ranks_agree()
        if not self.capture_enabled:
            return
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_reserved(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                self._fill_padding(b)
                ids, pos, meta = self._inputs(b)
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    self.forward(ids, pos, meta)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: the NCCL watchdog thread queries events meanwhile, which
                # a global-mode capture would take for an unsafe call of its own
                mode = "global" if self.tp is None else "thread_local"
                with torch.cuda.graph(graph, pool=pool, stream=stream,
                                      capture_error_mode=mode):
                    self._outputs[b] = self.forward(ids, pos, meta)
                self._graphs[b] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("captured CUDA graphs for decode batch sizes %s (%.1f MiB)%s",
                 self.buckets, self.memory_bytes / 2**20,
                 "" if self.tp is None else f" on tensor-parallel rank {self.tp.rank}")

    def _check_ranks_agree(self) -> None:
        """Every rank has the same buckets and buffer layout (a rank replaying another
        graph than its peers would pair their collectives wrongly: a hang, or garbage)."""
        assert self.tp is not None
        mine = [len(self.buckets), sum(self.buckets), self.max_batch, self.width]
        low = self.tp.all_reduce_min(torch.tensor(mine, device=self.device))
        high = self.tp.all_reduce_min(-torch.tensor(mine, device=self.device))
        if low.tolist() != mine or (-high).tolist() != mine:
            raise RuntimeError(f"tensor-parallel rank {self.tp.rank}: decode graph buckets "
                               f"{self.buckets} (width {self.width}) differ from a peer's")

    def run(self, b: int, step: StepInputs) -> torch.Tensor:
        """Runs bucket `b` on `step`, which the step builder laid out in `buffer`
        (padded to `b`); returns the logits of all `b` rows (the caller keeps the real
        ones)."""
        graph = self._graphs.get(b)
        if graph is None:  # capture disabled: the same fixed-address inputs, eagerly
            return self.forward(step.input_ids, step.positions, step.meta)
        graph.replay()
        if self.tp is not None:
            self.tp.sync("a decode graph's replay")
        return self._outputs[b]
