"""Typed errors of the KV-transfer layer.

Every failure a caller can act on has its own class, all under `KVTransferError`,
so the decode's failure policy (`recompute` or `fail`) can catch one base class and
still report the precise kind. `kind` is the label used in the failures metric.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class of every kvtransfer failure."""

    kind = "error"


class TransferTimeout(KVTransferError):
    """A deadline or lease ran out before the transfer completed."""

    kind = "timeout"


class LayoutMismatch(KVTransferError):
    """Sender and receiver disagree on the KV layout; no byte was written."""

    kind = "layout"


class PeerUnavailable(KVTransferError):
    """The peer cannot be reached, closed the connection or stopped answering."""

    kind = "peer"


class IntegrityError(KVTransferError):
    """A region's checksum did not match; the transfer's blocks are not ready."""

    kind = "integrity"


class TransferCancelled(KVTransferError):
    """The transfer was cancelled by either side (or its generation was fenced)."""

    kind = "cancelled"


class AuthError(KVTransferError):
    """The handshake's shared-token proof failed; the connection was refused."""

    kind = "auth"


class ProtocolError(KVTransferError):
    """The peer sent something the protocol does not allow (bad frame, bad region)."""

    kind = "protocol"


class VersionMismatch(ProtocolError):
    """The peer speaks another version of the wire protocol (`wire.PROTOCOL_VERSION`);
    refused at the handshake, before any byte of KV moves. Upgrade both sides together."""

    kind = "version"


def error_from_kind(kind: str, message: str) -> KVTransferError:
    """Rebuild a typed error from its wire `kind` (errors cross the control channel)."""
    for cls in _ALL:
        if cls.kind == kind:
            return cls(message)
    return KVTransferError(message)


_ALL: tuple[type[KVTransferError], ...] = (
    TransferTimeout,
    LayoutMismatch,
    PeerUnavailable,
    IntegrityError,
    TransferCancelled,
    AuthError,
    VersionMismatch,
    ProtocolError,
)
