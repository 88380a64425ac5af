"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

The cache holds, per token per layer, one entry shared by every head: the normalised
KV latent (`kv_lora_rank` values) then the rotated rope key (`qk_rope_head_dim`):

    kv_layer = cache[:, layer]: [num_blocks, 1, block_size, 1, kv_lora_rank + rope_dim]
    entry:   | latent c (kv_lora_rank) | k_pe (rope_dim) |

Keys and values come from the latent through kv_b_proj, whose weight splits per head
into W_UK [nope, rank] and W_UV [v, rank]:

    k_h = [W_UK_h c ; k_pe],   v_h = W_UV_h c

Two ways to compute the same attention (vLLM's MLA names them by the step kind they
serve: "prefill", compute-friendly; "decode", data-movement-friendly):

- decompressed: K and V of the whole context through kv_b_proj, then causal SDPA per
  head, as transformers does;
- absorbed: W_UK folded into the query and W_UV applied after the weighted sum, so
  every head reads the same latent entries and K / V are never materialised:

    score_h(j) = (W_UK_h^T q_nope_h) . c_j + q_pe_h . k_pe_j
    out_h      = W_UV_h (sum_j softmax_j * c_j)

The torch backend here is the reference and the CPU default: absorbed for decode-only
steps, decompressed for any other. The Triton backend (`engine.attention.triton_mla`)
runs the absorbed form as paged kernels for decode-only steps and for the steps of the
mixed CUDA graphs (causal runs of queries per sequence), and decompresses the larger
steps that run eagerly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.attention.torch_sdpa import _causal_mask

if TYPE_CHECKING:
    from engine.hf_config import MLAConfig


class MLABackend(Protocol):
    name: str

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                k_pe: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                scale: float, w_kv: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope]; latent [T, rank], k_pe [T, rope] of
        the new tokens (written into their slots first); w_kv: kv_b_proj's weight
        [H * (nope + v), rank]. Returns the attention output [T, H, v] (a new tensor)."""
        ...


def latent_entries(kv_layer: torch.Tensor) -> torch.Tensor:
    """The strided view [num_blocks, block_size, latent_dim] of one layer's entries."""
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 1 or kv_layer.shape[3] != 1:
        raise ValueError(f"an MLA kv_layer is [num_blocks, 1, block_size, 1, latent_dim], "
                         f"got {tuple(kv_layer.shape)}")
    return kv_layer[:, 0, :, 0]


def split_kv_weight(w_kv: torch.Tensor, num_heads: int,
                    v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, nope, rank], W_UV [H, v, rank]) as views of kv_b_proj's weight."""
    w = w_kv.view(num_heads, -1, w_kv.shape[-1])
    nope = w.shape[1] - v_head_dim
    return w[:, :nope], w[:, nope:]


