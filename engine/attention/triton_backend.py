"""The Triton attention backend (the CUDA default): the KV write, then split-K decode
for decode-only steps or the unified kernel for any other mix, all launched from
device metadata. No per-sequence Python and no device->host sync, so a decode-only
forward can be captured in a CUDA graph."""

from __future__ import annotations

import torch

from engine.attention import triton_attn, triton_decode
from engine.attention.base import AttentionMetadata
from engine.attention.tuning import TileTable
from engine.kv_quant import Scale


class TritonBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None,
                 decode_table: TileTable[triton_decode.DecodeTile] | None = None,
                 prefill_table: TileTable[triton_attn.PrefillTile] | None = None) -> None:
        """`num_splits` fixes split-K decode's splits (a power of two); None picks
        them from the batch shape (`triton_decode.num_decode_splits`). The tables give
        the kernels' launch configurations (the start-up tuner's, engine.attention.
        tuning; None: the untuned ones): split-K decode's looked up by the step's
        sequence count and `max_seq_len`, the unified kernel's by `max_query_len`. The
        model runner sets them before any CUDA graph is captured, and a graph's
        metadata is the same at warm-up, capture and replay: a decode graph bounds its
        sequences at the model's length, so it keeps its batch size's longest-context
        entry (the steps where decode attention costs most); a mixed graph's longest
        query is its token bucket."""
        self.num_splits = num_splits
        self.decode_table = decode_table or TileTable(triton_decode.DecodeTile())
        self.prefill_table = prefill_table or TileTable(triton_attn.PrefillTile())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> torch.Tensor:
        triton_attn.write_kv(k, v, kv_layer, meta.slot_mapping, k_scale, v_scale)
        if meta.is_decode_only:
            return triton_decode.decode_attention(
                q, kv_layer, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.query_start_loc_cpu, scale, meta.sliding_window, self.num_splits,
                k_scale, v_scale, self.decode_table.choose(meta.num_seqs, meta.max_seq_len))
        return triton_attn.unified_attention(
            q, kv_layer, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.query_start_loc_cpu, meta.max_query_len, scale, meta.sliding_window,
            k_scale, v_scale, self.prefill_table.choose(meta.max_query_len))
