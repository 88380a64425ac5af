"""KV transfer between prefill and decode: layout, transports (tcp, shm, ucx), fencing.

Importing this package is cheap (no torch, no ucxx): the gateway imports
`kvtransfer.index` without torch. Transports load on `make_receiver`/`make_sender`.
"""

from __future__ import annotations

from kvtransfer.config import TransferConfig
from kvtransfer.errors import (
    AuthError,
    IntegrityError,
    KVTransferError,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
    TransferCancelled,
    TransferTimeout,
    VersionMismatch,
)
from kvtransfer.layout import KVLayout, Region, coalesce, whole_blocks
from kvtransfer.registry import make_receiver, make_sender, make_transport

__all__ = [
    "AuthError", "IntegrityError", "KVLayout", "KVTransferError", "LayoutMismatch",
    "PeerUnavailable", "ProtocolError", "Region", "TransferCancelled", "TransferConfig",
    "TransferTimeout", "VersionMismatch", "coalesce", "make_receiver", "make_sender",
    "make_transport", "whole_blocks",
]
