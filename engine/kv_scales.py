"""The float8 KV cache's scales as the engine holds them, and what keeps KV bytes that
move between processes meaningful.

One float32 tensor [num_layers, 2] (k_scale, v_scale) on the device; each attention
layer reads its row by address (`Attention.k_scale` / `v_scale` are views), so the
CUDA graphs captured at start-up see scales fixed later.

`--calculate-kv-scales` (vLLM's flag and meaning): the first real forward pass computes
each layer's scales from its own K and V, `max|K| / k_constant` and `max|V| /
v_constant` (vLLM's K_SCALE_CONSTANT = 200 and V_SCALE_CONSTANT = 100, read from the
environment by the CLI), and they stay fixed. Under tensor parallelism every rank takes
the maximum over all ranks' heads, so one block's bytes mean the same on every rank.
That forward runs eagerly; start-up's dummy passes (memory profile, tuning, capture)
never calibrate.

Two processes that calibrated on different prompts hold different scales, so a block
quantized by one is wrong in the other. Every FP8 block that arrives from elsewhere (a
prefill's hand-off, a peer's fetch, an offload tier written by another process) comes
with the scales it was written under, and lands through `accept`: a receiver that has
not fixed its own scales yet adopts the sender's (no conversion; it never calibrates);
one whose scales differ requantizes the landed blocks, value * src / dst per layer and
K/V, before anything reads them (one more e4m3 rounding, plus a clamp if the sender's
range was wider).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import torch

from engine.kv_quant import dequantize, load_kv_scales, quantize

if TYPE_CHECKING:
    from engine.distributed import TPGroup
    from engine.model_runner import ModelRunner
    from engine.models.llama import Attention

log = logging.getLogger(__name__)

ScaleList = list[tuple[float, float]]  # (k_scale, v_scale) per layer, on the host


class KVScales:
    """Owns the scales tensor the attention layers read, and whether it is fixed."""

    def __init__(self, layers: Sequence[Attention], initial: ScaleList,
                 device: torch.device, calculate: bool = False,
                 constants: tuple[float, float] = (200.0, 100.0),
                 tp: TPGroup | None = None) -> None:
        if len(initial) != len(layers):
            raise ValueError(f"{len(initial)} KV scales for {len(layers)} attention layers")
        self.tensor = torch.tensor(initial, dtype=torch.float32, device=device)
        self.layers = list(layers)
        for i, attn in enumerate(self.layers):
            attn.k_scale, attn.v_scale = self.tensor[i, 0], self.tensor[i, 1]
        self.pending = calculate  # the first real forward (or an adoption) fixes them
        # the checkpoint's, or 1.0, as float32 (what the cache and the wire hold)
        self.initial: ScaleList = [(k, v) for k, v in self.tensor.tolist()]
        # called with the scales once they are fixed (calculated or adopted), on the
        # thread that fixed them: the disk tier's record (kvtransfer/tiers/disk_scales.py)
        self.on_fixed: list[Callable[[ScaleList], None]] = []
        self.constants = torch.tensor(constants, dtype=torch.float32, device=device)
        self.tp = tp
        self._host: ScaleList | None = None if calculate else self.initial

    def values(self) -> ScaleList:
        """The scales on the host (what a sender puts beside the bytes it sends). Under
        --calculate-kv-scales before the first forward: not known yet, an error."""
        if self.pending:
            raise RuntimeError("the KV scales are not fixed yet (no forward pass has run)")
        if self._host is None:
            self._host = [(k, v) for k, v in self.tensor.tolist()]
        return self._host

    @contextmanager
    def calibrating(self) -> Iterator[None]:
        """Around the first real forward pass while pending: each layer computes its
        scales from its K and V before it writes them; fixed afterwards."""
        if not self.pending:
            yield
            return
        for i, attn in enumerate(self.layers):
            attn.kv_calibrate = partial(self._calibrate, i)
        try:
            yield
        finally:
            for attn in self.layers:
                attn.kv_calibrate = None
        self.pending = False
        log.info("KV scales calculated from the first forward pass: %s",
                 [(round(k, 6), round(v, 6)) for k, v in self.values()])
        self._fixed()

    def _calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        amax = torch.stack([k.abs().amax(), v.abs().amax()]).float()
        if self.tp is not None:  # the max over every rank's heads: max = -min(-x)
            amax = -self.tp.all_reduce_min(-amax)
        # (an all-zero K or V, which no real model gives, keeps 1.0 rather than 0)
        self.tensor[layer].copy_(torch.where(amax > 0, amax / self.constants, 1.0))

    def accept(self, caches: Sequence[torch.Tensor], block_ids: Sequence[int],
               src: ScaleList | None) -> None:
        """Blocks `block_ids` of each cache in `caches` (a rank's full cache, or rank
        0's full-head staging copy) hold bytes written under `src` (None: under this
        engine's own scales). Adopts `src` if this engine's scales are not fixed yet,
        else requantizes those blocks in place from `src` to its own."""
        if src is None or not block_ids:
            return
        if len(src) != len(self.layers):
            raise ValueError(f"KV scales for {len(src)} layers, this model has "
                             f"{len(self.layers)}")
        if self.pending:
            self.adopt(src)
            return
        if src == self.values():
            return
        ids = torch.tensor(list(block_ids), device=self.tensor.device)
        for cache in caches:
            cache[ids] = requantize(cache[ids], src, self.values())

    def adopt(self, src: ScaleList) -> None:
        """Takes `src` as this engine's fixed scales (it has not calibrated)."""
        self.tensor.copy_(torch.tensor(src, dtype=torch.float32))
        self._host = None  # (read back: float32, as the wire and the cache hold them)
        self.pending = False
        log.info("KV scales adopted from the KV's sender")
        self._fixed()

    def _fixed(self) -> None:
        for fn in self.on_fixed:
            fn(self.values())


def requantize(blocks: torch.Tensor, src: ScaleList, dst: ScaleList) -> torch.Tensor:
    """Float8 blocks [n, layers, 2, block, heads, dim] written under `src`, as they read
    under `dst`: quantize(dequantize(x, src), dst) per layer and K/V."""
    s = torch.tensor(src, dtype=torch.float32, device=blocks.device)
    d = torch.tensor(dst, dtype=torch.float32, device=blocks.device)
    shape = (1, len(src), 2, 1, 1, 1)
    ratio = (s / d).reshape(shape)
    return quantize(dequantize(blocks, ratio, torch.float32), 1.0)


def make_kv_scales(runner: ModelRunner) -> KVScales:
    """The runner's float8 scales: the checkpoint's (else 1.0), to be calculated on the
    first real forward under --calculate-kv-scales."""
    from engine.models.llama import Attention

    cache, cfg = runner.config.cache, runner.model_cfg
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    return KVScales(layers, load_kv_scales(runner.config.model_dir, cfg.num_layers),
                    runner.device, cache.calculate_kv_scales, cache.kv_scale_constants,
                    runner.tp)


def calibrating(scales: KVScales | None) -> contextlib.AbstractContextManager[None]:
    """`scales.calibrating()`, or nothing without a float8 cache."""
    return contextlib.nullcontext() if scales is None else scales.calibrating()


def wire_scales(runner: ModelRunner) -> list[float]:
    """What a sender puts beside the KV bytes it sends: its scales flattened (k0, v0,
    k1, v1, ...); [] without a float8 cache. Engine thread."""
    if runner.kv_scales is None:
        return []
    return [s for pair in runner.kv_scales.values() for s in pair]


def accept_blocks(runner: ModelRunner, block_ids: Sequence[int], wire: Sequence[float],
                  staging: torch.Tensor | None = None) -> None:
    """Blocks `block_ids` landed, written under the sender's `wire_scales`: adopted or
    requantized (KVScales.accept) where the engine reads them: rank 0's full-head
    `staging` copy before it is scattered to the ranks (CUDA tensor parallelism), else
    every rank's cache. Engine thread."""
    scales = runner.kv_scales
    if scales is None or not block_ids:
        return
    if len(wire) != 2 * len(scales.layers):
        raise ValueError(f"the sender's KV scales have {len(wire)} values; this float8 "
                         f"cache needs k and v for {len(scales.layers)} layers")
    src = [(float(wire[i]), float(wire[i + 1])) for i in range(0, len(wire), 2)]
    if scales.pending:
        adopt_scales(runner, src)
        return
    caches = [staging] if staging is not None else (runner.rank_caches or [runner.kv_cache])
    scales.accept(caches, block_ids, src)


def adopt_scales(runner: ModelRunner, src: ScaleList) -> None:
    """The engine takes `src` as its fixed scales, on every rank. Engine thread."""
    assert runner.kv_scales is not None and runner.kv_scales.pending
    runner._tell(("scales", src))
    runner.kv_scales.adopt(src)
