"""Peer fetch with real processes: two decode workers, redis-server and the gateway.
A round-robin profile sends a repeated prompt to the worker that does NOT hold it; the
Redis index names the holder, and the decode pulls the prefix's blocks from the
holder's cache over kvtransfer (FetchKV) instead of computing them."""

from __future__ import annotations

import functools

import pytest
import redis

from cluster.launcher import ClusterSpec, LocalCluster
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir
from tests.integration.serving_util import call_http, load_report, metric, wait_for

NUM_BLOCKS = 96
PROMPT = tuple((7 * j) % 480 + 3 for j in range(100))  # 6 full blocks of 16 + 4 tokens
PROFILE = ("routing:\n  scorers: [{name: queue, weight: 1.0}]\n  picker: round_robin\n"
           "  decider: {name: threshold, threshold: 100000}\n  peer_fetch: {min_blocks: 2}\n")


@functools.cache
def offline_text(arch: str, kv_dtype: str, calculated: bool) -> str:
    """The offline engine's greedy text of PROMPT: one per model and cache, whatever the
    transport and TP sizes of the cluster it is checked against."""
    return LLM(tiny_model_dir(arch), num_blocks=NUM_BLOCKS, cache_dtype=kv_dtype,
               calculate_kv_scales=calculated).generate(
        [list(PROMPT)], SamplingParams(max_tokens=10, temperature=0))[0].text


@pytest.mark.parametrize("transport,arch,tp,kv_dtype", [
    ("tcp", "llama", 1, "auto"), ("shm", "llama", 1, "auto"), ("ucx", "llama", 1, "auto"),
    ("tcp", "deepseek_v2", 1, "auto"),  # MLA: the latent blocks, sized by their layout
    ("tcp", "llama", 1, "fp8"),  # an FP8 cache: one byte a value
    # a TP 1 and a TP 2 decode with an FP8 cache: each rank's heads straight between
    # its cache and the other worker's (no staging copy), as bytes
    ("tcp", "llama", (1, 2), "fp8"),
    # --calculate-kv-scales: the holder's scales come from its first request; the puller,
    # which has computed nothing, adopts them with the blocks (FetchKVResponse.kv_scales)
    ("tcp", "llama", 1, "fp8-calculated"),
])
def test_second_decode_pulls_the_prefix_from_the_first(tmp_path, transport, arch, tp,
                                                       kv_dtype) -> None:
    """`tp`: both decodes' TP size, or each one's."""
    from cluster.placement import WorkerPlacement

    (tmp_path / "routing.yaml").write_text(PROFILE)
    model = tiny_model_dir(arch)
    placement = {} if tp == 1 else {
        f"decode-{i}": WorkerPlacement(("--tensor-parallel-size", str(t)))
        for i, t in enumerate(tp)}
    calculated = kv_dtype == "fp8-calculated"
    kv_dtype = kv_dtype.removesuffix("-calculated")
    flags = ("--calculate-kv-scales",) if calculated else ()
    spec = ClusterSpec(model_dir=model, num_decode=2, num_colocated=0, transport=transport,
                       worker_args=("--num-blocks", str(NUM_BLOCKS),
                                    "--kv-cache-dtype", kv_dtype, *flags), placement=placement,
                       gateway_args=("--routing", str(tmp_path / "routing.yaml")),
                       ready_timeout_s=150, log_dir=str(tmp_path / "logs"))
    prompt, want = list(PROMPT), offline_text(arch, kv_dtype, calculated)
    with LocalCluster(spec) as cluster:
        name = model.rstrip("/").rsplit("/", 1)[-1]
        body = {"model": name, "prompt": prompt, "max_tokens": 10, "temperature": 0}
        status, first, _ = call_http(cluster.http_port, "POST", "/v1/completions", body)
        assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        r = redis.Redis.from_url(cluster.redis_url, socket_timeout=2)
        wait_for(lambda: len(r.keys(f"kvidx:{name}:*")) >= 6, 5, "the index to hold the blocks")
        status, second, _ = call_http(cluster.http_port, "POST", "/v1/completions", body)
        assert status == 200
        # Same greedy text; the 6 full blocks came from the peer, not from compute.
        assert first["choices"][0]["text"] == second["choices"][0]["text"] == want
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        decodes = [c for c in cluster.children if c.name.startswith("decode")]
        ports = {c.name: int(c.extra["metrics_port"]) for c in decodes}
        pulled = {n: metric(p, "splitserve:peer_fetch_total", outcome="ok")
                  for n, p in ports.items()}
        served = {n: metric(p, "splitserve:peer_fetch_served_total", outcome="ok")
                  for n, p in ports.items()}
        assert sorted(pulled.values()) == [0, 1] and sorted(served.values()) == [0, 1]
        assert [n for n, v in pulled.items() if v] != [n for n, v in served.items() if v]
        sent = sum(metric(p, "splitserve:kv_transfer_bytes_total", role="sender")
                   for p in ports.values())
        assert sent > 0
        assert sum(metric(p, "splitserve:kv_staging_blocks_total") for p in ports.values()) == 0
        if arch == "deepseek_v2":  # the 6 blocks' latents: (32 + 16) x 3 layers x 4 bytes
            assert sent == 96 * (32 + 16) * 3 * 4
        if kv_dtype == "fp8":  # K and V x 2 layers x 2 heads x 16 dims x 1 byte
            assert sent == 96 * 2 * 2 * 2 * 16
        # Pins released, nothing leaked on either worker.
        wait_for(lambda: all(load_report(c.grpc_address).num_free_blocks == NUM_BLOCKS
                             for c in decodes), 10, "every block free on both decodes")
        # The puller now holds the prefix itself: a third request is a local hit, wherever
        # round-robin sends it.
        status, third, _ = call_http(cluster.http_port, "POST", "/v1/completions", body)
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        r.close()


def test_pin_cached_holds_blocks_until_unpinned() -> None:
    llm = LLM(tiny_model_dir("llama"), num_blocks=16, block_size=16)
    prompt = list(range(5, 70))  # 4 full blocks
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    eng = llm.engine
    from engine.block_hash import hash_blocks, make_extra_key

    hashes = hash_blocks(prompt, 16, make_extra_key(eng.model_id, None))
    ids = eng.pin_cached(hashes + [b"\x00" * 16])
    assert len(ids) == 4  # the leading run it holds, not the unknown fifth
    eng.check_integrity()
    # Pinned blocks survive pressure that needs every other block.
    other = [list(range(200 + 60 * i, 260 + 60 * i)) for i in range(3)]
    llm.generate(other, SamplingParams(max_tokens=1, temperature=0))
    assert [eng.kv.pool.get_cached_block(h).block_id for h in hashes] == ids
    eng.unpin(ids)
    eng.check_integrity()
    assert eng.kv.pool.num_free_blocks == 16
