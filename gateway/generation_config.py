"""The model's `generation_config.json` as vLLM reads it: request defaults and EOS ids.

`--generation-config` takes vLLM's values: `auto` (the model directory's file), `vllm`
(vLLM's own sampling defaults; the file's EOS ids still apply, as in vLLM) or a
directory holding a generation_config.json. Sampling defaults fill the fields a request
leaves unset (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as
max_tokens); as with transformers' `to_diff_dict`, a value equal to transformers' own
default is no override (so a file's `top_k: 50` changes nothing). Its EOS ids other than
the tokenizer's end generation as stop tokens (their id the stop reason) unless the
request sets `ignore_eos`, as vLLM's update_from_generation_config.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# transformers' GenerationConfig defaults: equal values are not overrides.
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                "min_p": None, "repetition_penalty": 1.0,
                                "max_new_tokens": None}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """`sampling`: request field -> default; `eos_token_ids`: extra stop tokens."""

    sampling: dict[str, float | int] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()

    def apply(self, params: SamplingParams, unset: Collection[str]) -> None:
        """Fills the sampling fields the request left unset (`unset`: their names, as
        in SAMPLING_FIELDS) with these defaults, and adds the extra EOS ids to its stop
        tokens unless it ignores EOS. The one place both fronts (HTTP body, gRPC
        SamplingParams) take the model's defaults; max_tokens is capped in
        gateway/protocol.finish_input."""
        for key in SAMPLING_FIELDS:
            value = self.sampling.get(key)
            if value is None or key not in unset:
                continue
            if key == "top_k":
                params.top_k = None if value in (0, -1) else int(value)
            else:
                setattr(params, key, float(value))
        if not params.ignore_eos:
            params.stop_token_ids = params.stop_token_ids + [
                t for t in self.eos_token_ids if t not in params.stop_token_ids]


# The request fields a generation config gives defaults for (SamplingParams' names).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def load_generation_defaults(source: str, model_dir: str,
                             model_eos: tuple[int, ...]) -> GenerationDefaults:
    """`model_eos`: the tokenizer's EOS id (none or one), which stops as EOS and is no
    stop token. Raises ValueError for a `source` directory without a readable
    generation_config.json; "auto" / "vllm" without the file: no defaults."""
    if source in ("auto", "vllm"):
        path = os.path.join(model_dir, "generation_config.json")
        data = _read(path) if os.path.isfile(path) else {}
    else:
        path = os.path.join(source, "generation_config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config {source!r}: give auto, vllm or a "
                             "directory holding a generation_config.json")
        data = _read(path)
    sampling: dict[str, float | int] = {}
    if source != "vllm":
        for key, default in _HF_DEFAULTS.items():
            value = data.get(key)
            if value is None or value == default:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{path}: `{key}` must be a number, got {value!r}")
            sampling["max_tokens" if key == "max_new_tokens" else key] = value
    if sampling:
        log.info("Default sampling parameters have been overridden by the model's "
                 "generation config (%s): %s", path, sampling)
    eos = data.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    extra = tuple(sorted({int(t) for t in ids if isinstance(t, int)} - set(model_eos)))
    return GenerationDefaults(sampling=sampling, eos_token_ids=extra)
