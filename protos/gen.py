"""Regenerates the committed gRPC stubs from `protos/*.proto` (needs grpcio-tools).

Run `python -m protos.gen` after editing a .proto; `tests/unit/protos` fails while the
committed stubs are stale. The stubs import each other as `protos.<name>_pb2`, because
protoc runs with the repository root as its include path.
"""

from __future__ import annotations

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def proto_files() -> list[str]:
    found = glob.glob(os.path.join(ROOT, "protos", "*.proto"))
    return sorted(os.path.relpath(p, ROOT) for p in found)


def generate(out_dir: str = ROOT) -> list[str]:
    """Writes `<out_dir>/protos/<name>_pb2{,_grpc}.py{,i}`; returns the paths written."""
    from grpc_tools import protoc

    os.makedirs(os.path.join(out_dir, "protos"), exist_ok=True)
    files = proto_files()
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *files]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")
    written = []
    for f in files:
        stem = os.path.join(out_dir, f[: -len(".proto")])
        written += [stem + "_pb2.py", stem + "_pb2.pyi", stem + "_pb2_grpc.py"]
    return written


if __name__ == "__main__":
    for path in generate(sys.argv[1] if len(sys.argv) > 1 else ROOT):
        print(path)
