"""Tensor-parallel pieces of the Llama-family model (Megatron's split).

Column-parallel: the fused qkv projection holds this rank's query heads and KV heads
(a KV head replicated on tp / num_kv_heads ranks when there are fewer KV heads than
ranks), the fused gate_up projection this rank's slice of the intermediate size; both
need no communication. Row-parallel: o_proj and down_proj take this rank's slice of
their input and end in one all-reduce each. Vocab-parallel: the embedding and the LM
head hold ceil(vocab / tp) rows each (the last rank's tail zero-padded); the embedding
sums the ranks' lookups with one all-reduce, the LM head's logits are gathered.

Mixtures of experts split each expert as an MLP: w13 holds this rank's gate and up rows
of every expert, w2 the matching down columns; the router is whole on every rank, so
every rank routes every token alike, and one all-reduce ends the block (routed and
shared experts summed first). MLA (DeepSeek) splits the query heads (q / q_b, kv_b,
o_proj) and keeps the latent projections whole: every rank computes and caches the
same latent.

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


def _split(size: int, rank: int, tp: int, dim: int) -> tuple[int, int, int]:
    n = size // tp
    return dim, rank * n, (rank + 1) * n


def shard_range(cfg: ModelConfig, name: str, rank: int, tp: int,
                ) -> tuple[int, int, int] | None:
    """(dim, start, end) of the full Hugging Face tensor `name` that rank holds, or None
    when every rank holds it whole (norms, routers, an MLA latent's projections).
    `cfg` is the full model's shape."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        n = vocab_shard(cfg.vocab_size, tp)
        return 0, min(rank * n, cfg.vocab_size), min((rank + 1) * n, cfg.vocab_size)
    mlp = _mlp_range(cfg, name, rank, tp)
    if mlp is not None or ".mlp." in name or ".block_sparse_moe." in name:
        return mlp
    if cfg.mla is not None:
        return _mla_range(cfg, name, rank, tp)
    d = cfg.head_dim
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return _split(cfg.num_heads * d, rank, tp, 0)
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        first, end = kv_head_range(cfg, rank, tp)
        return 0, first * d, end * d
    if name.endswith("o_proj.weight"):
        return _split(cfg.num_heads * d, rank, tp, 1)
    return None


def _mlp_range(cfg: ModelConfig, name: str, rank: int, tp: int,
               ) -> tuple[int, int, int] | None:
    """Dense MLPs, routed experts (each one's intermediate size split: gate / up rows,
    down columns) and DeepSeek's shared experts; the router stays whole."""
    if ".experts." in name:  # Qwen3-MoE / DeepSeek gate_proj, Mixtral w1 / w3 / w2
        inter = cfg.moe_intermediate_size
    elif ".shared_experts." in name:
        assert cfg.routing is not None
        inter = cfg.moe_intermediate_size * cfg.routing.n_shared_experts
    else:
        inter = cfg.intermediate_size
    if name.endswith(("gate_proj.weight", "up_proj.weight", ".w1.weight", ".w3.weight")):
        return _split(inter, rank, tp, 0)
    if name.endswith(("down_proj.weight", ".w2.weight")):
        return _split(inter, rank, tp, 1)
    return None


def _mla_range(cfg: ModelConfig, name: str, rank: int, tp: int,
               ) -> tuple[int, int, int] | None:
    """MLA splits by query head: q_proj / q_b_proj rows (qk_head_dim each), kv_b_proj
    rows (nope + v each), o_proj columns (v each). q_a_proj, kv_a_proj_with_mqa and
    their norms make the latent, the same on every rank."""
    mla = cfg.mla
    assert mla is not None
    heads = cfg.num_heads
    if name.endswith(("q_proj.weight", "q_b_proj.weight")):
        return _split(heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim), rank, tp, 0)
    if name.endswith("kv_b_proj.weight"):
        return _split(heads * (mla.qk_nope_head_dim + mla.v_head_dim), rank, tp, 0)
    if name.endswith("o_proj.weight"):
        return _split(heads * mla.v_head_dim, rank, tp, 1)
    return None


def make_embedding(vocab: int, hidden: int,
                   tp: TPGroup | None) -> nn.Embedding | VocabParallelEmbedding:
    """The token embedding (with `tp`, this rank's rows), its weight uninitialised: the
    loader fills it. Not nn.Embedding's own init, as the loader builds models on the meta
    device, where normal_ runs torch's Python reference ops, and their first call imports
    torch._dynamo: seconds of every worker's start-up, for a value nobody reads."""
    if tp is not None:
        return VocabParallelEmbedding(vocab, hidden, tp)
    return nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))


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
