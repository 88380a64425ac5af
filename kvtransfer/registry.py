"""Transports by name. Implementations load lazily (torch, ucxx stay unimported)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvtransfer.config import TransferConfig

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvtransfer.base import KVReceiver, KVSender

# name -> (module, receiver class, sender class)
TRANSPORTS: dict[str, tuple[str, str, str]] = {
    "tcp": ("kvtransfer.tcp", "TcpReceiver", "TcpSender"),
    "shm": ("kvtransfer.shm", "ShmReceiver", "ShmSender"),
    "ucx": ("kvtransfer.ucx", "UcxReceiver", "UcxSender"),
    "cuda_ipc": ("kvtransfer.cuda_ipc", "CudaIpcReceiver", "CudaIpcSender"),
    "auto": ("kvtransfer.auto", "AutoReceiver", "AutoSender"),
}


def register_transport(name: str, module: str, receiver: str, sender: str) -> None:
    """Add a transport (e.g. a fault-injecting one in tests)."""
    TRANSPORTS[name] = (module, receiver, sender)


def _load(name: str, index: int) -> type:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(TRANSPORTS)}")
    module = importlib.import_module(TRANSPORTS[name][0])
    cls: type = getattr(module, TRANSPORTS[name][index])
    return cls


def make_receiver(config: TransferConfig,
                  registry: CollectorRegistry | None = None) -> KVReceiver:
    """The decode side of `config.transport`; metrics go to `registry` (default: fresh)."""
    receiver: KVReceiver = _load(config.transport, 1)(config, registry)
    return receiver


def make_sender(config: TransferConfig, registry: CollectorRegistry | None = None) -> KVSender:
    """The prefill side of `config.transport`."""
    sender: KVSender = _load(config.transport, 2)(config, registry)
    return sender


def make_transport(config: TransferConfig, role: str,
                   registry: CollectorRegistry | None = None) -> KVReceiver | KVSender:
    """`role` is "receiver" (decode) or "sender" (prefill)."""
    if role == "receiver":
        return make_receiver(config, registry)
    if role == "sender":
        return make_sender(config, registry)
    raise ValueError(f"role must be 'receiver' or 'sender', got {role!r}")
