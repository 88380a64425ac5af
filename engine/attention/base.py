"""The attention backend interface and the per-step metadata every backend reads.

The KV cache is one block-major tensor `[num_blocks, num_layers, 2, block_size,
kv_heads, head_dim]` (`kvtransfer.layout.engine_layout` is its one definition). A
layer sees the strided view `cache[:, layer]`: `[num_blocks, 2, block_size, kv_heads,
head_dim]`, where `[:, 0]` holds K and `[:, 1]` holds V. MLA models (DeepSeek) cache one
part of one "head" instead, the latent and rope key per token (`engine.attention.mla`).

A step's batch is flat: the new tokens of every scheduled sequence, one after the
other, no padding between sequences. For sequence i:

    # | cached context (seq_lens[i] - q_len) | new tokens (q_len) |
    #                                         ^ query_start_loc[i] .. query_start_loc[i+1]

The model runner builds one AttentionMetadata per step (a few device tensors copied
host->device in one go); every layer of the forward pass reads the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv_quant import Scale


@dataclass(slots=True)
class AttentionMetadata:
    """How the flat token batch of one step maps onto sequences and cache slots.

    Device tensors (on the cache's device):
      slot_mapping     [T] int32   flat slot `block_id * block_size + offset` of each new
                                   token's K/V; -1 marks a padding token (not written).
      query_start_loc  [B+1] int32 cumulative new-token counts; sequence i's queries are
                                   rows query_start_loc[i] .. query_start_loc[i+1] - 1.
      seq_lens         [B] int32   tokens with KV after this step (cached + new); 0 marks
                                   a padding sequence (its output rows are zeros).
      block_tables     [B, W] int32 the blocks of each sequence in order, padded with 0.
    Host copies (`*_cpu`) of query_start_loc and seq_lens serve the reference backend
    and the launch grid; `max_query_len` / `max_seq_len` bound them. With
    `graph_bucket`, the host-side fields are a mixed-graph bucket's constants
    (engine.mixed_graphs), not this step's: only kernels that read the device tensors
    may run on it.
    """

    num_seqs: int
    num_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    sliding_window: int | None = None
    graph_bucket: bool = False

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """One call per layer for the whole batch: writes the new tokens' K/V into their
    cache slots, then attends every query over its sequence's context (causal; with a
    sliding window only the last `sliding_window` positions)."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_layer: cache[:, layer].
        Returns the attention output [T, H, D] (a new tensor). A float8 cache
        (engine.kv_quant) stores K / k_scale and V / v_scale, and reads them back
        multiplied by the scales, in q's dtype."""
        ...
