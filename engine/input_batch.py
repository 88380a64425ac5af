"""The persistent batch (vLLM v1's InputBatch): what the runner keeps of each running
request between steps, in preallocated numpy arrays indexed by a stable slot.

A request takes a slot the first step it is scheduled and keeps it while it runs:
the engine frees the slot when the request finishes or is aborted (`remove`; a held
prefill producer's too: it is never scheduled again, and its held blocks are the KV
cache manager's business); a step's plan frees the slots whose block table was freed
or replaced since the last plan (preempted, yielded: the KV cache manager's table
changes are the batch's diff, `KVCacheManager.take_changed`). Each step then reads
two values per scheduled request (its slot and its new tokens) and gathers the rest
from the arrays:

    per slot: | gen | computed | known tokens | newest token | placeholders |
              | block table row, its length | flags: plain greedy, prompt logprobs,
              | hold_kv, forks |

- computed tokens advance by the step's tokens when a step is planned (the request's
  own count advances once the step ran, or once its forward is queued under async
  scheduling; nothing else changes it while the request holds its table);
- known tokens, the newest token and placeholders (async scheduling) follow the
  sampled tokens as the host reads them (`sampled` / `appended`); rows whose request
  left meanwhile are told apart by the slot's generation;
- a block-table row takes the table's new blocks only when the manager says the
  table changed (a new block every block_size decode steps).

Freed slots go back on a free list; slots are not condensed. The scheduler's order
(policy order, priorities, preemption victims) decides the step's layout, so a step
gathers its rows by slot whatever the batch's layout: a dense batch would save
nothing here and would move every row behind a hole on each removal.
Token ids are not kept beyond the newest one: a slot row of max_model_len ids would
take max_num_seqs * max_model_len * 4 bytes (128 MiB at 256 x 128k) for the few
chunked-prefill rows per step, which slice the request's own list instead.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import ScheduledRequest


def plain_greedy(r: Request) -> bool:
    """Greedy with nothing that changes the logits (grammar, penalties, logit_bias,
    min_tokens, allowed_token_ids, bad words): the row is the argmax of its raw logits."""
    p = r.sampling_params
    return p.temperature == 0.0 and r.grammar is None and not p.logit_bias \
        and not p.min_tokens and p.presence_penalty == 0.0 \
        and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0 \
        and p.allowed_token_ids is None and not r.bad_words_token_ids


# Per-slot flags (bits): the request samples plain greedy (no logprobs, nothing that
# changes the logits, no parallel-sample forks); asked for prompt logprobs; is a
# prefill producer (hold_kv); has forks waiting on its first token.
PLAIN, PROMPT_LOGPROBS, HOLD_KV, FORKS = 1, 2, 4, 8
_GEN, _COMPUTED, _KNOWN, _NEWEST, _PENDING, _NUM_BLOCKS = range(6)


@dataclass(slots=True)
class StepPlan:
    """One step's rows, in the scheduler's order: their slots, tokens computed this
    step, and their slots' values (`cols`: the batch's int rows gathered before the
    step advanced it) and flags (`any_flags`/`all_flags`: OR/AND over the rows)."""

    scheduled: Sequence[ScheduledRequest]
    slots: np.ndarray  # int64 [B]
    q_lens: np.ndarray  # int64 [B]
    cols: np.ndarray  # int64 [6, B]
    decode: bool  # one token each
    any_flags: int
    all_flags: int

    @property
    def starts(self) -> np.ndarray:  # tokens computed before this step
        return self.cols[_COMPUTED]

    @property
    def known(self) -> np.ndarray:  # token ids the host has
        return self.cols[_KNOWN]

    @property
    def pending(self) -> np.ndarray:  # tokens being sampled (async scheduling)
        return self.cols[_PENDING]

    @property
    def ends(self) -> np.ndarray:
        return self.starts + self.q_lens

    @property
    def gens(self) -> np.ndarray:  # the slots' generations
        return self.cols[_GEN]

    @property
    def newest(self) -> np.ndarray:  # the newest known token id
        return self.cols[_NEWEST]

    @property
    def num_blocks(self) -> np.ndarray:  # blocks in the slot's table row
        return self.cols[_NUM_BLOCKS]


@dataclass(slots=True)
class BatchRows:
    """The slots (and their generations) of a step's sampling requests and their rows
    among the sampled rows (`index`: forks add rows of their own), for `sampled` and
    `appended`; `plain`: every row plain greedy (PLAIN)."""

    batch: InputBatch
    slots: np.ndarray
    gens: np.ndarray
    plain: bool
    index: np.ndarray


class InputBatch:
    def __init__(self, capacity: int = 64, width: int = 16) -> None:
        self.index: dict[str, int] = {}  # request id -> slot
        self.reqs = np.empty(capacity, dtype=object)
        self._src: list[array[int] | None] = [None] * capacity  # each row's table source
        self._free = list(range(capacity - 1, -1, -1))  # pop(): the lowest slot first
        self._ints = np.zeros((6, capacity), np.int64)  # rows: _GEN ... _NUM_BLOCKS
        self.flags = np.zeros(capacity, np.uint8)
        self.tables = np.zeros((capacity, width), np.int32)
        self._bind()

    def _bind(self) -> None:
        (self.gen, self.computed, self.known, self.newest, self.pending,
         self.num_blocks) = self._ints

    @property
    def capacity(self) -> int:
        return len(self.reqs)

    def __len__(self) -> int:
        return len(self.index)

    def _grow(self) -> None:
        n = self.capacity
        self.reqs = np.concatenate([self.reqs, np.empty(n, dtype=object)])
        self._src += [None] * n
        self._free += range(2 * n - 1, n - 1, -1)
        self._ints = np.concatenate([self._ints, np.zeros_like(self._ints)], axis=1)
        self.flags = np.concatenate([self.flags, np.zeros_like(self.flags)])
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self._bind()

    def _copy_table(self, slot: int, ids: array[int], fresh: bool = False) -> None:
        """Copies `ids` into the slot's row; the row stays zero past them (`fresh`: a
        new row, whose tail may hold a former request's blocks, copied whole; else the
        row's table grew: the manager only appends to a table it keeps, so the ids the
        row holds are still its front and only the new tail is copied)."""
        n = len(ids)
        if n > self.tables.shape[1]:
            w = max(n, 2 * self.tables.shape[1])
            self.tables = np.pad(self.tables, ((0, 0), (0, w - self.tables.shape[1])))
        old = 0 if fresh else int(self.num_blocks[slot])
        self.tables[slot, old:n] = np.frombuffer(ids, np.int32)[old:]
        if fresh:
            self.tables[slot, n:] = 0
        self.num_blocks[slot] = n
        self._src[slot] = ids

    def add(self, r: Request, kv: KVCacheManager) -> int:
        """Gives `r` a slot, its row filled from the request and its block table."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.index[r.request_id] = slot
        self.reqs[slot] = r
        self.gen[slot] += 1
        self.computed[slot] = r.num_computed_tokens
        self.known[slot] = r.num_tokens
        self.newest[slot] = r.all_token_ids[-1]
        self.pending[slot] = r.num_output_placeholders
        p = r.sampling_params
        self.flags[slot] = (
            PLAIN * (plain_greedy(r) and p.logprobs is None and not r.forks)
            | PROMPT_LOGPROBS * (p.prompt_logprobs is not None)
            | HOLD_KV * r.hold_kv | FORKS * bool(r.forks))
        ids = kv.table(r.request_id)
        if ids is None:
            raise RuntimeError(f"request {r.request_id} is scheduled without blocks")
        self._copy_table(slot, ids, fresh=True)
        return slot

    def remove(self, request_id: str) -> None:
        """Frees the request's slot (no-op if it has none)."""
        slot = self.index.pop(request_id, None)
        if slot is None:
            return
        self.reqs[slot] = None
        self._src[slot] = None
        self.flags[slot] = 0  # (a step in flight may still refresh its rows' forks)
        self.gen[slot] += 1  # sampled rows still in flight for it no longer match
        self._free.append(slot)

    def sync(self, kv: KVCacheManager) -> None:
        """Applies the block tables' changes since the last call: a grown table's row
        is copied again; a freed or replaced table frees the slot (a new table is a new
        admission: the request is added back, its row read afresh, when scheduled)."""
        for rid in kv.take_changed():
            slot = self.index.get(rid)
            if slot is None:
                continue
            ids = kv.table(rid)
            if ids is None or ids is not self._src[slot] or len(ids) < self.num_blocks[slot]:
                self.remove(rid)  # (a kept table only grows: a shorter one is another)
            elif len(ids) != self.num_blocks[slot]:
                self._copy_table(slot, ids)

    def plan(self, scheduled: Sequence[ScheduledRequest], kv: KVCacheManager) -> StepPlan:
        """The step's rows (requests new to the batch take slots), then advances their
        computed tokens by the step's: call once per step that runs."""
        self.sync(kv)
        index = self.index
        try:
            slot_list = [index[s.request.request_id] for s in scheduled]
        except KeyError:
            for s in scheduled:
                if s.request.request_id not in index:
                    self.add(s.request, kv)
            slot_list = [index[s.request.request_id] for s in scheduled]
        # (few numpy calls: on a host whose caches the forward pass evicts, each one
        # costs more than the per-request reads)
        n = len(slot_list)
        slots = np.fromiter(slot_list, np.int64, n)
        q_list = [s.num_new_tokens for s in scheduled]
        decode = max(q_list, default=0) == 1  # (every row computes at least one token)
        q = np.ones(n, np.int64) if decode else np.fromiter(q_list, np.int64, n)
        cols = self._ints[:, slots]
        self.computed[slots] = cols[_COMPUTED] + q
        flags = self.flags[slots]
        return StepPlan(scheduled, slots, q, cols, decode,
                        int(np.bitwise_or.reduce(flags)), int(np.bitwise_and.reduce(flags)))

    def rows(self, plan: StepPlan, samples: np.ndarray | None) -> BatchRows:
        """The batch rows of `plan`'s rows `samples` (None: all of them)."""
        if samples is None:
            slots, gens = plan.slots, plan.gens
        else:
            slots, gens = plan.slots[samples], plan.gens[samples]
        return BatchRows(self, slots, gens, bool(plan.all_flags & PLAIN),
                         np.arange(len(slots)))

    def refresh_forks(self, slots: np.ndarray) -> None:
        """Clears FORKS of the requests in `slots` whose forks have started (then they
        are plain greedy again where their params are)."""
        for slot in slots[(self.flags[slots] & FORKS) != 0].tolist():
            r = self.reqs[slot]
            if not r.forks:
                plain = plain_greedy(r) and r.sampling_params.logprobs is None
                self.flags[slot] = (int(self.flags[slot]) & ~FORKS) | PLAIN * plain

    def sampled(self, rows: BatchRows) -> None:
        """The step of `rows` was launched: each row's token is being sampled."""
        self.pending[rows.slots] += 1

    def appended(self, rows: BatchRows, ids: np.ndarray) -> None:
        """The host has read the sampled `ids` of `rows`: they are known tokens now.
        Rows whose request left the batch since (its slot freed, maybe reused) are
        skipped."""
        live = self.gen[rows.slots] == rows.gens
        slots = rows.slots[live]
        self.newest[slots] = ids[live]
        self.known[slots] += 1
        self.pending[slots] -= 1

    def check_integrity(self, kv: KVCacheManager) -> None:
        """Every live slot mirrors its request and block table (call between steps)."""
        self.sync(kv)
        assert len(self.index) + len(self._free) == self.capacity
        for rid, slot in self.index.items():
            r = self.reqs[slot]
            assert r is not None and r.request_id == rid and not r.status.finished, rid
            assert self.computed[slot] == r.num_computed_tokens, rid
            assert self.known[slot] == r.num_tokens, rid
            assert self.newest[slot] == r.all_token_ids[-1], rid
            assert self.pending[slot] == r.num_output_placeholders, rid
            ids = kv.table(rid)
            assert ids is not None and ids is self._src[slot], rid
            assert self.tables[slot, :self.num_blocks[slot]].tolist() == ids.tolist(), rid
