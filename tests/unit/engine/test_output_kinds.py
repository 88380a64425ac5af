"""What a request's outputs carry per `SamplingParams.output_kind`: the same tokens,
text and logprobs whether every output holds everything (CUMULATIVE), only its step's
delta (DELTA, what a worker streams) or the request ends with one output (FINAL_ONLY),
through stop strings, logprobs, parallel samples, best_of and a resumed stream."""

from __future__ import annotations

from dataclasses import replace
from itertools import accumulate

import pytest

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from tests.factories import tiny_model_dir

PROMPT = [(7 * j) % 200 + 5 for j in range(13)]
REQUESTS: dict[str, tuple[SamplingParams, list[int]]] = {
    "greedy": (SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), []),
    "logprobs": (SamplingParams(max_tokens=17, temperature=1.0, seed=3, logprobs=2,
                                ignore_eos=True), []),
    "n2": (SamplingParams(max_tokens=11, temperature=1.0, seed=5, n=2, logprobs=1,
                          ignore_eos=True), []),
    "best_of": (SamplingParams(max_tokens=9, temperature=1.0, seed=9, n=2, best_of=3,
                               ignore_eos=True), []),
    "resumed": (SamplingParams(max_tokens=15, temperature=0, logprobs=0, ignore_eos=True),
                [40, 41, 42]),
}
Stream = dict[tuple[str, int], list[RequestOutput]]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request: pytest.FixtureRequest) -> LLMEngine:
    return LLM(tiny_model_dir("llama"), block_size=4, num_blocks=256,
               async_scheduling=request.param).engine


def run(eng: LLMEngine, kind: RequestOutputKind, stop: str | None = None) -> Stream:
    """Every output of each request, by (request, sample index)."""
    for rid, (params, resume) in REQUESTS.items():
        p = replace(params, output_kind=kind, stop=[stop] if stop and rid == "greedy" else [])
        eng.add_request(f"{rid}-{kind.value}", PROMPT, p, resume_token_ids=resume)
    outs: Stream = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault((o.request_id.rsplit("-", 1)[0], o.index), []).append(o)
    eng.check_integrity()
    return outs


def whole(outs: list[RequestOutput], kind: RequestOutputKind) -> tuple:
    """(new token ids, new text, count, finish reason, logprobs) of one sample's outputs,
    checked against what each output says of itself."""
    last = outs[-1]
    assert last.finish_reason is not None and all(o.finish_reason is None for o in outs[:-1])
    ids = [t for o in outs for t in o.new_token_ids]
    text = "".join(o.new_text for o in outs)
    resumed = last.num_output_tokens - len(ids)  # tokens another worker streamed
    assert [o.num_output_tokens for o in outs] == \
        list(accumulate((len(o.new_token_ids) for o in outs), initial=resumed))[1:]
    if kind is RequestOutputKind.DELTA:
        for o in outs:
            assert o.token_ids == o.new_token_ids and o.text == o.new_text
            assert o.logprobs is None or len(o.logprobs) == len(o.new_token_ids)
        lps = None if last.logprobs is None else [lp for o in outs for lp in o.logprobs or []]
    else:
        assert len(outs) == 1 or kind is RequestOutputKind.CUMULATIVE
        assert last.token_ids[resumed:] == ids and last.text.endswith(text)
        assert last.logprobs is None or len(last.logprobs) == len(ids)  # resumed: none
        lps = last.logprobs
    return ids, text, last.num_output_tokens, last.finish_reason, lps


def test_every_kind_carries_the_same_output(engine: LLMEngine) -> None:
    got = {kind: run(engine, kind) for kind in RequestOutputKind}
    ref = got[RequestOutputKind.CUMULATIVE]
    assert sorted(ref) == sorted([("greedy", 0), ("logprobs", 0), ("n2", 0), ("n2", 1),
                                  ("best_of", 0), ("best_of", 1), ("resumed", 0)])
    for kind, outs in got.items():
        assert sorted(outs) == sorted(ref)
        for key in ref:
            *a, lps = whole(outs[key], kind)
            *b, ref_lps = whole(ref[key], RequestOutputKind.CUMULATIVE)
            assert a == b, (kind, key)
            # (later runs hit the prefix cache: float sums in another order)
            assert (lps is None) == (ref_lps is None)
            for x, y in zip(lps or [], ref_lps or [], strict=True):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    # The resumed request counts the 3 tokens another worker streamed, never repeats them.
    delta = got[RequestOutputKind.DELTA][("resumed", 0)]
    assert delta[-1].num_output_tokens == 15
    assert sum(len(o.token_ids) for o in delta) == 12 == sum(len(o.logprobs or [])
                                                             for o in delta)
    # Streams have one output per step; best_of holds its samples until the ranking.
    assert len(got[RequestOutputKind.DELTA][("greedy", 0)]) == 20
    assert len(got[RequestOutputKind.DELTA][("best_of", 0)]) == 1


