"""Wire <-> engine conversions shared by the gateway and the workers (torch-free)."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from protos import splitserve_pb2 as pb


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
        top_k=p.top_k or 0, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, skip_special_tokens=p.skip_special_tokens)
    if p.seed is not None:
        msg.seed = p.seed
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
                             else True))
