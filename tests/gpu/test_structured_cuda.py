"""Structured outputs on CUDA (skipped without a GPU): the bitmask goes to the device
in one pinned copy and xgrammar's kernel masks the logits there, inside CUDA-graph
decode steps as well as eager ones; the same samples as on the CPU."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.structured import StructuredOutputs, apply_grammar_masks
from tests.factories import tiny_model_dir
from tests.unit.engine.test_structured import SCHEMA

pytestmark = pytest.mark.gpu


class _Row:
    """What the masking reads of a request: its grammar state and output tokens."""

    def __init__(self, grammar: object | None) -> None:
        self.grammar, self.output_token_ids = grammar, []


def test_device_mask_equals_the_cpu_mask() -> None:
    d = tiny_model_dir("llama")
    so = StructuredOutputs(d, 512, [4])
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    rows = [_Row(so.new_state(spec)), _Row(None), _Row(so.new_state(spec))]
    logits = torch.randn(3, 512)
    on_cpu, on_gpu = logits.clone(), logits.cuda()
    apply_grammar_masks(on_cpu, rows)  # type: ignore[arg-type]
    apply_grammar_masks(on_gpu, rows)  # type: ignore[arg-type]
    assert torch.equal(on_gpu.cpu(), on_cpu)
    assert torch.equal(on_cpu[1], logits[1]) and torch.isinf(on_cpu[0]).any()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_json_schema_samples_validate_on_cuda(eager: bool) -> None:
    llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cuda", num_blocks=256,
              max_num_seqs=16, enforce_eager=eager)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    outs = llm.generate([[1 + i, 2, 3] for i in range(16)], [
        SamplingParams(max_tokens=300, temperature=1.0, seed=i, structured=spec)
        for i in range(16)])
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