def test_stop_string_cuts_every_kind_alike(engine: LLMEngine) -> None:
    text = whole(run(engine, RequestOutputKind.CUMULATIVE)[("greedy", 0)],
                 RequestOutputKind.CUMULATIVE)[1]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    got = {kind: whole(run(engine, kind, stop)[("greedy", 0)], kind)
           for kind in RequestOutputKind}
    assert got[RequestOutputKind.CUMULATIVE][3] == "stop"
    assert stop not in got[RequestOutputKind.CUMULATIVE][1]
    assert got[RequestOutputKind.DELTA] == got[RequestOutputKind.FINAL_ONLY] \
        == got[RequestOutputKind.CUMULATIVE]


def test_outputs_are_not_changed_by_later_steps(engine: LLMEngine) -> None:
    """Each output keeps what it carried when it was delivered (CUMULATIVE copies a
    running request's lists; final outputs of every kind hold the finished request's)."""
    for kind in RequestOutputKind:
        for key, outs in run(engine, kind).items():
            ids, text, n, _, lps = whole(outs, kind)
            for o in outs:
                assert len(o.new_token_ids) <= o.num_output_tokens, (kind, key)
                if kind is not RequestOutputKind.DELTA:
                    assert len(o.token_ids) == o.num_output_tokens, (kind, key)
                    assert o.logprobs is None or len(o.logprobs) == \
                        o.num_output_tokens - (n - len(ids)), (kind, key)
            if kind is RequestOutputKind.CUMULATIVE:
                assert [len(o.token_ids) for o in outs] == [o.num_output_tokens for o in outs]
                assert outs[-1].text == "".join(o.new_text for o in outs) or key[0] == "resumed"


def test_output_kind_is_validated() -> None:
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta").validate()  # type: ignore[arg-type]


# `_output`'s positional RequestOutput call: each field and the expression it is given.
CALL = [("request_id", "req.request_id"), ("prompt_token_ids", "req.prompt_token_ids"),
        ("token_ids", "token_ids"), ("text", "text"), ("new_token_ids", "new_ids"),
        ("new_text", "new_text"), ("num_output_tokens", "n"), ("finished", "final"),
        ("finish_reason", "status.value if status is not None else None"),
        ("stop_reason", "req.stop_reason if final else None"),
        ("num_cached_tokens", "req.num_cached_tokens or 0"), ("error", "None"),
        ("first_token_time", "req.first_token_time"),
        ("scheduled_time", "req.scheduled_time"), ("logprobs", "logprobs"),
        ("index", "req.index"), ("cumulative_logprob", "req.cumulative_logprob"),
        ("prompt_logprobs", "req.prompt_logprobs if tr.prompt_logprobs else None"),
        ("num_computed_tokens", "req.num_computed_tokens")]


def test_positional_output_matches_the_field_order() -> None:
    """The output processor builds RequestOutput positionally: its arguments, in
    order, are the dataclass's fields in order (a swap of two same-typed fields on
    either side fails here)."""
    import ast
    import inspect
    import textwrap
    from dataclasses import fields

    from engine.output_processor import OutputProcessor

    tree = ast.parse(textwrap.dedent(inspect.getsource(OutputProcessor._output)))
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
             and isinstance(c.func, ast.Name) and c.func.id == "RequestOutput"]
    assert len(calls) == 1 and not calls[0].keywords
    assert [ast.unparse(a) for a in calls[0].args] == [e for _, e in CALL]
    assert [f.name for f in fields(RequestOutput)][:len(CALL)] == [f for f, _ in CALL]
