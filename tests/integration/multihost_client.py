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
import os
import sys
import time
import urllib.request
from typing import Any


def wait(arg: dict[str, Any]) -> Any:
    deadline = time.monotonic() + float(arg["timeout"])
    last: Any = None
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(f"http://{arg['http']}/debug/workers", headers={
                "Authorization": f"Bearer {os.environ.get('SPLITSERVE_ADMIN_KEY', '')}"})
            with urllib.request.urlopen(req, timeout=2) as r:
                last = json.loads(r.read())
            if set(arg["roles"]) <= {w["role"] for w in last if w["routable"]}:
                return last
        except OSError as e:
            last = repr(e)
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for roles {arg['roles']}; last view: {last}")


def generate(arg: dict[str, Any]) -> Any:
    from tests.integration.serving_util import grpc_generate

    return asyncio.run(grpc_generate(arg["grpc"], arg["prompts"], arg["max_tokens"], 60.0))


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
