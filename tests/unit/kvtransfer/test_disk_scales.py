"""The disk tier keeps the float8 scales its blocks were written under (kv_scales.json):
a later process with --calculate-kv-scales adopts them and reads the blocks back as
written; one whose fixed scales differ is refused; blocks without a record are the
checkpoint's scales'."""

from __future__ import annotations

import os
import random

import pytest

from engine.llm import LLM, make_engine_config
from engine.sampling_params import SamplingParams
from kvtransfer.tiers import TierConfig
from kvtransfer.tiers.disk import SCALES_FILE
from kvtransfer.tiers.disk_scales import bind_disk_scales
from kvtransfer.tiers.manager import TieredCache, engine_layout
from tests.factories import tiny_model_dir

D = tiny_model_dir("llama")
KW = dict(dtype="float32", block_size=4, num_blocks=16, cache_dtype="fp8")
rng = random.Random(7)
PROMPTS = [[rng.randrange(5, 500) for _ in range(26)] for _ in range(3)]
PARAMS = SamplingParams(max_tokens=6, temperature=0)


def run(directory: str, calculate: bool, prompts: list[list[int]] = PROMPTS):
    """One process's life over the disk tier in `directory`: (its greedy tokens, its
    scales, blocks loaded from disk)."""
    layout = engine_layout(make_engine_config(D, **KW))
    with TieredCache(TierConfig(disk_dir=directory, disk_blocks=64), layout) as tiers:
        llm = LLM(D, offload=tiers, calculate_kv_scales=calculate, **KW)
        bind_disk_scales(tiers, llm.engine.runner)
        tokens = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        assert tiers.wait_idle(10.0)
        hits = tiers.stats().hits.get("disk", 0)
        return tokens, llm.engine.runner.kv_scales.values(), hits


def test_a_restart_adopts_the_recorded_scales(tmp_path) -> None:
    # a first prompt of its own: the second run's first forward is a different one
    first, scales, _ = run(str(tmp_path), True, [[9, 8, 7, 6, 5]] + PROMPTS)
    assert os.path.exists(tmp_path / SCALES_FILE)
    again, scales2, hits2 = run(str(tmp_path), True)
    assert hits2 >= 3 * 6  # every prompt's 6 full blocks came back from disk
    assert scales2 == scales  # adopted, not calculated again
    assert again == first[1:]
    with pytest.raises(ValueError, match="other float8 scales.*--calculate-kv-scales"):
        run(str(tmp_path), False)  # the checkpoint's scales (1.0) cannot read them


def test_blocks_without_a_record_are_the_checkpoints(tmp_path) -> None:
    fixed, scales, _ = run(str(tmp_path), False)
    assert scales == [(1.0, 1.0)] * 2
    os.unlink(tmp_path / SCALES_FILE)  # as a run that kept no record
    again, scales2, hits = run(str(tmp_path), True)
    assert hits >= 3 * 6 and scales2 == scales and again == fixed
