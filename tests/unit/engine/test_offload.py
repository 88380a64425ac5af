"""The engine with offload tiers: prompts run, device pressure evicts their cached
blocks, the reruns load them back from host / disk / LMCache, and greedy outputs stay
token-identical to transformers. No block leaks, including while copies are in flight
and when a load comes up short."""

import random

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvtransfer.tiers import LMCacheTierConfig, TierConfig
from kvtransfer.tiers.host import HostTier
from kvtransfer.tiers.manager import TieredCache, engine_layout
from tests.factories import hf_greedy, hf_model, tiny_model_dir

BS = 4
MAX_TOKENS = 6
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def model():
    d = tiny_model_dir("llama")
    hf = hf_model(d)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(26)] for _ in range(4)]
    eos = hf.generation_config.eos_token_id
    ref = [hf_greedy(hf, p, MAX_TOKENS, eos) for p in prompts]
    return d, prompts, ref


def make_llm(model_dir: str, tiers: TieredCache) -> LLM:
    # 16 blocks hold ~2 requests: later prompts evict earlier prompts' cached blocks.
    return LLM(model_dir, offload=tiers, dtype="float32", block_size=BS, num_blocks=16)


def layout_of(model_dir: str):
    from engine.llm import make_engine_config

    return engine_layout(make_engine_config(model_dir, dtype="float32", block_size=BS))


def assert_no_leaks(llm: LLM) -> None:
    llm.engine.check_integrity()
    st = llm.engine.stats()
    assert st.num_free_blocks == st.num_blocks  # idle: nothing held, copies done


def run_twice(model, tiers: TieredCache, tier: str, llm: LLM | None = None) -> None:
    model_dir, prompts, ref = model
    llm = llm or make_llm(model_dir, tiers)
    first = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in first] == ref
    assert_no_leaks(llm)
    assert tiers.wait_idle(10.0)
    second = llm.generate(prompts, PARAMS)
    assert [o.token_ids for o in second] == ref  # KV came from the tier
    s = tiers.stats()
    assert s.hits.get(tier, 0) >= 4, s
    assert s.bytes_loaded[tier] == s.hits[tier] * tiers.layout.block_bytes
    # The first prompt's blocks were evicted from the device by the others, so its
    # rerun hit (6 full blocks; the last block's token is always computed).
    assert second[0].num_cached_tokens == 24
    assert_no_leaks(llm)
    tiers.check_integrity()


def test_host_tier_hits_match_transformers(model):
    with TieredCache(TierConfig(host_blocks=64), layout_of(model[0])) as tiers:
        run_twice(model, tiers, "host")


def test_disk_tier_hits_match_transformers(model, tmp_path):
    cfg = TierConfig(disk_dir=str(tmp_path), disk_blocks=64)
    with TieredCache(cfg, layout_of(model[0])) as tiers:
        run_twice(model, tiers, "disk")


def test_host_evicts_to_disk_and_both_serve_hits(model, tmp_path):
    cfg = TierConfig(host_blocks=6, disk_dir=str(tmp_path), disk_blocks=64)
    with TieredCache(cfg, layout_of(model[0])) as tiers:
        run_twice(model, tiers, "disk")
        assert tiers.stats().evictions["host"] > 0


def test_lmcache_tier_hits_match_transformers(model):
    from kvtransfer.tiers.lmcache_tier import IMPORT_ERROR

    if IMPORT_ERROR is not None:
        pytest.skip(f"LMCache is not importable: {IMPORT_ERROR}")
    cfg = TierConfig(lmcache=LMCacheTierConfig(
        instance_id="engine-test", overrides=(("local_cpu", True),
                                              ("max_local_cpu_size", 0.05))))
    with TieredCache(cfg, layout_of(model[0])) as tiers:
        run_twice(model, tiers, "lmcache")


class ShortHostTier(HostTier):
    """Loses every block after the first of each get (as if evicted meanwhile)."""

    def get(self, hashes, dst):
        return super().get(hashes[:1], dst[:1])


def test_short_load_is_computed_instead(model):
    model_dir, prompts, ref = model
    layout = layout_of(model_dir)
    with TieredCache(TierConfig(host_blocks=64), layout,
                     tiers=[ShortHostTier(layout, 64, pin_memory=False)]) as tiers:
        llm = make_llm(model_dir, tiers)
        llm.generate(prompts, PARAMS)
        assert tiers.wait_idle(10.0)
        second = llm.generate(prompts, PARAMS)
        assert [o.token_ids for o in second] == ref
        assert second[0].num_cached_tokens == BS  # only the block that landed counts
        assert_no_leaks(llm)


def test_remote_allocation_loads_tier_hits_first(model):
    """Decode side of disaggregation: blocks the tiers hold are loaded into the
    request's blocks before a remote prefill is asked for the rest."""
    model_dir, prompts, ref = model
    with TieredCache(TierConfig(host_blocks=64), layout_of(model_dir)) as tiers:
        llm = make_llm(model_dir, tiers)
        llm.generate(prompts, PARAMS)
        assert tiers.wait_idle(10.0)
        eng = llm.engine
        alloc = eng.add_remote_request("r0", prompts[0], PARAMS)
        assert alloc is not None and alloc.num_computed_tokens == 24
        assert len(alloc.missing_block_ids) == 1
        host = tiers.tiers[0]
        for h, b in zip(eng.scheduler.requests["r0"].block_hashes[:6], alloc.block_ids):
            assert torch.equal(eng.runner.kv_cache[b], host.view(h))
        eng.finish_remote("r0", None)  # remote prefill failed: the rest runs locally
        outs = []
        while eng.has_work():
            outs += [o for o in eng.step() if o.finished]
        assert [o.token_ids for o in outs] == [ref[0]]
        assert_no_leaks(llm)


@pytest.mark.gpu
def test_host_tier_with_a_cuda_kv_cache(model, tmp_path):
    """Pinned host buffers, the save thread's own stream waiting on the step's event,
    and loads synchronized before host slots can be reused."""
    model_dir, prompts, ref = model
    cfg = TierConfig(host_blocks=6, disk_dir=str(tmp_path), disk_blocks=64)
    with TieredCache(cfg, layout_of(model_dir)) as tiers:
        assert tiers.tiers[0].pinned
        llm = LLM(model_dir, offload=tiers, dtype="float32", block_size=BS, num_blocks=16,
                  device="cuda")
        assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == ref
        assert tiers.wait_idle(10.0)
        assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == ref
        assert tiers.stats().hits.get("disk", 0) > 0
        assert_no_leaks(llm)


def test_tensor_parallel_host_tier_hits_match_transformers(model):
    """TP 2 (gloo, one KV head a rank): the tier keeps full-head blocks (a TP 1 layout's
    bytes), read from both ranks' caches on save and written into them on load, with
    no block through rank 0's staging copy."""
    model_dir = model[0]
    with TieredCache(TierConfig(host_blocks=64), layout_of(model_dir)) as tiers:
        llm = LLM(model_dir, offload=tiers, dtype="float32", block_size=BS, num_blocks=16,
                  tensor_parallel_size=2)
        try:
            run_twice(model, tiers, "host", llm)
            assert llm.engine.runner.staged_blocks == 0
        finally:
            llm.engine.runner.close()
