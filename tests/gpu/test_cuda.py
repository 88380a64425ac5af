"""CUDA paths (skipped without a GPU): the engine on the device is transformers'
greedy; UCX moves KV between CUDA caches bit-exactly (CUDA IPC / NVLink where UCX has
them); the device cache never goes through tcp/shm (tests/unit/decode)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kvtransfer import KVLayout, make_receiver, make_sender
from kvtransfer.layout import whole_blocks
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.integration.kvtransfer_util import fast_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_on_cuda_equals_transformers_greedy(arch: str) -> None:
    d = tiny_model_dir(arch)
    prompts = [[(5 * i + 3 * j) % 400 + 1 for j in range(n)] for i, n in enumerate((7, 40, 90))]
    llm = LLM(d, dtype="float32", device="cuda", num_blocks=64, max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    hf = hf_model(d)
    eos = llm.engine.eos_token_ids[0] if llm.engine.eos_token_ids else None
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 12, eos)
    assert llm.engine.runner.kv_cache.is_cuda


def test_ucx_moves_kv_between_cuda_caches_bit_exact() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=8,
                      dtype="bfloat16")
    src = torch.randn(layout.tensor_shape(32), device="cuda").to(torch.bfloat16)
    dst = torch.zeros(layout.tensor_shape(48), device="cuda", dtype=torch.bfloat16)

    async def main() -> None:
        receiver = make_receiver(fast_config("ucx"))
        sender = make_sender(fast_config("ucx"))
        receiver.register(dst, layout)
        sender.register(src, layout)
        await receiver.start()
        try:
            src_ids, dst_ids = [3, 4, 5, 20, 31], [40, 2, 3, 17, 9]
            landed = receiver.expect("x", whole_blocks(dst_ids), generation=1)
            peer = await sender.connect(receiver.address())
            await sender.write(peer, whole_blocks(src_ids), whole_blocks(dst_ids), "x", 1)
            await sender.finish(peer, "x", 1, timeout_s=10)
            await asyncio.wait_for(landed, 10)
            torch.cuda.synchronize()
            for s, d in zip(src_ids, dst_ids):
                assert torch.equal(dst[d], src[s])
            await sender.disconnect(peer)
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())
