"""Client side of tests/integration/test_multihost.py, run *inside* a network namespace
(`ip netns exec NS python -m tests.integration.multihost_client CMD JSON`), since the test
process itself stays in the host's namespace. Prints one JSON document on stdout.

Commands (JSON argument in brackets):
  wait   {"http": "IP:PORT", "roles": ["prefill", "decode"], "timeout": S}
         -> the gateway's worker list once every role has a routable worker
  generate {"grpc": "IP:PORT", "prompts": [[ids]], "max_tokens": [n]}
         -> greedy token ids per prompt over the gateway's gRPC Generate
  metrics {"url": "http://IP:PORT/metrics"} -> the exposition text
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from typing import Any


def wait(arg: dict[str, Any]) -> Any:
    deadline = time.monotonic() + float(arg["timeout"])
    last: Any = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{arg['http']}/debug/workers", timeout=2) as r:
                last = json.loads(r.read())
            if set(arg["roles"]) <= {w["role"] for w in last if w["routable"]}:
                return last
        except OSError as e:
            last = repr(e)
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for roles {arg['roles']}; last view: {last}")


def generate(arg: dict[str, Any]) -> Any:
    import grpc

    from protos import splitserve_pb2 as pb
    from protos import splitserve_pb2_grpc as pb_grpc

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(arg["grpc"]) as ch:
            stub = pb_grpc.GenerateStub(ch)

            async def one(p: list[int], m: int) -> list[int]:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
                    max_tokens=m, temperature=0.0))
                out: list[int] = []
                async for r in stub.Generate(req, timeout=60):
                    out += r.token_ids
                return out
            return list(await asyncio.gather(*(one(p, m) for p, m in
                                               zip(arg["prompts"], arg["max_tokens"]))))
    return asyncio.run(run())


def metrics(arg: dict[str, Any]) -> Any:
    with urllib.request.urlopen(arg["url"], timeout=5) as r:
        return r.read().decode()


def main(argv: list[str]) -> int:
    cmds = {"wait": wait, "generate": generate, "metrics": metrics}
    if len(argv) != 2 or argv[0] not in cmds:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(cmds[argv[0]](json.loads(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