def write_latent(latent: torch.Tensor, k_pe: torch.Tensor, kv_layer: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Scatters the new tokens' latent + rope key into their slots (-1 skipped)."""
    entries = latent_entries(kv_layer)
    bs = entries.shape[1]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        latent, k_pe, slot_mapping = latent[keep], k_pe[keep], slot_mapping[keep]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs
    entries[blocks.long(), offsets.long()] = torch.cat((latent, k_pe), dim=-1).to(
        entries.dtype)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope] through W_UK -> the latent-space query [T, H, rank]."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The attention-weighted latent [T, H, rank] through W_UV -> [T, H, v]."""
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def _context(entries: torch.Tensor, meta: AttentionMetadata, i: int,
             ctx_len: int) -> torch.Tensor:
    """Sequence i's first ctx_len entries [ctx_len, latent_dim], gathered by block."""
    bs = entries.shape[1]
    table = meta.block_tables[i, :-(-ctx_len // bs)]
    return entries.index_select(0, table).flatten(0, 1)[:ctx_len]


class TorchMLABackend:
    """The reference: per sequence, gather its entries; decode-only steps attend in
    the latent space (absorbed), other steps decompress K/V and run SDPA."""

    name = "torch"

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                k_pe: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                scale: float, w_kv: torch.Tensor) -> torch.Tensor:
        write_latent(latent, k_pe, kv_layer, meta.slot_mapping)
        if meta.is_decode_only:
            return self.decode(q_nope, q_pe, kv_layer, meta, scale, w_kv)
        return prefill_decompressed(q_nope, q_pe, kv_layer, meta, scale, w_kv)

    @staticmethod
    def decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
               meta: AttentionMetadata, scale: float, w_kv: torch.Tensor) -> torch.Tensor:
        heads = q_nope.shape[1]
        w_uk, w_uv = split_kv_weight(w_kv, heads, w_kv.shape[0] // heads - q_nope.shape[2])
        o_lat = attend_latent(absorb_query(q_nope, w_uk), q_pe, kv_layer, meta, scale)
        return expand_output(o_lat, w_uv)


def attend_latent(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The absorbed attention of every query row (the reference; host-side lengths):
    sequence i's rows are a causal run ending at its last context position. q_lat [T, H,
    rank] (q_nope through W_UK), q_pe [T, H, rope]. Returns the attention-weighted
    latent [T, H, rank] (zeros for padding sequences)."""
    rank = q_lat.shape[-1]
    o_lat = q_lat.new_zeros(q_lat.shape)
    entries = latent_entries(kv_layer)
    starts = meta.query_start_loc_cpu
    for i, ctx_len in enumerate(meta.seq_lens_cpu):
        if ctx_len == 0:
            continue  # a padding sequence
        sl = slice(starts[i], starts[i + 1])
        c, kpe = _context(entries, meta, i, ctx_len).split(
            [rank, entries.shape[-1] - rank], dim=-1)
        scores = (q_lat[sl] @ c.T + q_pe[sl] @ kpe.T).float() * scale  # [q, H, ctx]
        q_len = sl.stop - sl.start
        if q_len > 1:  # query k sits at position ctx_len - q_len + k
            first = ctx_len - q_len
            pos = torch.arange(first, ctx_len, device=c.device)
            hidden = torch.arange(ctx_len, device=c.device)[None, :] > pos[:, None]
            scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        o_lat[sl] = scores.softmax(dim=-1).to(c.dtype) @ c
    return o_lat


def absorbed_is_cheaper(runs: Iterable[tuple[int, int]], mla: MLAConfig) -> bool:
    """Whether attention over `runs` (each sequence's new queries and its keys, those
    queries included) takes no more multiply-adds per head in the latent space than
    decompressed: absorbed, W_UK and W_UV per query and (2 * rank + rope) per
    query-key pair; decompressed, kv_b_proj per key and (nope + rope + v) per pair
    (engine.attention.triton_mla works the figures for DeepSeek-V3)."""
    rank, rope = mla.kv_lora_rank, mla.qk_rope_head_dim
    nv = mla.qk_nope_head_dim + mla.v_head_dim
    absorbed = decompressed = 0
    for q, c in runs:
        absorbed += q * nv * rank + q * c * (2 * rank + rope)
        decompressed += c * nv * rank + q * c * (nv + rope)
    return absorbed <= decompressed


def prefill_decompressed(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         w_kv: torch.Tensor) -> torch.Tensor:
    """Any mix of prefill and decode: per sequence, K/V decompressed from its latents
    (kv_b_proj) and causal SDPA over its whole context, as transformers computes it."""
    heads, nope, rope = q_nope.shape[1], q_nope.shape[2], q_pe.shape[2]
    rank = w_kv.shape[-1]
    v_dim = w_kv.shape[0] // heads - nope
    out = q_nope.new_zeros(q_nope.shape[0], heads, v_dim)
    entries = latent_entries(kv_layer)
    starts = meta.query_start_loc_cpu
    for i, ctx_len in enumerate(meta.seq_lens_cpu):
        if ctx_len == 0:
            continue
        sl = slice(starts[i], starts[i + 1])
        q_len = sl.stop - sl.start
        c, kpe = _context(entries, meta, i, ctx_len).split([rank, rope], dim=-1)
        kv = F.linear(c, w_kv).view(ctx_len, heads, nope + v_dim)
        k_nope, v = kv.split([nope, v_dim], dim=-1)
        k = torch.cat((k_nope, kpe.unsqueeze(1).expand(ctx_len, heads, rope)), dim=-1)
        q = torch.cat((q_nope[sl], q_pe[sl]), dim=-1)
        mask = _causal_mask(q_len, ctx_len, None, q.device) if q_len > 1 else None
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale)
        out[sl] = o.squeeze(0).transpose(0, 1)
    return out


def make_mla_backend(name: str) -> MLABackend:
    """The MLA backend paired with the attention backend `name` (torch | triton)."""
    if name == "torch":
        return TorchMLABackend()
    if name == "triton":
        from engine.attention.triton_mla import TritonMLABackend

        return TritonMLABackend()
    raise ValueError(f"unknown attention backend {name!r}; choose from ('torch', 'triton')")
