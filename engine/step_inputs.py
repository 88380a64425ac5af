"""One step's model inputs and attention metadata, built on the host with numpy and
copied to the device in ONE transfer.

Every integer a step needs (token ids, positions, slots, query offsets, sequence
lengths, block tables, rows to sample) goes into one int32 staging buffer (pinned on
CUDA) with this layout, for T tokens, B sequences, W block-table columns, S sampled
rows:

    # | input_ids T | positions T | slot_mapping T | query_start_loc B+1 | seq_lens B |
    # | block_tables B*W | sample_rows S |     (each section 16-byte aligned)

and one `copy_` moves it into a device buffer whose views the forward pass reads
(under tensor parallelism, one broadcast of that buffer gives every rank the step). A
step replayed from a CUDA graph (engine/cuda_graphs.py for decode-only steps,
engine/mixed_graphs.py for the others) is built the same way, padded to the graph's
shape, straight into the graph's own input buffer (fixed addresses):

    # | real tokens | padding tokens: id 0, position 0, slot -1 (no KV written) |
    # | real sequences | padding sequences: seq_len 0 (zero output), owning the
    #                    padding tokens: one each, the last one the rest |
    # | real sampled rows | padding rows: row 0 |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.input_batch import BatchRows, InputBatch, StepPlan
from engine.kv_cache_manager import cdiv
from engine.request import Request

if TYPE_CHECKING:
    from engine.distributed import TPGroup


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int32 rows of the flat batch whose logits are sampled
    sample_reqs: list[Request]  # the request of each sampled row
    # Async scheduling: (indices in input_ids, slots, their generations) of the tokens
    # a step still in flight is sampling; their ids are filled in on the device
    # (engine/async_step.py). And the batch rows of the sampled rows (`build_planned`
    # sets them; a step received by ranks 1..N-1 has none).
    in_flight: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    rows: BatchRows | None = None


# Each section starts 16 bytes (4 int32) into alignment: Triton specializes a kernel on
# whether each pointer argument is 16-byte aligned, so sections whose offsets followed
# the step's token and sequence counts would compile a new variant of the attention,
# KV-write and rotary kernels for each new pattern of counts (a cold compile takes
# seconds, mid-serving).
_ALIGN = 4


def _starts(t: int, b: int, w: int, s: int) -> tuple[list[int], list[int], int]:
    """(each section's start, its size, the layout's size) in int32 elements."""
    sizes = [t, t, t, b + 1, b, b * w, s]
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += -(-n // _ALIGN) * _ALIGN
    return starts, sizes, at


def layout_size(t: int, b: int, w: int, s: int) -> int:
    return _starts(t, b, w, s)[2]


def views(buf: torch.Tensor, t: int, b: int, w: int, s: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, positions, slots, query_start_loc, seq_lens, block_tables, sample_rows)
    as views of `buf` laid out as the module docstring draws, each section 16-byte
    aligned where `buf` is (`_ALIGN`; the gaps between sections are never read)."""
    starts, sizes, total = _starts(t, b, w, s)
    if buf.numel() < total:
        raise ValueError(f"a step of ({t}, {b}, {w}, {s}) needs {total} int32, the buffer "
                         f"holds {buf.numel()}")
    parts = [buf[at:at + n] for at, n in zip(starts, sizes, strict=True)]
    parts[5] = parts[5].view(b, w)
    return tuple(parts)


