"""The worker side of the engine: owns the model and the KV cache tensor, turns a
SchedulerOutput into one forward pass, and samples.
"""

from __future__ import annotations

import logging

import torch

from engine.attention import AttentionMetadata, SeqAttn
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.models.loader import TORCH_DTYPES, load_model
from engine.sampler import Logprobs, Sampler
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

Sampled = tuple[int, Logprobs | None]


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def num_kv_blocks(config: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The KV pool's size in blocks: `cache.num_blocks`, else what fits the byte budget."""
    return config.cache.num_blocks or max(
        1, config.cache.kv_cache_memory_bytes // kv_block_bytes(model_cfg, config.cache.block_size,
                                                                dtype))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig,
                 kv_cache: torch.Tensor | None = None) -> None:
        """`kv_cache`, if given, is a preallocated block-major tensor (e.g. in shared
        memory for the shm transport); otherwise one is allocated here."""
        self.config = config
        self.model_cfg = model_cfg
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype or model_cfg.dtype]
        self.block_size = config.cache.block_size
        self.model = load_model(config.model_dir, model_cfg, self.dtype, self.device)
        if kv_cache is None:
            num_blocks = num_kv_blocks(config, model_cfg, self.dtype)
            kv_cache = torch.zeros(kv_cache_shape(model_cfg, num_blocks, self.block_size),
                                   dtype=self.dtype, device=self.device)
        expected = kv_cache_shape(model_cfg, kv_cache.shape[0], self.block_size)
        if tuple(kv_cache.shape) != expected or kv_cache.dtype != self.dtype:
            raise ValueError(f"kv cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match "
                             f"the model's layout {expected} {self.dtype}")
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.shape[0]
        self.sampler = Sampler(self.device, config.seed)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> dict[str, Sampled]:
        """Runs one step; returns {request_id: (token, logprobs)} for requests whose
        computed tokens reach their end this step (partial prefill chunks sample nothing).
        """
        input_ids, positions, meta, sample_rows, sample_reqs = self._prepare(out, kv)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if not sample_reqs:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        ids = [r.request_id for r in sample_reqs]
        tokens, logprobs = self.sampler(logits, ids, [r.sampling_params for r in sample_reqs])
        return dict(zip(ids, zip(tokens, logprobs, strict=True), strict=True))

    def _prepare(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple:
        bs = self.block_size
        tokens: list[int] = []
        pos: list[int] = []
        slot_b: list[int] = []
        slot_o: list[int] = []
        seqs: list[SeqAttn] = []
        sample_rows: list[int] = []
        sample_reqs = []
        dev = self.device
        for s in out.scheduled:
            req, n = s.request, s.num_new_tokens
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            table = kv.block_ids(req.request_id)
            seqs.append(SeqAttn(len(tokens), n, end, torch.tensor(
                table[:cdiv(end, bs)], dtype=torch.long, device=dev)))
            tokens += req.all_token_ids[start:end]
            pos += range(start, end)
            slot_b += [table[p // bs] for p in range(start, end)]
            slot_o += [p % bs for p in range(start, end)]
            if end == req.num_tokens:
                sample_rows.append(len(tokens) - 1)
                sample_reqs.append(req)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_b, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_o, dtype=torch.long, device=dev),
            seqs=seqs, sliding_window=self.model_cfg.sliding_window)
        return (torch.tensor(tokens, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta,
                torch.tensor(sample_rows, dtype=torch.long, device=dev), sample_reqs)
