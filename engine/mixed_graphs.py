"""CUDA graphs for mixed and prefill steps: one full graph per token-count bucket (as
vLLM v1 captures its unified-attention steps).

A step that is not decode-only (those replay engine/cuda_graphs.py's graphs) and has at
most `max_graph_tokens` tokens is padded to the smallest bucket T >= its token count and
replays the forward pass captured for T at start-up, embedding to logits. Steps with more
tokens, and steps whose requests want prompt logprobs (logits of arbitrary rows), run
eagerly.

Bucket T's inputs have fixed shapes and addresses: one int32 buffer laid out as
`engine.step_inputs` draws it, for T tokens, B = min(T, max_num_seqs) + 1 sequences, W
block-table columns (the model's length) and S = B - 1 sampled rows:

    # tokens:    | real (t) | padding (T - t): id 0, position 0, slot -1 |
    # sequences: | real (n) | padding (B - n): seq_len 0, owning the padding tokens |
    # samples:   | real (s) | padding (S - s): row 0 |

A padding token writes no KV (slot -1: the KV-write kernels skip it) and belongs to a
sequence without context (seq_len 0: attention writes zeros for its rows); the rest of
the model is row-wise, so padding never reaches a real row. B leaves one sequence more
than a step can schedule, so the padding tokens always have an owner and
`query_start_loc[B] == T` in every step.

Attention reads the step from device tensors only. The Triton unified kernel's grid,
(T // BLOCK_Q + B, kv_heads), and its tiles (BLOCK_M from max_query_len, bound at T)
follow from the bucket alone; the metadata's host-side fields are the bucket's
constants (max_seq_len the model's length, query_start_loc ending at T) and say so
(`graph_bucket`). MLA models (DeepSeek) attend in the latent space there: the Triton
MLA backend runs every token of a bucket, decode rows and prefill chunks alike, through
one absorbed kernel on the grid (T // BLOCK_Q + B, head tiles)
(engine.attention.triton_mla). Their steps that cost fewer multiply-adds decompressed
(`takes_runs`: fresh prompts) and their larger steps run eagerly and decompress K/V per
sequence on host-side lengths. A backend that needs each step's real host-side lists
(the torch reference) is not graph-safe: the runner captures no mixed graphs for it
(`EngineConfig.graph_safe_backend`).

Logits: the graph gathers the S sampled rows' hidden states and writes their logits
into one static buffer [S of the largest bucket, vocab] that every bucket shares; the
caller keeps the real rows. The graphs share one private memory pool with the decode
graphs, captured largest first, so the pool holds about one forward pass of the largest
bucket.

With `capture=False` (CPU, tests) the same padded fixed-address inputs run eagerly:
everything but the capture. With `fixed_meta` (a graph-safe backend) the forward then
reads the bucket's constant metadata, exactly what a capture records; without it, the
step's own (the padded step with its real host-side lists, which the torch backend reads).

Under tensor parallelism, as the decode graphs: every rank captures the same buckets in
the same order at start-up, rank 0 names the bucket with each step, and the collectives
(the logits' gather included) are captured inside.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionMetadata
from engine.cuda_graphs import capture_graphs, check_ranks_agree
from engine.step_inputs import StepInputs, layout_size, views

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as PoolHandle

    from engine.distributed import TPGroup
    from engine.input_batch import StepPlan

log = logging.getLogger(__name__)

# (input_ids, positions, meta, sample_rows, out): writes the sampled rows' float32
# logits into `out` [S, V]
MixedForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor,
                         torch.Tensor], None]


def token_buckets(max_tokens: int) -> list[int]:
    """vLLM's capture sizes up to `max_tokens`: 1, 2, 4, every 8 to 256, every 16 above,
    and `max_tokens` itself; none for 0."""
    if max_tokens <= 0:
        return []
    sizes = [s for s in (1, 2, 4) if s < max_tokens]
    sizes += list(range(8, min(256, max_tokens), 8)) + list(range(256, max_tokens, 16))
    return sorted({*sizes, max_tokens})


class MixedGraphs:
    """One captured forward per token bucket (see the module docstring)."""

    def __init__(self, forward: MixedForward, max_tokens: int, max_num_seqs: int,
                 width: int, vocab_size: int, device: torch.device,
                 sliding_window: int | None, max_seq_len: int, capture: bool = True,
                 fixed_meta: bool = True, tp: TPGroup | None = None,
                 takes_runs: Callable[[list[tuple[int, int]]], bool] | None = None) -> None:
        self.forward = forward
        # MLA: whether a step's runs (new queries, keys per sequence) are cheaper in
        # the graphs' absorbed form than decompressed eagerly (mla.absorbed_is_cheaper)
        self.takes_runs = takes_runs
        self.buckets = token_buckets(max_tokens)
        if not self.buckets:
            raise ValueError("mixed graphs need max_graph_tokens > 0")
        self.max_num_seqs = max_num_seqs
        self.width = width
        self.device = device
        self.sliding_window = sliding_window
        self.max_seq_len = max_seq_len
        self.capture_enabled = capture
        self.fixed_meta = fixed_meta
        self.tp = tp
        t, b, s = self.pad(self.max_tokens)
        self.buffer = torch.zeros(layout_size(t, b, width, s), dtype=torch.int32,
                                  device=device)
        self.logits = torch.zeros((s, vocab_size), dtype=torch.float32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_bytes = 0  # what the pool grew by at capture
        self.replays = 0

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def pad(self, t: int) -> tuple[int, int, int]:
        """Bucket `t`'s step shape: (tokens, sequences, sampled rows)."""
        s = min(t, self.max_num_seqs)
        return t, s + 1, s

    def bucket_for_plan(self, plan: StepPlan, prompt_logprobs: bool) -> int | None:
        """The bucket for this step, or None: it runs eagerly (too many tokens, a
        request wants prompt logprobs, which need the logits of rows not sampled, or an
        MLA step's runs cost less decompressed). `prompt_logprobs`: a row's request
        asked for prompt logprobs (the plan's flags)."""
        if len(plan.slots) > self.max_num_seqs or (prompt_logprobs and any(
                s.request.wants_prompt_logprobs for s in plan.scheduled)):
            return None
        if self.takes_runs is not None and not self.takes_runs(
                list(zip(plan.q_lens.tolist(), plan.ends.tolist(), strict=True))):
            return None
        tokens = int(plan.q_lens.sum())
        return next((t for t in self.buckets if t >= tokens), None)

    def _views(self, t: int) -> tuple[torch.Tensor, ...]:
        tt, b, s = self.pad(t)
        return views(self.buffer, tt, b, self.width, s)

    def _meta(self, t: int) -> AttentionMetadata:
        """Bucket `t`'s metadata: device views of the buffer, host fields constant."""
        _, b, _ = self.pad(t)
        _, _, slots, qsl, seq_lens, tables, _ = self._views(t)
        return AttentionMetadata(
            num_seqs=b, num_tokens=t, slot_mapping=slots, query_start_loc=qsl,
            seq_lens=seq_lens, block_tables=tables, max_query_len=t,
            max_seq_len=self.max_seq_len, query_start_loc_cpu=[0] + [t] * b,
            seq_lens_cpu=[0] * b, sliding_window=self.sliding_window, graph_bucket=True)

    def _fill_padding(self, t: int) -> None:
        """Every token a padding token of the first padding sequence: what capture
        records must not touch the cache."""
        ids, pos, slots, qsl, seq_lens, tables, rows = self._views(t)
        ids.zero_(), pos.zero_(), slots.fill_(-1), seq_lens.zero_(), tables.zero_()
        rows.zero_(), qsl.fill_(t), qsl[0].zero_()

    def capture(self, pool: PoolHandle | None = None) -> None:
        """Captures every bucket (in `pool`, shared with the decode graphs if given)."""
        if self.tp is not None:
            check_ranks_agree(self.tp, self.device,
                              [len(self.buckets), sum(self.buckets), self.max_tokens,
                               self.width, self.max_num_seqs],
                              f"mixed graph buckets {self.buckets} (width {self.width})")
        if not self.capture_enabled:
            return

        def prepare(t: int) -> Callable[[], torch.Tensor]:
            self._fill_padding(t)
            ids, pos, *_, rows = self._views(t)
            meta, out = self._meta(t), self.logits[:self.pad(t)[2]]

            def run() -> torch.Tensor:
                self.forward(ids, pos, meta, rows, out)
                return out

            return run

        self._graphs, _, self.memory_bytes = capture_graphs(
            self.buckets, prepare, self.device, self.tp, pool)
        log.info("captured CUDA graphs for mixed steps of %s tokens (%.1f MiB)%s",
                 self.buckets, self.memory_bytes / 2**20,
                 "" if self.tp is None else f" on tensor-parallel rank {self.tp.rank}")

    def run(self, t: int, step: StepInputs) -> torch.Tensor:
        """Runs bucket `t` on `step`, which the step builder laid out in `buffer` (padded
        to `pad(t)`); returns the static logits of its S sampled rows (the real ones
        first; valid until the next graph step)."""
        out = self.logits[:self.pad(t)[2]]
        graph = self._graphs.get(t)
        if graph is None:  # capture disabled: the same fixed-address inputs, eagerly
            meta = self._meta(t) if self.fixed_meta else step.meta
            self.forward(step.input_ids, step.positions, meta, step.sample_rows, out)
            return out
        graph.replay()
        self.replays += 1
        if self.tp is not None:
            self.tp.sync("a mixed graph's replay")
        return out