class StepInputBuilder:
    """Owns the staging (host) and input (device) buffers; `build_planned` fills them."""

    def __init__(self, block_size: int, device: torch.device,
                 sliding_window: int | None) -> None:
        self.block_size = block_size
        self.device = device
        self.sliding_window = sliding_window
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=device)
        # The staging buffer is reused: its last async copy must be done before refill.
        self._copied: torch.cuda.Event | None = None
        # The last build's device buffer, its used length and (t, b, w, s).
        self._last: tuple[torch.Tensor, int, tuple[int, int, int, int]] | None = None

    def _reserve(self, n: int) -> None:
        if self._host.numel() >= n:
            return
        n = max(n, 2 * self._host.numel())
        pin = self.device.type == "cuda"
        # (zeros: the gaps between aligned sections travel too, never read)
        self._host = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        # On CPU the forward pass reads the staging buffer itself: no copy at all.
        self._dev = self._host if self.device.type == "cpu" else torch.empty(
            n, dtype=torch.int32, device=self.device)

    def build_planned(self, plan: StepPlan, batch: InputBatch,
                      pad: tuple[int, int, int] | None = None, width: int | None = None,
                      out: torch.Tensor | None = None) -> StepInputs:
        """Lays out the step `plan`ned from the persistent batch (engine/input_batch.py),
        gathered from the batch's arrays by slot, and copies it to the device. Only rows
        that are neither a decode of the newest known token nor of a token in flight
        (prompt chunks, recomputes) read their request's token list.

        `pad` (a CUDA graph's shape: tokens, sequences, sampled rows) pads the step to
        it as the module docstring draws; `width` fixes the block-table width; `out` is
        the device buffer to fill (a CUDA graph's), else our own.
        """
        q, lo, known, slots = plan.q_lens, plan.starts, plan.known, plan.slots
        d = known - lo  # | computed | d known tokens to compute | (in flight) |
        samples: np.ndarray | None
        in_flight: np.ndarray | None
        if plan.decode and int(d.max()) <= 1:
            # Decode: each row computes its newest token (d = 1) or the one in flight
            # (d = 0), and samples.
            samples = None
            in_flight = np.flatnonzero(d == 0) if int(d.min()) == 0 else None
            others: list[int] = []
        else:
            hi = lo + q
            samples = np.flatnonzero(hi == known + plan.pending)
            ph = np.flatnonzero(hi > known)  # rows whose last token is in flight
            in_flight = ph if len(ph) else None
            others = np.flatnonzero((q != 1) | (d > 1)).tolist()

        def fill(ids: np.ndarray, tables: np.ndarray, qsl: np.ndarray,
                 need: np.ndarray) -> None:
            n_real = len(q)
            if plan.decode and not others:  # the newest token, or 0 for one in flight
                ids[:n_real] = plan.newest * (d == 1)
            else:
                ids[:qsl[n_real]] = 0
                newest = (q == 1) & (d == 1)
                ids[qsl[:n_real][newest]] = plan.newest[newest]
            for i in others:  # | known tokens | the token in flight, if any |
                r = plan.scheduled[i].request
                a, b = int(lo[i]), int(min(lo[i] + q[i], known[i]))
                ids[qsl[i]:qsl[i] + b - a] = r.all_token_ids[a:b]
            # The batch's rows are zero past their blocks: padding rows and columns
            # past the step's widest row are the only ones to clear.
            w = int(need.max())
            if len(tables) > n_real:
                tables[n_real:] = 0
            if tables.shape[1] > w:
                tables[:n_real, w:] = 0
            part = tables[:n_real, :w]
            part[...] = batch.tables[slots, :w]
            over = np.flatnonzero(plan.num_blocks > need)
            if len(over):  # blocks past this step's tokens (a prompt's later chunks)
                part[over[:, None], np.arange(w)] *= np.arange(w) < need[over, None]

        step = self._lay_out(q, lo, samples, fill, pad, width, out)
        step.rows = batch.rows(plan, samples)
        step.sample_reqs = batch.reqs[step.rows.slots].tolist()
        if in_flight is not None:  # (flat index, slot, generation) of each token in flight
            at = in_flight if plan.decode else np.cumsum(q)[in_flight] - 1
            step.in_flight = (at, slots[in_flight], plan.gens[in_flight])
        return step

    def _lay_out(self, q_lens: np.ndarray, starts: np.ndarray, samples: np.ndarray | None,
                 fill: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None],
                 pad: tuple[int, int, int] | None, width: int | None,
                 out: torch.Tensor | None) -> StepInputs:
        """The step's layout (module docstring) in the staging buffer, `fill` writing
        the real token ids and block tables; then its copy to `out` or our buffer.
        `samples`: the rows that sample (None: every one)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        bs = self.block_size
        ends = starts + q_lens
        n_real, t_real = len(q_lens), int(q_lens.sum())
        s_real = n_real if samples is None else len(samples)
        w = width or max(1, cdiv(int(ends.max()), bs))
        t, b, s = pad or (t_real, n_real, s_real)
        if t < t_real or b < n_real or s < s_real or (t > t_real and b == n_real):
            raise ValueError(f"a step of {t_real} tokens, {n_real} sequences and "
                             f"{s_real} sampled rows does not pad to {pad}")
        self._reserve(layout_size(t, b, w, s))
        host = views(self._host, t, b, w, s)
        ids, pos, slots, qsl, seq_lens, tables, rows = (v.numpy() for v in host)
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1:n_real + 1])
        if b > n_real:
            qsl[n_real + 1:] = np.minimum(t_real + np.arange(1, b - n_real + 1), t)
            qsl[b] = t
        seq_lens[:n_real] = ends
        if b > n_real:
            seq_lens[n_real:] = 0
        fill(ids, tables, qsl, (ends + bs - 1) // bs)
        if t_real == n_real:  # one token each (decode): its position is `starts`
            seq_of, p = np.arange(n_real), starts
        else:  # each token's index in the flat batch, shifted per sequence
            seq_of = np.repeat(np.arange(n_real), q_lens)
            p = np.arange(t_real) - np.repeat(qsl[:n_real] - starts, q_lens)
        pos[:t_real] = p
        slots[:t_real] = tables[seq_of, p // bs] * bs + p % bs
        if t > t_real:
            ids[t_real:], pos[t_real:], slots[t_real:] = 0, 0, -1
        rows[:s_real] = (qsl[1:n_real + 1] if samples is None else qsl[1:][samples]) - 1
        if s > s_real:
            rows[s_real:] = 0
        n = layout_size(t, b, w, s)
        dev = self._dev if out is None else out
        if dev.data_ptr() != self._host.data_ptr():
            dev[:n].copy_(self._host[:n], non_blocking=True)
            if dev.is_cuda:
                self._copied = torch.cuda.Event()
                self._copied.record()
        self._last = (dev, n, (t, b, w, s))
        d = host if dev.data_ptr() == self._host.data_ptr() else views(dev, t, b, w, s)
        qsl_cpu = qsl.tolist()
        meta = AttentionMetadata(
            num_seqs=b, num_tokens=t, slot_mapping=d[2], query_start_loc=d[3],
            seq_lens=d[4], block_tables=d[5], max_query_len=int(q_lens.max()),
            max_seq_len=int(ends.max()), query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens.tolist(), sliding_window=self.sliding_window)
        return StepInputs(d[0], d[1], meta, d[6], [])

    def send(self, tp: TPGroup, meta: AttentionMetadata,
             graph: tuple[str, int] | None = None) -> None:
        """Rank 0: the last built step to ranks 1..N-1 (its shape and host-side lists
        on their command pipes, then one broadcast of the buffer itself). `graph`: the
        graph it replays, ("decode", batch size) or ("mixed", tokens), built into those
        graphs' buffer; None: an eager step."""
        assert self._last is not None
        dev, n, shape = self._last
        tp.send(("forward", n, shape, meta.max_query_len, meta.max_seq_len,
                 meta.query_start_loc_cpu, meta.seq_lens_cpu, graph))
        tp.broadcast(dev[:n])

    def receive(self, tp: TPGroup, command: tuple,
                out: torch.Tensor | None = None) -> StepInputs:
        """Ranks 1..N-1: the step rank 0 `send`s (`command` from the pipe), into `out`
        (the buffer of this rank's graphs for a replayed step), else our own buffer."""
        _, n, (t, b, w, s), max_query_len, max_seq_len, qsl_cpu, seq_lens_cpu, _ = command
        if out is None:
            self._reserve(n)
            out = self._dev
        tp.broadcast(out[:n])
        d = views(out, t, b, w, s)
        meta = AttentionMetadata(
            num_seqs=b, num_tokens=t, slot_mapping=d[2], query_start_loc=d[3],
            seq_lens=d[4], block_tables=d[5], max_query_len=max_query_len,
            max_seq_len=max_seq_len, query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu, sliding_window=self.sliding_window)
        return StepInputs(d[0], d[1], meta, d[6], [])
