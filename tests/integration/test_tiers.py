"""Offload tiers in real worker processes: a colocated worker with host + disk tiers
(`--host-cache-blocks`, `--disk-cache-dir`) offloads finished blocks, publishes them to
the Redis index, and after the worker is restarted on the same directory its disk tier
serves the prompts again — token-identical to transformers."""

import asyncio
import os

import redis

from cluster.launcher import ClusterSpec, LocalCluster
from engine.block_hash import hash_blocks, make_extra_key
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.integration.serving_util import call_http, grpc_generate, metric, wait_for

BS = 4
MAX_TOKENS = 5


def prompt(seed: int, n: int = 38) -> list[int]:
    return [(i * 11 + seed * 97) % 470 + 20 for i in range(n)]


def start(model_dir: str, disk_dir: str, logs: str, extra: tuple[str, ...] = ()) -> LocalCluster:
    # 24 device blocks hold two of these requests: the rest is evicted to host, and
    # the 4-block host tier demotes to disk.
    args = ("--num-blocks", "24", "--block-size", str(BS), "--host-cache-blocks", "4",
            "--disk-cache-dir", disk_dir, "--disk-cache-blocks", "256", *extra)
    c = LocalCluster(ClusterSpec(model_dir=model_dir, num_prefill=0, num_decode=0,
                                 num_colocated=1, worker_args=args, log_dir=logs,
                                 ready_timeout_s=120))
    c.start()
    return c


def worker_metrics_port(c: LocalCluster) -> int:
    return int(next(ch for ch in c.children if ch.name.startswith("colocated"))
               .extra["metrics_port"])


def cached_tokens(c: LocalCluster, ids: list[int]) -> tuple[int, list[int]]:
    status, body, _ = call_http(c.http_port, "POST", "/v1/completions",
                                {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, body
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"]), body


def _fill_disk(c: LocalCluster, prompts: list[list[int]]) -> list[list[int]]:
    """Generates `prompts` on `c`, then pushes their blocks out of host DRAM to disk: a
    later prompt (9 more blocks than the 4-block host holds) demotes every earlier block,
    whatever order the first ones finished in. Returns the first generations."""
    first = asyncio.run(grpc_generate(f"127.0.0.1:{c.grpc_port}", prompts,
                                      [MAX_TOKENS] * len(prompts)))
    asyncio.run(grpc_generate(f"127.0.0.1:{c.grpc_port}", [prompt(99)], [1]))
    mport = worker_metrics_port(c)
    wait_for(lambda: metric(mport, "splitserve:tier_bytes_total", tier="disk",
                            direction="store") > 0, 20, "blocks demoted to disk")
    return first


def test_disk_tier_survives_a_worker_restart(tmp_path) -> None:
    model_dir = tiny_model_dir("llama")
    disk = str(tmp_path / "kv-disk")
    prompts = [prompt(s) for s in range(5)]
    c = start(model_dir, disk, str(tmp_path / "logs1"))
    try:
        first = _fill_disk(c, prompts)
        # The index learns where the offloaded blocks went: every full block of the
        # first prompt ends up on disk (the 4-block host tier demoted it).
        model = os.path.basename(os.path.normpath(model_dir))
        keys = [f"kvidx:{model}:{h.hex()}"
                for h in hash_blocks(prompts[0], BS, make_extra_key(model))]
        r = redis.Redis.from_url(c.redis_url, decode_responses=True)
        wait_for(lambda: all(any(f.endswith("@disk") for f in r.hgetall(k)) for k in keys),
                 20, "the first prompt's blocks on disk in the block index")
    finally:
        c.stop()
    assert any(name.endswith(".kvb") for name in os.listdir(disk))

    c = start(model_dir, disk, str(tmp_path / "logs2"))
    try:
        hit, body = cached_tokens(c, prompts[0])
        assert hit == (len(prompts[0]) - 1) // BS * BS  # every full block, from disk
        mport = worker_metrics_port(c)
        assert metric(mport, "splitserve:tier_hits_total", tier="disk") > 0
        again = asyncio.run(grpc_generate(f"127.0.0.1:{c.grpc_port}", prompts[:1],
                                          [MAX_TOKENS]))
    finally:
        c.stop()
    hf = hf_model(model_dir)
    ref = hf_greedy(hf, prompts[0], MAX_TOKENS, hf.generation_config.eos_token_id)
    assert again[0] == first[0] == ref


def test_calculated_kv_scales_survive_a_restart_with_the_disk_tier(tmp_path) -> None:
    """--kv-cache-dtype fp8 --calculate-kv-scales: the first run calculates its scales and
    records them beside its disk blocks; the restarted worker adopts them instead of
    calculating others, so the blocks it loads from disk read as they were written."""
    model_dir = tiny_model_dir("llama")
    disk = str(tmp_path / "kv-disk")
    extra = ("--kv-cache-dtype", "fp8", "--calculate-kv-scales")
    prompts = [prompt(s) for s in range(5)]
    c = start(model_dir, disk, str(tmp_path / "logs1"), extra)
    try:
        first = _fill_disk(c, prompts)
    finally:
        c.stop()
    assert "kv_scales.json" in os.listdir(disk)
    c = start(model_dir, disk, str(tmp_path / "logs2"), extra)
    try:
        hit, _ = cached_tokens(c, prompts[0])
        assert hit == (len(prompts[0]) - 1) // BS * BS  # every full block, from disk
        again = asyncio.run(grpc_generate(f"127.0.0.1:{c.grpc_port}", prompts[:1],
                                          [MAX_TOKENS]))
        log = next(ch for ch in c.children if ch.name.startswith("colocated")).log_tail(400)
    finally:
        c.stop()
    assert "KV scales adopted" in log and "calculated from the first" not in log
    assert again[0] == first[0]
