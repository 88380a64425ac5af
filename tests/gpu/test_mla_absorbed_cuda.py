"""The absorbed MLA kernel for causal query runs on the GPU (skipped without one), at
DeepSeek-V3's latent shape (rank 512, rope 64, 16 heads of a tensor-parallel shard) in
bfloat16: equal to the torch reference, and captured in a CUDA graph whose replays
follow new lengths and tables written into the same device tensors (its grid comes from
the bucket's shape alone)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.mla import attend_latent
from engine.attention.triton_mla import mla_absorbed
from tests.unit.engine.test_triton_mla_absorbed import make_step

pytestmark = pytest.mark.gpu

SHAPE = dict(heads=16, rank=512, rope=64, block_size=16, dtype=torch.bfloat16)
SCALE = 192 ** -0.5


def _run(q_lat, q_pe, cache, meta) -> torch.Tensor:
    return mla_absorbed(q_lat, q_pe, cache[:, 0], meta.block_tables, meta.seq_lens,
                        meta.query_start_loc, SCALE)


def test_deepseek_v3_shape_matches_reference() -> None:
    q_lat, q_pe, cache, meta = make_step([(300, 40), (0, 64), (1000, 1), (77, 23)],
                                         pad_tokens=0, pad_seqs=0, **SHAPE)
    ref = attend_latent(q_lat, q_pe, cache[:, 0], meta, SCALE)
    torch.testing.assert_close(_run(q_lat, q_pe, cache, meta), ref, atol=2e-2, rtol=2e-2)


def test_replays_of_a_captured_bucket_follow_the_device_metadata() -> None:
    """Two steps of one 64-token bucket (5 sequences): the second's lengths, query
    starts and tables are copied into the first's tensors before a replay."""
    # a's pool is the larger: b's blocks fit in its cache
    runs_a, runs_b = [(513, 2), (7, 50), (0, 4)], [(100, 30), (0, 20), (40, 1)]
    a = make_step(runs_a, pad_tokens=8, pad_seqs=2, seed=1, **SHAPE)
    b = make_step(runs_b, pad_tokens=13, pad_seqs=2, seed=2, **SHAPE)
    q_lat, q_pe, cache, meta = a
    width = max(meta.block_tables.shape[1], b[3].block_tables.shape[1])
    tables = torch.zeros((5, width), dtype=torch.int32, device="cuda")
    tables[:, :meta.block_tables.shape[1]] = meta.block_tables
    meta.block_tables = tables
    _run(q_lat, q_pe, cache, meta)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(q_lat, q_pe, cache, meta)
    graph.replay()
    torch.testing.assert_close(out, attend_latent(q_lat, q_pe, cache[:, 0], a[3], SCALE),
                               atol=2e-2, rtol=2e-2)
    q_lat2, q_pe2, cache2, meta2 = b
    q_lat.copy_(q_lat2), q_pe.copy_(q_pe2)
    rows = min(cache.shape[0], cache2.shape[0])
    cache[:rows].copy_(cache2[:rows])
    assert int(meta2.block_tables.max()) < rows
    meta.seq_lens.copy_(meta2.seq_lens), meta.query_start_loc.copy_(meta2.query_start_loc)
    tables.zero_()
    tables[:, :meta2.block_tables.shape[1]] = meta2.block_tables
    graph.replay()
    ref = attend_latent(q_lat2, q_pe2, cache2[:rows, 0], meta2, SCALE)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert not out[meta2.query_start_loc_cpu[3]:].any()  # padding rows
