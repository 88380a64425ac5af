"""Disaggregated serving with real processes: redis-server, one prefill and one decode
worker and the gateway (cluster.launcher, as `splitserve up` starts them). The routing
profile sends every prompt to the prefill worker (decider threshold 0), so every
request's KV crosses the transport under test into the decode's paged cache.

The llama cluster over tcp serves every test at the end of this file (one start-up);
the last of them kills its prefill worker."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import openai
import pytest

from cluster.launcher import LocalCluster
from engine.config import ModelConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from tests.factories import hf_greedy, hf_model, one_token_word, tiny_model_dir
from tests.integration.disagg_util import (
    NUM_BLOCKS,
    all_blocks_free,
    child,
    decode_metrics,
    generate_remotely,
    logs,
    mixed_prompts,
    shm_left_behind,
    start_cluster,
    transformers_greedy,
)
from tests.integration.serving_util import (
    grpc_generate,
    load_report,
    metric,
    stream_then_hang_up,
    wait_for,
)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(tiny_model_dir("llama"), num_blocks=NUM_BLOCKS, max_num_seqs=32,
               max_num_batched_tokens=64)


def _greedy_equals_offline(cluster: LocalCluster, offline: LLM) -> list[Any]:
    """Mixed prompts, every one prefilled remotely, then one streamed through the OpenAI
    SDK: the offline engine's greedy tokens. Returns the offline engine's outputs."""
    prompts, max_tokens = mixed_prompts()
    ref = offline.generate(prompts, [SamplingParams(max_tokens=m, temperature=0)
                                     for m in max_tokens])
    got, moved = generate_remotely(cluster, prompts, max_tokens)
    assert got == [r.token_ids for r in ref], logs(cluster)
    assert moved > 0
    # The OpenAI SDK, streaming, through the same path.
    model = os.path.basename(cluster.spec.model_dir)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1",
                      api_key="none", timeout=60, max_retries=0)
    chunks = c.completions.create(model=model, prompt=prompts[3], max_tokens=max_tokens[3],
                                  temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref[3].text
    wait_for(lambda: all_blocks_free(cluster), 10, "every block free on both workers")
    return ref


@pytest.mark.parametrize("transport", ["shm", "ucx"])  # tcp: the shared cluster below
def test_greedy_through_remote_prefill_equals_offline(tmp_path, offline, transport) -> None:
    cluster = start_cluster(tmp_path, transport)
    try:
        _greedy_equals_offline(cluster, offline)
    finally:
        cluster.stop()
    assert not shm_left_behind(cluster), "shared-memory segments left behind"


def test_mixture_of_experts_through_remote_prefill_equals_transformers(tmp_path) -> None:
    """Qwen3-MoE's KV (experts in the MLPs, nothing different in the cache) prefilled on
    one worker, decoded on the other: transformers' greedy tokens."""
    prompts, max_tokens = mixed_prompts()
    picked = [3, 7, 9, 13]  # 9 shares 7's prefix
    prompts, max_tokens = [prompts[i] for i in picked], [max_tokens[i] for i in picked]
    cluster = start_cluster(tmp_path, "tcp", arch="qwen3_moe")
    try:
        got, _ = generate_remotely(cluster, prompts, max_tokens)
    finally:
        cluster.stop()
    hf = hf_model(tiny_model_dir("qwen3_moe"))
    eos = ModelConfig.from_model_dir(tiny_model_dir("qwen3_moe")).eos_token_ids
    for p, m, g in zip(prompts, max_tokens, got, strict=True):
        assert g == hf_greedy(hf, p, m, eos[0] if eos else None)


@pytest.mark.parametrize("transport", ["tcp", "shm", "ucx"])
def test_deepseek_latent_kv_through_remote_prefill_equals_transformers(tmp_path,
                                                                       transport) -> None:
    """DeepSeek-V2's MLA cache (one latent + rope key per token per layer) prefilled on
    one worker, decoded on the other: transformers' greedy tokens, and exactly the
    latent layout's bytes per token crossed the transport."""
    from kvtransfer.layout import KVLayout

    model_dir = tiny_model_dir("deepseek_v2")
    # whole 16-token blocks, no shared prefixes: every prompt token's KV is sent once
    prompts = [[(13 * i + 7 * j) % 480 + 5 for j in range(n)]
               for i, n in enumerate((16, 48, 32, 80))]
    max_tokens = [6, 9, 5, 8]
    cluster = start_cluster(tmp_path, transport, arch="deepseek_v2")
    try:
        got, moved = generate_remotely(cluster, prompts, max_tokens)
    finally:
        cluster.stop()
    cfg = ModelConfig.from_model_dir(model_dir)
    assert cfg.mla is not None
    per_token = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * cfg.num_layers * 4
    layout = KVLayout.from_json(_layout_json(model_dir))
    assert layout.name == "mla_latent_v1" and layout.token_bytes == per_token
    assert moved == sum(len(p) for p in prompts) * per_token
    want = transformers_greedy(model_dir, prompts, max_tokens)
    for g, w in zip(got, want, strict=True):
        assert g == w


