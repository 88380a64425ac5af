"""Offline batch generation: `LLM(model_dir).generate(prompts, sampling)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, RequestError
from engine.offload import KVOffload
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | Sequence[int]


def make_engine_config(model_dir: str, **kw: Any) -> EngineConfig:
    """EngineConfig from flat keyword arguments (block_size=, num_blocks=, ...)."""
    cache_keys = set(CacheConfig.__dataclass_fields__)
    sched_keys = set(SchedulerConfig.__dataclass_fields__)
    cache = CacheConfig(**{k: kw.pop(k) for k in list(kw) if k in cache_keys})
    sched = SchedulerConfig(**{k: kw.pop(k) for k in list(kw) if k in sched_keys})
    return EngineConfig(model_dir=model_dir, cache=cache, scheduler=sched, **kw)


class LLM:
    """Runs many prompts to completion with continuous batching.

    Keyword arguments go to EngineConfig, CacheConfig and SchedulerConfig
    (e.g. `LLM(d, dtype="float32", num_blocks=64, max_num_batched_tokens=256)`).
    """

    def __init__(self, model_dir: str, offload: KVOffload | None = None, **kw: Any) -> None:
        self.engine = LLMEngine(make_engine_config(model_dir, **kw), offload=offload)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Returns one finished output per prompt, in order (n of them, by sample index,
        for a prompt sampled with n / best_of). A prompt the engine rejects gets finish_reason "error" with the reason; the others still run."""
        plist: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            plist = [prompts]  # type: ignore[list-item]
        else:
            plist = list(prompts)  # type: ignore[arg-type]
        if sampling is None:
            sampling = SamplingParams()
        params = [sampling] * len(plist) if isinstance(sampling, SamplingParams) \
            else list(sampling)
        if len(params) != len(plist):
            raise ValueError("one SamplingParams per prompt, or one for all")
        results: dict[str, list[RequestOutput]] = {}
        order = []
        for prompt, p in zip(plist, params, strict=True):
            rid = f"offline-{next(self._ids)}"
            order.append(rid)
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) \
                else [int(t) for t in prompt]
            try:
                # only the finished outputs are kept: no output per step at all
                self.engine.add_request(rid, ids,
                                        replace(p, output_kind=RequestOutputKind.FINAL_ONLY))
            except RequestError as e:
                results[rid] = [RequestOutput(rid, ids, finished=True, finish_reason="error",
                                              error=str(e))]
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finish_reason is not None:  # a sample ended
                    results.setdefault(out.request_id, []).append(out)
        return [o for rid in order for o in sorted(results[rid], key=lambda o: o.index)]
