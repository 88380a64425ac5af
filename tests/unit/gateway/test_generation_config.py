"""The model's generation_config.json as vLLM applies it (--generation-config auto,
vllm or a directory): defaults for the sampling fields a request leaves unset, a cap on
max_tokens, and extra EOS ids as stop tokens."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from gateway.grpc_server import GenerateService
from gateway.protocol import ModelContext, parse_chat, parse_completion
from protos import splitserve_pb2 as pb
from tests.factories import tiny_model_dir, workerless_gateway

GEN = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
       "repetition_penalty": 1.1, "eos_token_id": [7, 9], "do_sample": True}
MSGS = [{"role": "user", "content": "hi"}]


def _model_dir(tmp_path, gen: dict) -> str:
    out = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir("llama"), out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    return out


def test_unset_fields_take_the_models_defaults(tmp_path) -> None:
    ctx = ModelContext(_model_dir(tmp_path, GEN), "tiny")
    model_eos = ModelContext(tiny_model_dir("llama"), "tiny").defaults
    assert model_eos.eos_token_ids == ()
    for inp in (parse_completion({"prompt": "hello"}, ctx)[0],
                parse_chat({"messages": MSGS}, ctx)):
        p = inp.params
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == \
            pytest.approx((0.6, 0.95, 20, 0.05, 1.1))
        assert p.stop_token_ids == [7, 9]  # beside the model's own EOS
    p = parse_completion({"prompt": "hello", "temperature": 0, "top_p": 1.0, "top_k": -1,
                          "min_p": 0, "repetition_penalty": 1.0, "stop_token_ids": [9, 3],
                          "ignore_eos": False}, ctx)[0].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == \
        (0.0, 1.0, None, 0.0, 1.0)
    assert p.stop_token_ids == [9, 3, 7]
    ignoring = parse_completion({"prompt": "hello", "ignore_eos": True}, ctx)[0].params
    assert ignoring.stop_token_ids == []


def test_vllm_keeps_vllms_defaults_but_not_the_eos_ids(tmp_path) -> None:
    ctx = ModelContext(_model_dir(tmp_path, GEN), "tiny", generation_config="vllm")
    p = parse_completion({"prompt": "hello"}, ctx)[0].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, None, 0.0)
    assert p.stop_token_ids == [7, 9]


def test_a_directory_and_transformers_defaults(tmp_path) -> None:
    other = tmp_path / "gen"
    other.mkdir()
    # top_k 50 and temperature 1.0 are transformers' defaults: no override (to_diff_dict).
    (other / "generation_config.json").write_text(json.dumps(
        {"top_k": 50, "temperature": 1.0, "top_p": 0.8, "max_new_tokens": 5}))
    ctx = ModelContext(tiny_model_dir("llama"), "tiny", generation_config=str(other))
    p = parse_chat({"messages": MSGS}, ctx).params
    assert (p.top_k, p.temperature, p.top_p, p.max_tokens) == (None, 1.0, pytest.approx(0.8), 5)
    # max_new_tokens caps an explicit max_tokens too, as vLLM's get_max_tokens.
    assert parse_chat({"messages": MSGS, "max_tokens": 9}, ctx).params.max_tokens == 5
    with pytest.raises(ValueError, match="generation-config"):
        ModelContext(tiny_model_dir("llama"), "tiny", generation_config=str(tmp_path))


def test_the_grpc_front_takes_the_same_defaults_as_http(tmp_path) -> None:
    """One function fills both fronts' unset fields: a gRPC request without sampling
    fields gets the HTTP body's parameters, max_tokens included (16 for prompt and
    token_ids input, the rest of the context for chat)."""
    gw = workerless_gateway()
    gw.ctx = ModelContext(_model_dir(tmp_path, GEN), "tiny")
    svc = GenerateService(gw)
    ids = gw.ctx.tokenizer.encode("hello")
    http = parse_completion({"prompt": "hello"}, gw.ctx)[0].params
    for req in (pb.GenerateRequest(prompt="hello"),
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))):
        assert svc._input(req).params == http
    assert http.max_tokens == 16 and http.stop_token_ids == [7, 9]
    chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**MSGS[0])]))
    assert svc._input(chat).params == parse_chat({"messages": MSGS}, gw.ctx).params
    given = svc._input(pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(
        temperature=0, top_p=1, top_k=0, min_p=0, repetition_penalty=1, max_tokens=3,
        ignore_eos=True))).params
    assert (given.temperature, given.top_p, given.top_k, given.min_p,
            given.repetition_penalty, given.max_tokens, given.stop_token_ids) == \
        (0.0, 1.0, None, 0.0, 1.0, 3, [])


def test_the_tokenizers_eos_is_no_stop_token(tmp_path) -> None:
    """vLLM's update_from_generation_config leaves the tokenizer's EOS (4 here) out of
    stop_token_ids (it ends a request as EOS, with no stop reason) and adds the
    generation config's other ids, whatever config.json names (Llama-3-Instruct's
    shape: config.json 47, generation_config.json [47, 4])."""
    out = _model_dir(tmp_path, {"eos_token_id": [47, 4]})
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = 47
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    ctx = ModelContext(out, "tiny")
    assert ctx.tokenizer.eos_token_id == 4
    assert parse_completion({"prompt": "hello"}, ctx)[0].params.stop_token_ids == [47]