def test_fp8_kv_through_remote_prefill_over_tcp(tmp_path) -> None:
    """Workers with --kv-cache-dtype fp8: the prefill's float8 blocks cross tcp into the
    decode's float8 cache, one byte a value (a quarter of the float32 cache's bytes per
    token), and greedy output equals the offline engine with the same FP8 cache."""
    model_dir = tiny_model_dir("llama")
    prompts = [[(13 * i + 7 * j) % 480 + 5 for j in range(n)]
               for i, n in enumerate((16, 48, 32, 80))]
    max_tokens = [6, 9, 5, 8]
    offline = LLM(model_dir, num_blocks=NUM_BLOCKS, max_num_seqs=32,
                  max_num_batched_tokens=64, cache_dtype="fp8")
    ref = offline.generate(prompts, [SamplingParams(max_tokens=m, temperature=0)
                                     for m in max_tokens])
    cluster = start_cluster(tmp_path, "tcp", ("--kv-cache-dtype", "fp8"))
    try:
        got, moved = generate_remotely(cluster, prompts, max_tokens)
    finally:
        cluster.stop()
    assert got == [r.token_ids for r in ref]
    cfg = ModelConfig.from_model_dir(model_dir)
    fp32_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert moved == sum(len(p) for p in prompts) * fp32_per_token // 4


def test_calculated_kv_scales_travel_with_the_prefills_blocks(tmp_path) -> None:
    """Both workers with --calculate-kv-scales: the prefill's scales come from its first
    request; the decode, which has computed nothing when that request's blocks land,
    adopts them from the PrefillResponse. Greedy output equals the offline engine whose
    first forward pass is the same (the first prompt alone, the same chunk size)."""
    model_dir = tiny_model_dir("llama")
    prompts = [[(13 * i + 7 * j) % 480 + 5 for j in range(n)]
               for i, n in enumerate((100, 48, 32, 80))]
    max_tokens = [6, 9, 5, 8]
    offline = LLM(model_dir, num_blocks=NUM_BLOCKS, max_num_seqs=32,
                  max_num_batched_tokens=64, cache_dtype="fp8", calculate_kv_scales=True)
    ref = [o.token_ids for o in offline.generate(prompts[:1], SamplingParams(
        max_tokens=max_tokens[0], temperature=0))]
    ref += [o.token_ids for o in offline.generate(prompts[1:], [SamplingParams(
        max_tokens=m, temperature=0) for m in max_tokens[1:]])]
    cluster = start_cluster(tmp_path, "tcp", ("--kv-cache-dtype", "fp8",
                                              "--calculate-kv-scales"))
    try:
        got, _ = generate_remotely(cluster, prompts[:1], max_tokens[:1])
        more, _ = generate_remotely(cluster, prompts[1:], max_tokens[1:])
    finally:
        cluster.stop()
    assert got + more == ref, logs(cluster)
    assert "KV scales adopted" in child(cluster, "decode-0").log_tail(200)


def _layout_json(model_dir: str) -> str:
    from engine.llm import make_engine_config
    from kvtransfer.layout import engine_layout

    return engine_layout(make_engine_config(model_dir, dtype="float32")).to_json()


