"""The embedded default model: a small Llama-architecture model with random weights
and a byte-level BPE tokenizer, built once, locally, with a fixed seed (no network).

Its output is gibberish: the weights are random. It exists so that `make run`, demos
and tests have a real model directory of the real format to serve.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

DEFAULT_MODEL_NAME = "splitserve-tiny-llama-random"
RANDOM_WEIGHTS_NOTICE = ("note: the default model has RANDOM weights (a tiny Llama built "
                         "locally); its text is gibberish. Pass --model DIR for a real one.")

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]

# Llama 3.1's chat template, trimmed: JSON tool calling (the tools in the system turn,
# calls as {"name": ..., "parameters": ...} separated by "; ", results in ipython turns;
# the gateway's llama3_json parser reads them back). Without tools a conversation
# renders exactly as Llama 3's plain template.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = none %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{%- if system_message %}{{- system_message + '\n\n' }}{%- endif %}"
    "{{- 'You have access to the following functions. To call a function, respond with "
    "JSON for a function call: {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}. Separate several calls with \"; \".\n\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\n\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif system_message is not none %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system_message + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- for call in message.tool_calls %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- {'name': f.name, 'parameters': f.arguments} | tojson }}"
    "{%- if not loop.last %}{{- '; ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{{- message.content | tojson }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")

_CORPUS = """
Large language models are served in two phases. The prefill phase reads the whole prompt
at once and computes the key and value cache for every token; it is bound by compute.
The decode phase produces one token at a time for every running request; it is bound by
memory bandwidth. When both phases share a device, a long prompt stalls every stream that
is decoding beside it. Disaggregation puts prefill and decode on separate workers and
moves the cache between them, so that each phase is scheduled for its own goal: time to
first token for prefill, time per output token for decode. The cache is split into blocks
of sixteen tokens. A block is hashed by its tokens and its parent, so equal prefixes have
equal hashes, and a request that shares a prefix with an earlier one can reuse its blocks.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! The five boxing wizards jump quickly.
def generate(prompt, max_tokens=16): return model.sample(tokenize(prompt), max_tokens)
{"role": "user", "content": "Hello, how are you today?"} 0123456789 + - * / = < > ( )
Once upon a time, in a land far away, there lived a small model with random weights.
It could not say anything useful, but it was very fast, and it never needed the network.
"""


def default_model_dir(cache_root: str | None = None) -> str:
    root = cache_root or os.path.join(os.path.expanduser("~"), ".cache", "splitserve", "models")
    return os.path.join(root, DEFAULT_MODEL_NAME)


def write_tokenizer(model_dir: str, vocab_size: int = 1024) -> int:
    """Trains the byte-level BPE tokenizer on the embedded corpus and writes
    tokenizer.json and tokenizer_config.json. Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    cfg = {"bos_token": bos, "eos_token": "<|eot_id|>", "chat_template": CHAT_TEMPLATE,
           "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
           "clean_up_tokenization_spaces": False}
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return int(tok.get_vocab_size())


def llama_config(vocab_size: int, bos: int, eos: list[int], **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def write_random_weights(model_dir: str, cfg: dict[str, Any], seed: int = 0) -> None:
    """Writes model.safetensors with HF tensor names, N(0, 0.02) weights, unit norms."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h)}
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = w(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
              p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
              p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
              p + "mlp.down_proj.weight": w(h, inter),
              p + "input_layernorm.weight": torch.ones(h),
              p + "post_attention_layernorm.weight": torch.ones(h)}
    save_file({k: x.contiguous() for k, x in t.items()},
              os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})


def refresh_chat_template(model_dir: str) -> None:
    """A model directory built from this module by an older version keeps its weights
    and tokenizer; its chat template is brought up to date (replaced atomically, so a
    concurrent reader sees the old file or the new one)."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("chat_template") == CHAT_TEMPLATE:
        return
    cfg["chat_template"] = CHAT_TEMPLATE
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, path)


def ensure_default_model(cache_root: str | None = None) -> str:
    """Returns the default model's directory, creating it on first use (atomically)."""
    final = default_model_dir(cache_root)
    if os.path.isfile(os.path.join(final, "model.safetensors")):
        refresh_chat_template(final)
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(final))
    vocab = write_tokenizer(tmp)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tmp, "tokenizer.json"))

    def tid(t: str) -> int:
        i = tok.token_to_id(t)
        if i is None:
            raise RuntimeError(f"tokenizer lacks {t}")
        return int(i)

    cfg = llama_config(vocab, tid("<|begin_of_text|>"),
                       [tid("<|eot_id|>"), tid("<|end_of_text|>")])
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    write_random_weights(tmp, cfg)
    try:
        os.rename(tmp, final)
    except OSError:  # another process won the race; use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return final
