"""Tensor-parallel pieces of the Llama-family model (Megatron's split).

Column-parallel: the fused qkv projection holds this rank's query heads and KV heads
(a KV head replicated on tp / num_kv_heads ranks when there are fewer KV heads than
ranks), the fused gate_up projection this rank's slice of the intermediate size; both
need no communication. Row-parallel: o_proj and down_proj take this rank's slice of
their input and end in one all-reduce each. Vocab-parallel: the embedding and the LM
head hold ceil(vocab / tp) rows each (the last rank's tail zero-padded); the embedding
sums the ranks' lookups with one all-reduce, the LM head's logits are gathered.

`shard_range` says which rows (or columns) of each Hugging Face tensor a rank holds;
the loader reads only those (engine/models/loader.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig

if TYPE_CHECKING:
    from engine.distributed import TPGroup


def vocab_shard(vocab: int, tp: int) -> int:
    """Rows of the embedding / LM head per rank."""
    return -(-vocab // tp)


def kv_head_range(cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """[first, end) of the KV heads rank `rank` holds (of the full model's)."""
    kv = cfg.num_kv_heads
    if kv >= tp:
        n = kv // tp
        return rank * n, (rank + 1) * n
    head = rank * kv // tp  # replicated: ranks r*tp/kv .. hold the same head
    return head, head + 1


def shard_range(cfg: ModelConfig, name: str, rank: int, tp: int,
                ) -> tuple[int, int, int] | None:
    """(dim, start, end) of the full Hugging Face tensor `name` that rank holds, or None
    when every rank holds it whole (norms). `cfg` is the full model's shape."""
    d = cfg.head_dim
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        n = cfg.num_heads // tp * d
        return 0, rank * n, (rank + 1) * n
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        first, end = kv_head_range(cfg, rank, tp)
        return 0, first * d, end * d
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        n = cfg.intermediate_size // tp
        return 0, rank * n, (rank + 1) * n
    if name.endswith("o_proj.weight"):
        n = cfg.num_heads // tp * d
        return 1, rank * n, (rank + 1) * n
    if name.endswith("down_proj.weight"):
        n = cfg.intermediate_size // tp
        return 1, rank * n, (rank + 1) * n
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        n = vocab_shard(cfg.vocab_size, tp)
        return 0, min(rank * n, cfg.vocab_size), min((rank + 1) * n, cfg.vocab_size)
    return None


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; ids outside them look up zeros, and one
    all-reduce sums the ranks' lookups into the whole embedding."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.rows = vocab_shard(vocab, tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def gather_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab: int,
                  tp: TPGroup) -> torch.Tensor:
    """Logits [n, vocab] from this rank's LM-head rows, gathered (every rank calls it;
    the engine's rank 0 samples from them)."""
    local = F.linear(hidden, weight).float()
    return tp.all_gather(local, dim=-1)[:, :vocab]