@pytest.fixture(scope="module")
def tcp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The llama cluster over tcp the tests below share; a short prefill timeout for the
    fault checks of the last one."""
    cluster = start_cluster(tmp_path_factory.mktemp("disagg-tcp"), "tcp",
                            ("--prefill-timeout", "20"))
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not shm_left_behind(cluster), "shared-memory segments left behind"


def test_greedy_over_tcp_equals_offline_and_transformers(tcp_cluster, offline) -> None:
    ref = _greedy_equals_offline(tcp_cluster, offline)
    # the offline engine is transformers' greedy (spot check)
    prompts, max_tokens = mixed_prompts()
    hf = hf_model(tiny_model_dir("llama"))
    eos = offline.engine.eos_token_ids[0] if offline.engine.eos_token_ids else None
    for i in (3, 9, 15):
        assert hf_greedy(hf, prompts[i], max_tokens[i], eos) == ref[i].token_ids


def test_samples_logprobs_and_echo_through_remote_prefill(tcp_cluster, offline) -> None:
    """n seeded samples, echo + logprobs and a prompt list through the prefill worker:
    the prefill draws every sample's first token from its one prefill and computes the
    prompt's logprobs; the decode forks the samples. Same numbers as the offline engine
    (itself transformers', tests/unit/engine/test_parallel_sampling.py)."""
    from tests.integration.serving_util import call_http, ttft_parts

    cluster = tcp_cluster
    port, model = cluster.http_port, os.path.basename(cluster.spec.model_dir)
    metrics = decode_metrics(cluster)
    prefill = child(cluster, "prefill-0").grpc_address
    prompt = [(19 * j) % 470 + 7 for j in range(45)]
    before = load_report(prefill).prefix_cache_queries
    remote = metric(metrics, "splitserve:remote_prefill_total", outcome="ok")
    _, r, headers = call_http(port, "POST", "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 5, "temperature": 1.0, "n": 3,
        "seed": 77, "logprobs": 1}, headers={"x-splitserve-ttft": "1"})
    # The first token's breakdown: computed on the prefill worker, its KV landed here.
    ttft = ttft_parts(headers["x-splitserve-ttft"])
    assert set(ttft) == {"queue", "route", "worker_queue", "prefill", "kv_transfer",
                         "total"}, ttft
    assert ttft["prefill"] > 0 and min(ttft.values()) >= 0
    assert sum(v for k, v in ttft.items() if k != "total") <= ttft["total"] + 1.0
    ref = offline.generate([prompt], SamplingParams(max_tokens=5, temperature=1.0, n=3,
                                                    seed=77, logprobs=1))
    assert [c["text"] for c in r["choices"]] == [o.text for o in ref], logs(cluster)
    for c, o in zip(r["choices"], ref):
        assert all(abs(a - b[t]) < 1e-4 for a, b, t in zip(
            c["logprobs"]["token_logprobs"], o.logprobs, o.token_ids))
    assert load_report(prefill).prefix_cache_queries - before == len(prompt)  # 1 prefill
    assert metric(metrics, "splitserve:remote_prefill_total", outcome="ok") == remote + 1
    # echo + logprobs: the prompt's logprobs computed on the prefill worker.
    _, r, _ = call_http(port, "POST", "/v1/completions", {
        "model": model, "prompt": [prompt[:30], prompt[5:40]], "max_tokens": 3,
        "temperature": 0, "echo": True, "logprobs": 2})
    refs = offline.generate([prompt[:30], prompt[5:40]], SamplingParams(
        max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2))
    for c, o in zip(r["choices"], refs):
        got = c["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(o.prompt_token_ids) + 3
        want = [lp[t] for lp, t in zip(o.prompt_logprobs + o.logprobs,
                                       o.prompt_token_ids[1:] + o.token_ids)]
        assert all(abs(a - b) < 1e-4 for a, b in zip(got[1:], want)), logs(cluster)
        # vLLM's prompt_logprobs: the prompt token's rank came through the hand-off.
        ranks = [e[str(t)]["rank"] for e, t in zip(c["prompt_logprobs"][1:],
                                                    o.prompt_token_ids[1:], strict=True)]
        assert ranks == [getattr(lp, "rank", None) for lp in o.prompt_logprobs]
    assert metric(metrics, "splitserve:remote_prefill_total", outcome="ok") == remote + 3
    wait_for(lambda: all_blocks_free(cluster), 10, "every block free on both workers")


def test_token_masks_through_remote_prefill(tcp_cluster, offline) -> None:
    """allowed_token_ids and bad_words hold on both sides of the hand-off: the prefill
    worker draws the first token of every sample under them, the decode worker the rest
    (n = 3 seeded samples forked there), so the outputs are the offline engine's."""
    from tests.integration.serving_util import call_http

    cluster = tcp_cluster
    port, model = cluster.http_port, os.path.basename(cluster.spec.model_dir)
    metrics = decode_metrics(cluster)
    remote = metric(metrics, "splitserve:remote_prefill_total", outcome="ok")
    prompt = [(23 * j) % 470 + 9 for j in range(40)]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}

    def complete(extra: dict[str, Any]) -> list[list[int]]:
        status, r, _ = call_http(port, "POST", "/v1/completions", body | extra)
        assert status == 200, (r, logs(cluster))
        return [c["token_ids"] for c in r["choices"]]

    plain = complete({})[0]
    # The first token (the prefill's) is not allowed: it must come from the allowed ids.
    allowed = sorted({plain[1], plain[2], 7, 11} - {plain[0]})
    got = complete({"allowed_token_ids": allowed})[0]
    ref = offline.generate([prompt], replace(greedy, allowed_token_ids=allowed))[0]
    assert got == ref.token_ids and set(got) <= set(allowed) and got[0] != plain[0]
    sampled = {"temperature": 1.0, "seed": 5, "n": 3}
    free = complete(sampled)
    tok = offline.tokenizer
    vocab = offline.engine.model_config.vocab_size
    # A one-token word that a sample drew first, on the prefill worker.
    word, first = one_token_word(tok, [s[0] for s in free], vocab)
    got_n = complete(sampled | {"bad_words": [word]})
    ref_n = offline.generate([prompt], replace(greedy, temperature=1.0, seed=5, n=3,
                                               bad_words=[word]))
    assert got_n == [o.token_ids for o in ref_n] != free, logs(cluster)
    assert not any(first in ids for ids in got_n)
    assert metric(metrics, "splitserve:remote_prefill_total", outcome="ok") == remote + 4
    wait_for(lambda: all_blocks_free(cluster), 10, "every block free on both workers")


