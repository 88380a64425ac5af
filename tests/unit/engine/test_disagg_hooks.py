"""The engine's disaggregation hooks, two engines in one process: a decode engine parks
a request in WAITING_FOR_REMOTE_KV with blocks allocated, a producer engine prefills it
(holding its blocks until released) and the KV is copied block for block between the
two caches. The services do the same over kvtransfer."""

import asyncio
from dataclasses import replace

import pytest

from engine.async_llm import AsyncLLM, RemoteResult
from engine.llm import LLM, make_engine_config
from engine.llm_engine import RemoteAlloc
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir

BS = 4


class CallHandoff:
    """A hand-off connector whose fill runs the request's own coroutine function (its
    `kv_params`): the first token, None (computed here) or a raise."""

    async def fill(self, alloc: RemoteAlloc, params) -> RemoteResult:
        got = await params(alloc)
        return got if isinstance(got, RemoteResult) else RemoteResult(first_token=got)


def make_async(**kw) -> AsyncLLM:
    return AsyncLLM(make_engine_config(tiny_model_dir("llama"), dtype="float32",
                                       block_size=BS, num_blocks=96, **kw),
                    handoff=CallHandoff())


async def remote_prefill(p: AsyncLLM, d: AsyncLLM, alloc: RemoteAlloc, prompt: list[int],
                         log: list, params: SamplingParams | None = None) -> int:
    """Prefills on `p`; copies each finished block into `d` as chunks complete. `params`:
    the request's (its first token sampled as it says); default greedy."""
    if params is None:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    params = replace(params, max_tokens=1)
    first = None
    sent = alloc.num_computed_tokens // BS  # blocks below this were a local hit on d
    async for out in p.generate("p-" + alloc.request_id, prompt, params, hold_kv=True):
        done_blocks = -(-out.num_computed_tokens // BS) if out.finished \
            else out.num_computed_tokens // BS
        for i in range(sent, done_blocks):
            d.engine.runner.kv_cache[alloc.block_ids[i]].copy_(
                p.engine.runner.kv_cache[out.block_ids[i]])
        log.append((sent, done_blocks))
        sent = done_blocks
        if out.finished:
            first = out.token_ids[0]
    p.release("p-" + alloc.request_id)
    return first


def test_remote_prefill_matches_local_and_frees_everything():
    prompts = [list(range(10, 15)), list(range(10, 27)), list(range(100, 130)),
               list(range(100, 128)) + [7, 8]]
    params = SamplingParams(max_tokens=10, temperature=0)
    ref = [o.token_ids for o in LLM(tiny_model_dir("llama"), dtype="float32",
                                    block_size=BS).generate(prompts, params)]

    async def main():
        p, d = make_async(max_num_batched_tokens=8), make_async()
        try:
            logs: list[list] = [[] for _ in prompts]

            async def one(i):
                async def remote(alloc):
                    return await remote_prefill(p, d, alloc, prompts[i], logs[i])
                outs = [o async for o in d.generate(f"r{i}", prompts[i], params,
                                                    kv_params=remote)]
                return outs[-1]

            outs = [await one(0), await one(1), await one(2), await one(3)]
            assert [o.token_ids for o in outs] == ref
            assert len(logs[2]) > 2  # 30 tokens in 8-token chunks: sent chunk by chunk
            # The last prompt shares 28 tokens (7 blocks) with the third: a local hit on
            # the decode, so only the remaining blocks were sent.
            assert outs[3].num_cached_tokens == 28 and logs[3][0][0] == 7
            for eng in (p, d):
                await eng.call(lambda e: e.check_integrity())
                st = eng.stats()
                assert st.num_free_blocks == st.num_blocks
        finally:
            p.shutdown()
            d.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("outcome", ["recompute", "fail", "cancel"])
def test_remote_failure_policies(outcome):
    prompt = list(range(20, 45))
    params = SamplingParams(max_tokens=6, temperature=0)
    ref = LLM(tiny_model_dir("llama"), dtype="float32", block_size=BS).generate(
        [prompt], params)[0].token_ids

    async def main():
        d = make_async()
        started = asyncio.Event()
        try:
            async def remote(alloc):
                started.set()
                if outcome == "recompute":
                    return None  # e.g. the transfer failed: prefill locally
                if outcome == "fail":
                    raise ConnectionError("prefill worker gone")
                await asyncio.sleep(30)  # hangs until the consumer leaves

            agen = d.generate("r", prompt, params, kv_params=remote)
            if outcome == "cancel":
                task = asyncio.ensure_future(agen.__anext__())
                await asyncio.wait_for(started.wait(), 5)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await agen.aclose()
            else:
                outs = [o async for o in agen]
                if outcome == "recompute":
                    assert outs[-1].token_ids == ref
                else:
                    assert outs[-1].finish_reason == "error"
                    assert "prefill worker gone" in outs[-1].error
            for _ in range(100):
                if d.stats().num_free_blocks == d.stats().num_blocks:
                    break
                await asyncio.sleep(0.02)
            await d.call(lambda e: e.check_integrity())
            assert d.stats().num_free_blocks == d.stats().num_blocks
        finally:
            d.shutdown()

    asyncio.run(main())


def test_seeded_sampling_through_remote_prefill_equals_one_node():
    prompt = list(range(50, 75))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    ref = LLM(tiny_model_dir("llama"), dtype="float32", block_size=BS).generate(
        [prompt], params)[0].token_ids

    async def main():
        p, d = make_async(), make_async()
        try:
            async def remote(alloc):
                # The producer samples the first token with the same seed.
                first = None
                async for out in p.generate("p", prompt, SamplingParams(
                        max_tokens=1, temperature=1.0, seed=7), hold_kv=True):
                    if out.finished:
                        for i, b in enumerate(out.block_ids):
                            d.engine.runner.kv_cache[alloc.block_ids[i]].copy_(
                                p.engine.runner.kv_cache[b])
                        first = out.token_ids[0]
                p.release("p")
                return first

            outs = [o async for o in d.generate("r", prompt, params, kv_params=remote)]
            assert outs[-1].token_ids == ref
        finally:
            p.shutdown()
            d.shutdown()

    asyncio.run(main())
