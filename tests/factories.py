"""Test factories: tiny random-weight models in real Hugging Face format, built with
transformers' own classes (the reference implementation), and engines over them."""

from __future__ import annotations

import os
import shutil
from typing import Any

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# MLA + MoE: 8 experts (top-2), one shared expert, a dense first layer.
DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3")
_DEEPSEEK = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                 n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                 first_k_dense_replace=1)
_CACHE = os.path.join(os.environ.get("SPLITSERVE_TEST_CACHE", "/tmp/splitserve-test-models"))
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child process that imports the project: the repo
    root is put first on PYTHONPATH, in front of whatever was already there (a machine whose
    packages live on PYTHONPATH, as a device machine's do, keeps them), plus `extra`."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": _ROOT + (os.pathsep + path if path else ""), **extra}


def tiny_model_dir(arch: str = "llama", *, dtype: str = "float32", tie: bool = False,
                   vocab_pad: int = 0, **overrides: Any) -> str:
    """Returns a directory with config.json, model.safetensors, tokenizer.json and a chat
    template for a tiny random model of `arch`, built once per process tree (cached)."""
    import hashlib
    import json

    key = hashlib.sha1(json.dumps([arch, dtype, tie, vocab_pad, overrides],
                                  sort_keys=True).encode()).hexdigest()[:10]
    out = os.path.join(_CACHE, f"{arch}-{key}")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        from engine.default_model import refresh_chat_template

        refresh_chat_template(out)  # built before the template learned tools
        return out
    import torch
    import transformers as tf

    from engine.default_model import write_tokenizer

    tmp = out + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    vocab = write_tokenizer(tmp, vocab_size=512) + vocab_pad
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tmp, "tokenizer.json"))
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=tie,
                  bos_token_id=tok.token_to_id("<|begin_of_text|>"),
                  eos_token_id=tok.token_to_id("<|eot_id|>"))
    cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
    }[arch]
    if arch in DEEPSEEK_ARCHS:
        common.update(_DEEPSEEK)
    if arch in ("qwen3", "qwen3_moe"):
        common.setdefault("head_dim", 16)
    if arch in ("mistral", "mixtral"):
        common.setdefault("sliding_window", None)
    if arch == "qwen3_moe":
        # 16 experts, top-4 renormalised; of 3 layers the middle one is dense (an
        # mlp_only layer), so both MLP kinds meet the residual stream.
        common.update(num_hidden_layers=3, mlp_only_layers=[1], num_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True)
    if arch == "mixtral":
        common.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)
    common.update(overrides)
    cfg = cls[0](**common)
    torch.manual_seed(1234)
    model = cls[1](cfg)
    # Larger weights than HF's init spread the logits, so greedy choices are decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            else:  # norms and biases: perturb around their init
                p.add_(torch.randn_like(p) * 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection bias
                b.copy_(torch.randn_like(b) * 0.1)
    model.to(getattr(torch, dtype)).save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def one_token_word(tokenizer: Any, token_ids: list[int], vocab_size: int) -> tuple[str, int]:
    """The first of `token_ids` whose text, as a bad word, is that one token again:
    (its text, its id). Whitespace-only and byte-fallback tokens are passed over."""
    from engine.tokenizer import bad_word_ids

    for t in token_ids:
        word = tokenizer.decode([t])
        try:
            if bad_word_ids(tokenizer, [word], vocab_size) == [[t]]:
                return word, t
        except ValueError:  # the text tokenizes to nothing
            continue
    raise AssertionError(f"no one-token word among {token_ids}")


def hf_model(model_dir: str) -> Any:
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int,
              eos_token_id: int | None) -> list[int]:
    """transformers' greedy generate on one unpadded prompt; output ids after the prompt,
    ending with EOS if one was produced."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id if eos_token_id is not None else 0)
    return [int(t) for t in out[0, len(prompt_ids):]]


def workerless_gateway(**config: Any) -> Any:
    """A `gateway.core.Gateway` over the tiny llama model, served as "tiny", whose
    registry is never started: no worker is ever routable, so a request that passes the
    gateway's own checks ends in 503 / UNAVAILABLE. `config`: GatewayConfig fields."""
    from gateway.config import GatewayConfig
    from gateway.core import Gateway
    from gateway.metrics import GatewayMetrics
    from gateway.protocol import ModelContext
    from gateway.registry import WorkerRegistry

    cfg = GatewayConfig(model_dir=tiny_model_dir("llama"), served_model_name="tiny",
                        static_workers=("127.0.0.1:1",), **config)
    return Gateway(cfg, ModelContext(cfg.model_dir, cfg.served_model_name),
                   WorkerRegistry(cfg), GatewayMetrics())