def test_disconnect_frees_blocks_on_both_workers_and_killed_prefill_is_recomputed(
        tcp_cluster, offline) -> None:
    """Last user of the shared cluster: it leaves the prefill worker dead."""
    cluster = tcp_cluster
    _disconnect_mid_stream(cluster)
    wait_for(lambda: all_blocks_free(cluster), 10, "free blocks after the disconnect")
    _deadline_during_prefill(cluster)
    wait_for(lambda: all_blocks_free(cluster), 10, "free blocks after the deadline")
    _kill_prefill_while_decode_waits(cluster, offline)
    wait_for(lambda: load_report(child(cluster, "decode-0").grpc_address).num_free_blocks
             == NUM_BLOCKS, 10, "the decode's blocks free after the recompute")


def _disconnect_mid_stream(cluster: LocalCluster) -> None:
    metrics = decode_metrics(cluster)
    aborted = metric(metrics, "vllm:request_success_total", finished_reason="abort")
    remote = metric(metrics, "splitserve:remote_prefill_total", outcome="ok")
    stream_then_hang_up(cluster.http_port, {
        "prompt": [i % 400 + 3 for i in range(150)], "max_tokens": 700, "ignore_eos": True,
        "temperature": 0}, events=3)
    wait_for(lambda: metric(metrics, "vllm:request_success_total",
                            finished_reason="abort") >= aborted + 1, 10, "the decode to abort")
    assert metric(metrics, "splitserve:remote_prefill_total", outcome="ok") == remote + 1


def _deadline_during_prefill(cluster: LocalCluster) -> None:
    """The deadline passes while the prefill worker is stalled (SIGSTOP) inside the
    Prefill call: the gateway cancels the decode's stream, the decode cancels its Prefill
    call and fences the transfer; resumed, the prefill worker drops the call. Both free
    their blocks (checked by the caller)."""
    prompt = [(3 * j) % 450 + 1 for j in range(300)]
    metrics = decode_metrics(cluster)
    failures = metric(metrics, "splitserve:kv_transfer_failures_total")
    prefill = child(cluster, "prefill-0")
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(max_tokens=20, temperature=0.0))
            with pytest.raises(grpc.RpcError) as ei:
                list(pb_grpc.GenerateStub(ch).Generate(req, timeout=2.5))
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    # Fenced as cancelled or, as the lease is the caller's remaining time, timed out.
    wait_for(lambda: metric(metrics, "splitserve:kv_transfer_failures_total") >= failures + 1,
             10, "the decode to fence the transfer")


def _kill_prefill_while_decode_waits(cluster: LocalCluster, offline: LLM) -> None:
    """The prefill worker hangs (SIGSTOP) with a Prefill call pending, then dies
    (SIGKILL): the decode sees the call fail, fences the transfer and prefills itself."""
    metrics = decode_metrics(cluster)
    prompt = [(5 * j) % 300 + 2 for j in range(120)]
    ref = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    victim = child(cluster, "prefill-0")
    # earlier requests of this cluster may have recomputed too (a prefill timeout on a busy
    # machine): this request's own recompute is the difference
    before = metric(metrics, "splitserve:remote_prefill_total", outcome="recompute")
    os.kill(victim.proc.pid, signal.SIGSTOP)
    result: list[list[int]] = []
    t = threading.Thread(target=lambda: result.extend(
        asyncio.run(grpc_generate(f"127.0.0.1:{cluster.grpc_port}", [prompt], [12]))))
    t.start()
    try:
        # The decode has allocated the prompt's blocks and is waiting on the peer.
        wait_for(lambda: load_report(child(cluster, "decode-0").grpc_address).num_free_blocks
                 < NUM_BLOCKS, 10, "the decode to allocate blocks for the remote prefill")
        time.sleep(0.3)
    finally:
        os.kill(victim.proc.pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    assert result == [ref.token_ids], logs(cluster)
    assert metric(metrics, "splitserve:remote_prefill_total",
                  outcome="recompute") == before + 1
