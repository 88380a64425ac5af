"""The face of kvtransfer: what the prefill and decode services program against.

One-sided write semantics: the receiver (decode) registers its KV cache and says
which blocks a transfer will fill; the sender (prefill) writes into them; both see
completion. Implementations: `tcp`, `shm`, `ucx` (see `registry.make_receiver`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from kvtransfer.layout import KVLayout, Region


class KVReceiver(Protocol):
    """Decode side. All methods run on the receiver's event loop."""

    def register(self, kv: Any, layout: KVLayout) -> None:
        """Register the local block-major KV tensor once (the caller keeps owning it)."""

    async def start(self) -> None:
        """Start accepting authenticated senders."""

    def address(self) -> str:
        """Descriptor for senders: transport, host/port (shm name...), layout."""

    def expect(self, xfer_id: str, dst_regions: Sequence[Region], generation: int,
               lease_s: float | None = None) -> asyncio.Future[None]:
        """Announce a transfer into `dst_regions`; resolves once all landed verified.

        On failure (TransferTimeout at lease end, TransferCancelled, IntegrityError,
        PeerUnavailable) the blocks are fenced and safe to reuse at once.
        """

    def cancel(self, xfer_id: str, reason: str = ...) -> bool:
        """Fence a transfer; its late writes are dropped and counted."""

    async def close(self) -> None: ...


class KVSender(Protocol):
    """Prefill side."""

    def register(self, kv: Any, layout: KVLayout) -> None: ...

    async def connect(self, address: str, token: str | None = None,
                      layout: KVLayout | None = None) -> Any:
        """Handshake; returns a peer handle. AuthError / LayoutMismatch / PeerUnavailable."""

    async def begin(self, peer: Any, dst_regions: Sequence[Region], xfer_id: str,
                    generation: int, timeout_s: float | None = None) -> None:
        """Announce a transfer's whole destination before its writes, as early as it is
        known: in-place transports ask for their revocable write grant here (one round
        trip, overlapped with what the caller does meanwhile), so that no write waits.
        Raises the receiver's typed error if it refuses."""

    async def write(self, peer: Any, src_regions: Sequence[Region],
                    dst_regions: Sequence[Region], xfer_id: str, generation: int,
                    checksum: bool | None = None, timeout_s: float | None = None,
                    ready: Any = None) -> None:
        """Stream some regions of a transfer (call as layers/chunks are produced). No
        byte moves before `ready` (`memory.Ready`: on CUDA the event after the forward
        that wrote the src regions) has completed. The src regions stay as they are
        until `finish` returned: a transport may read them after `write` returned
        (cuda_ipc's copy runs on the device meanwhile)."""

    async def finish(self, peer: Any, xfer_id: str, generation: int | None = None,
                     timeout_s: float | None = None) -> None:
        """Wait for the receiver's verdict on the whole transfer."""

    async def cancel(self, peer: Any, xfer_id: str, generation: int | None = None,
                     reason: str = ...) -> None: ...

    async def disconnect(self, peer: Any) -> None: ...

    async def close(self) -> None: ...
