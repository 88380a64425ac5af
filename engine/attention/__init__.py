"""Attention backends behind one interface (vLLM v1's split): `torch` (SDPA, the
reference and the CPU default) and `triton` (paged kernels, the CUDA default)."""

from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("torch", "triton")


def make_backend(name: str) -> AttentionBackend:
    """The backend registered as `name` (torch | triton)."""
    if name == "torch":
        from engine.attention.torch_sdpa import TorchSDPABackend

        return TorchSDPABackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "make_backend"]
