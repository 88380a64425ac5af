"""Known model shapes: published Hugging Face `config.json` data with no weights, made
into model directories (config + the embedded tokenizer) that run with
`load_format="dummy"` (random weights on the device), so anyone can benchmark a shape.

Torch-free: the CLI resolves `--model-shape` before anything heavy is imported.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from typing import Any

from engine.config import ModelConfig, ModelDirError

MODEL_SHAPES = ("llama3-8b", "llama3.2-1b", "qwen3-0.6b", "qwen3-30b-a3b", "mixtral-8x7b",
                "deepseek-v2-lite")
SHAPE_NOTICE = ("note: --model-shape {name} has no weights: running it with "
                "--load-format dummy (random weights; the text is gibberish).")

# Keys we rewrite to match the embedded tokenizer; the rest is the published data.
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def shape_cache_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "splitserve", "shapes")


def load_shape(name: str) -> dict[str, Any]:
    """The shape's config.json data: a name from MODEL_SHAPES, or the path of a
    config.json file (a custom or test shape). Raises ModelDirError if unknown."""
    if name in MODEL_SHAPES:
        text = resources.files(__package__).joinpath(f"{name}.json").read_text()
    elif name.endswith(".json") and os.path.isfile(name):
        with open(name) as f:
            text = f.read()
    else:
        raise ModelDirError(f"unknown model shape {name!r}; choose from {MODEL_SHAPES} "
                            "or pass the path of a config.json file")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelDirError(f"model shape {name!r} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelDirError(f"model shape {name!r} must hold a JSON object")
    ModelConfig.from_dict(cfg)  # fail here, with the shape's name, not in the engine
    return cfg


def _dir_name(name: str, cfg: dict[str, Any]) -> str:
    if name in MODEL_SHAPES:
        return name
    # A file's shape is keyed by its content, so an edited file is a new directory.
    import hashlib

    digest = hashlib.blake2b(json.dumps(cfg, sort_keys=True).encode(), digest_size=6)
    stem = os.path.splitext(os.path.basename(name))[0]
    return f"custom-{stem}-{digest.hexdigest()}"


def _without_token_ids(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in _TOKEN_KEYS}


def _is_current(model_dir: str, cfg: dict[str, Any]) -> bool:
    """True if `model_dir` was materialised from this very shape data."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            have = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return _without_token_ids(have) == _without_token_ids(cfg) and os.path.isfile(
        os.path.join(model_dir, "tokenizer.json"))


def _write_shape_dir(root: str, cfg: dict[str, Any]) -> None:
    """Writes the embedded tokenizer and config.json (token ids pointed at the
    tokenizer's special tokens, so eos stops generation and bos is real) into root."""
    from tokenizers import Tokenizer

    from engine.default_model import write_tokenizer

    vocab = write_tokenizer(root)
    if vocab > int(cfg["vocab_size"]):
        raise ModelDirError(f"the shape's vocab_size {cfg['vocab_size']} is smaller than the "
                            f"embedded tokenizer's {vocab} tokens")
    tok = Tokenizer.from_file(os.path.join(root, "tokenizer.json"))
    out = _without_token_ids(cfg)
    out["bos_token_id"] = tok.token_to_id("<|begin_of_text|>")
    out["eos_token_id"] = [tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")]
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(out, f, indent=1)


def model_shape_dir(name: str, cache_root: str | None = None) -> str:
    """The model directory of shape `name` (see load_shape), created on first use under
    `cache_root` (default ~/.cache/splitserve/shapes) and replaced atomically when the
    shipped data changed. It holds no weights: run it with load_format "dummy"."""
    cfg = load_shape(name)
    root = cache_root or shape_cache_root()
    final = os.path.join(root, _dir_name(name, cfg))
    if _is_current(final, cfg):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
    try:
        _write_shape_dir(tmp, cfg)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(final):  # stale: move it aside so the rename below can land
        stale = tempfile.mkdtemp(prefix=".stale-", dir=root)
        try:
            os.rename(final, os.path.join(stale, "old"))
        except OSError:
            pass  # another process moved it first
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:  # another process won the race; use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return final


__all__ = ["MODEL_SHAPES", "SHAPE_NOTICE", "load_shape", "model_shape_dir",
           "shape_cache_root"]
