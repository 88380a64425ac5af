"""Model-directory variants: the embedded default model (llama3 RoPE scaling), tied
embeddings, sharded weights, half-precision dtypes, chat templates and the CLI."""

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.default_model import RANDOM_WEIGHTS_NOTICE, ensure_default_model
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.factories import hf_greedy, hf_model, tiny_model_dir

PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "def generate(prompt"]


def check_against_hf(model_dir: str, max_tokens: int = 12) -> None:
    llm = LLM(model_dir, dtype="float32", block_size=8)
    hf = hf_model(model_dir)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    for p, o in zip(ids, outs):
        assert o.token_ids == hf_greedy(hf, p, max_tokens, llm.engine.eos_token_ids[0])


def test_default_model_is_a_real_llama3_dir(tmp_path):
    d = ensure_default_model(str(tmp_path))
    assert ensure_default_model(str(tmp_path)) == d  # built once
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    check_against_hf(d)


def test_tied_embeddings():
    check_against_hf(tiny_model_dir("qwen2", tie=True))


def test_sharded_safetensors(tmp_path):
    hf = hf_model(tiny_model_dir("llama"))
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    src = tiny_model_dir("llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    check_against_hf(str(tmp_path))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(dtype):
    d = tiny_model_dir("llama")
    ref = LLM(d, dtype="float32").generate(PROMPTS, SamplingParams(
        max_tokens=4, temperature=0, logprobs=0))
    half = LLM(d, dtype=dtype)
    assert half.engine.runner.kv_cache.dtype == getattr(torch, dtype)
    outs = half.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, logprobs=0))
    # Half precision may pick a different token late; the first token's logprob under
    # its own weights must be close to float32's.
    for r, o in zip(ref, outs):
        assert len(o.token_ids) == 4
        tok = r.token_ids[0]
        if o.token_ids[0] == tok:
            assert abs(o.logprobs[0][tok] - r.logprobs[0][tok]) < 0.1


def test_chat_template_and_encoding_match_transformers():
    from transformers import AutoTokenizer

    d = tiny_model_dir("llama")
    ours, theirs = Tokenizer(d), AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there"}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    assert ours.encode_chat(msgs) == list(theirs.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=True, return_dict=False))
    text = "naïve café — 漢字 🙂"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == text


def test_generate_cli_says_weights_are_random(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--prompt", "Hello",
                        "--max-tokens", "5"], capture_output=True, text=True, env=env,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.dirname(os.path.abspath(__file__))))))
    assert r.returncode == 0, r.stderr
    assert RANDOM_WEIGHTS_NOTICE in r.stderr
    assert r.stdout.startswith("Hello") and "5 generated" in r.stderr
