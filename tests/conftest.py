"""Suite-wide test settings: GPU-only tests are skipped without CUDA."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The cluster token every LocalCluster hands its children, so test helpers that call
# workers directly (serving_util.load_report) can sign their calls (protos/auth.py).
os.environ.setdefault("SPLITSERVE_CLUSTER_TOKEN", "splitserve-test-cluster-token")
# Likewise the gateways' admin key (`/debug/workers` needs it; serving_util.ADMIN sends it).
os.environ.setdefault("SPLITSERVE_ADMIN_KEY", "splitserve-test-admin-key")


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _gpu_count() -> int:
    if not _has_cuda():
        return 0
    import torch

    return int(torch.cuda.device_count())


if not _has_cuda():
    # Without a GPU the Triton kernels run under Triton's interpreter (read when triton
    # is first imported, so here, before any test imports it).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("multi_gpu" in item.keywords for item in items) and _gpu_count() < 2:
        few = pytest.mark.skip(reason=f"needs two or more CUDA GPUs ({_gpu_count()} here)")
        for item in items:
            if "multi_gpu" in item.keywords:
                item.add_marker(few)
    if any("gpu" in item.keywords for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
