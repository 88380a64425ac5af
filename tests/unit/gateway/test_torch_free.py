"""The gateway must not import torch (docs/architecture.md, import direction): checked in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def test_gateway_imports_without_torch() -> None:
    code = ("import sys; import gateway.server, gateway.cli, gateway.http_server, "
            "gateway.grpc_server, gateway.registry, gateway.core; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
