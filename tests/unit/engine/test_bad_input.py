"""Bad requests get a clear error for that request only; the engine keeps serving."""

import asyncio
import json
import os

import pytest

from engine.async_llm import AsyncLLM
from engine.config import ModelConfig, ModelDirError
from engine.llm import LLM, make_engine_config
from engine.llm_engine import RequestError
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=128,
               max_model_len=64)


@pytest.mark.parametrize("prompt,params,msg", [
    ([], SamplingParams(max_tokens=4), "empty"),
    ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2, 3], SamplingParams(max_tokens=-2), "max_tokens"),
    (list(range(60)), SamplingParams(max_tokens=8), "maximum context length is 64"),
    ([1, 2, 3], SamplingParams(max_tokens=4, stop=[""]), "stop"),
    ([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[10**9]), "stop_token_ids"),
    ([1, 2, 3], SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
    ([1, 2, 3], SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
    ([10**9], SamplingParams(max_tokens=4), "token ids outside"),
])
def test_bad_request_fails_alone(llm, prompt, params, msg):
    good = [5, 6, 7, 8]
    outs = llm.generate([good, prompt, good], [SamplingParams(max_tokens=4, temperature=0),
                                               params,
                                               SamplingParams(max_tokens=4, temperature=0)])
    assert outs[1].finish_reason == "error" and msg in outs[1].error
    assert outs[0].finish_reason == outs[2].finish_reason == "length"
    assert outs[0].token_ids == outs[2].token_ids
    with pytest.raises(RequestError, match=msg.split()[0]):
        llm.engine.add_request("x", prompt, params)
    llm.engine.check_integrity()


def test_abort_frees_blocks(llm):
    eng = llm.engine
    eng.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    assert eng.stats().num_free_blocks < eng.stats().num_blocks
    out = eng.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert eng.abort("a") is None
    eng.check_integrity()
    assert eng.stats().num_free_blocks == eng.stats().num_blocks


def test_async_streaming_and_abort_on_close():
    async def main():
        llm = AsyncLLM(make_engine_config(tiny_model_dir("llama"), dtype="float32",
                                          block_size=4, num_blocks=128))
        # What a reader of the figures sees as a step's outputs leave the engine thread:
        # a request that finished in the step is gone from them (a client with its last
        # token that reads /metrics finds it not running).
        running_at_delivery: list[tuple[int, int]] = []
        deliver = llm._deliver_step

        def recording_deliver(outs):
            finished = sum(o.finished for o in outs)
            if finished:
                running_at_delivery.append((llm.stats().num_running, finished))
            deliver(outs)
        llm._deliver_step = recording_deliver  # type: ignore[method-assign]
        try:
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

            async def collect(rid):
                return [o async for o in llm.generate(rid, [5, 6, 7, 8, 9], params)]

            runs = await asyncio.gather(*(collect(f"r{i}") for i in range(4)))
            assert running_at_delivery and running_at_delivery[-1][0] == 0, running_at_delivery
            for outs in runs:
                assert outs[-1].finished and len(outs[-1].token_ids) == 12
                assert sum(len(o.new_token_ids) for o in outs) == 12
            assert runs[0][-1].token_ids == runs[3][-1].token_ids
            # A consumer that walks away mid-stream aborts its request.
            agen = llm.generate("gone", list(range(1, 40)),
                                SamplingParams(max_tokens=200, ignore_eos=True))
            await agen.__anext__()
            await agen.aclose()
            for _ in range(200):
                if llm.stats().num_free_blocks == llm.stats().num_blocks and not llm.num_active:
                    break
                await asyncio.sleep(0.01)
            assert llm.stats().num_free_blocks == llm.stats().num_blocks
            with pytest.raises(RequestError):
                async for _ in llm.generate("bad", [], params):
                    pass
        finally:
            llm.shutdown()
        llm.engine.check_integrity()

    asyncio.run(main())


def test_model_dir_errors(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        ModelConfig.from_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelDirError, match="no config.json"):
        ModelConfig.from_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelDirError, match="unsupported architecture"):
        ModelConfig.from_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="not valid JSON"):
        ModelConfig.from_model_dir(str(tmp_path))
    src = tiny_model_dir("llama")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    with pytest.raises(ModelDirError, match="safetensors"):
        LLM(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # weights hold 2 layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    os.symlink(os.path.join(src, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(ModelDirError, match="missing"):
        LLM(str(tmp_path))


def test_logit_bias_past_its_range_after_construction_is_refused():
    """Construction clamps each bias to [-100, 100] (vLLM's from_optional); one set on the
    params afterwards is checked when they are validated, so an infinite bias never
    reaches a softmax."""
    params = SamplingParams(logit_bias={5: 1e9})
    assert params.logit_bias == {5: 100.0}
    params.validate(512)
    params.logit_bias = {5: float("inf")}
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        params.validate(512)
