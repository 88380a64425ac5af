"""The committed gRPC stubs match the .proto sources, and the conversions round-trip."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from engine.sampling_params import SamplingParams
from protos import gen
from protos.convert import sampling_from_proto, sampling_to_proto

# Lines naming the generator's versions differ between grpcio-tools releases without
# the contract changing; everything else must match byte for byte.
_VERSION_LINE = re.compile(r"(Protobuf Python Version|GRPC_GENERATED_VERSION|"
                           r"^\s*\d+,\s*$|^\s*'',?\s*$)")


def _normalized(path: str) -> list[str]:
    with open(path) as f:
        return [ln for ln in f.read().splitlines() if not _VERSION_LINE.search(ln)]


def test_committed_stubs_are_fresh(tmp_path) -> None:
    pytest.importorskip("grpc_tools")
    fresh = gen.generate(str(tmp_path))
    assert fresh, "no .proto files found"
    for path in fresh:
        committed = os.path.join(gen.ROOT, os.path.relpath(path, tmp_path))
        assert os.path.isfile(committed), f"{committed} is not committed; run python -m protos.gen"
        assert _normalized(committed) == _normalized(path), \
            f"{committed} is stale; run `python -m protos.gen` and commit the result"


def test_stubs_import_as_package_modules() -> None:
    assert importlib.util.find_spec("protos.splitserve_pb2") is not None
    from protos import splitserve_pb2, splitserve_pb2_grpc

    assert splitserve_pb2.DESCRIPTOR.package == "splitserve.v1"
    for name in ("GenerateStub", "WorkerStub", "PrefillStub"):
        assert hasattr(splitserve_pb2_grpc, name)


def test_sampling_round_trip() -> None:
    p = SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, top_k=3, seed=11,
                       stop=["x", "yz"], stop_token_ids=[5], ignore_eos=True)
    q = sampling_from_proto(sampling_to_proto(p))
    assert (q.max_tokens, q.temperature, q.top_p, q.top_k, q.seed, q.stop, q.stop_token_ids,
            q.ignore_eos) == (7, 0.0, 0.5, 3, 11, ["x", "yz"], [5], True)


def test_unset_sampling_fields_take_defaults() -> None:
    from protos import splitserve_pb2 as pb

    q = sampling_from_proto(pb.SamplingParams())
    d = SamplingParams()
    assert (q.max_tokens, q.temperature, q.top_p, q.top_k, q.seed) == \
        (d.max_tokens, d.temperature, d.top_p, None, None)
