"""Wire <-> engine conversions shared by the gateway and the workers (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.outputs import RankedLogprobs
from engine.sampling_params import SamplingParams, StructuredOutput
from protos import splitserve_pb2 as pb

if TYPE_CHECKING:
    import grpc


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
        top_k=p.top_k or 0, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, skip_special_tokens=p.skip_special_tokens,
        n=p.n, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias,
        min_tokens=p.min_tokens, min_p=p.min_p,
        include_stop_str_in_output=p.include_stop_str_in_output,
        allowed_token_ids=p.allowed_token_ids or [], bad_words=p.bad_words)
    if p.seed is not None:
        msg.seed = p.seed
    if p.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(p.structured))
    for name in ("best_of", "logprobs", "prompt_logprobs"):
        if getattr(p, name) is not None:
            setattr(msg, name, getattr(p, name))
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults. Does not validate."""
    d = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else d.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else d.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else d.top_p,
        top_k=(msg.top_k or None) if msg.HasField("top_k") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        skip_special_tokens=(msg.skip_special_tokens if msg.HasField("skip_special_tokens")
                             else True),
        n=msg.n or 1, best_of=msg.best_of if msg.HasField("best_of") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty")
                            else 1.0),
        logit_bias=dict(msg.logit_bias), min_tokens=msg.min_tokens,
        min_p=msg.min_p if msg.HasField("min_p") else 0.0,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        allowed_token_ids=list(msg.allowed_token_ids) or None, bad_words=list(msg.bad_words),
        structured=structured_from_proto(msg.structured))


Logprobs = dict[int, float]  # token id -> logprob; the chosen token first (engine/sampler.py)


def logprobs_to_proto(lps: list[Logprobs], chosen: list[int], k: int,
                      ) -> list[pb.TokenLogprob]:
    """One TokenLogprob per position: the chosen token's logprob, its rank (a prompt
    position's RankedLogprobs carries it; else its place among the top `k`, 0 when not
    among them: not known), and the top `k`, best first."""
    out = []
    for lp, tok in zip(lps, chosen, strict=True):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        rank = lp.rank if isinstance(lp, RankedLogprobs) else \
            next((i + 1 for i, (t, _) in enumerate(top) if t == tok), 0)
        out.append(pb.TokenLogprob(token_id=tok, logprob=lp[tok], rank=rank, top=[
            pb.TopLogprob(token_id=t, logprob=v) for t, v in top]))
    return out


def logprobs_from_proto(msgs: list[pb.TokenLogprob]) -> list[Logprobs]:
    """The chosen token first, then the top k; a position whose rank is known is a
    RankedLogprobs."""
    out: list[Logprobs] = []
    for m in msgs:
        lp = {m.token_id: m.logprob} | {t.token_id: t.logprob for t in m.top}
        out.append(RankedLogprobs(lp, m.rank) if m.rank else lp)
    return out


def structured_to_proto(s: StructuredOutput) -> pb.StructuredOutput:
    msg = pb.StructuredOutput(disable_any_whitespace=not s.any_whitespace)
    if s.kind == "choice":
        msg.choice.choices.extend(s.choices)
    elif s.kind == "json_object":
        msg.json_object = True
    else:
        setattr(msg, s.kind, s.spec)  # json_schema | regex | grammar: the text
    return msg


def structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput | None:
    """None when no constraint is set."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    ws = not msg.disable_any_whitespace
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(msg.choice.choices), any_whitespace=ws)
    if kind == "json_object":
        return StructuredOutput("json_object", any_whitespace=ws)
    return StructuredOutput(kind, getattr(msg, kind), any_whitespace=ws)


def request_id_from(context: grpc.aio.ServicerContext, fallback: str) -> str:
    """The caller's x-request-id metadata, else `fallback`."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and value:
            return str(value)
    return fallback
