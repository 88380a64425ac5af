"""KVPusher: the sending side a worker keeps for its KV cache — one kvtransfer sender,
one handshaken connection per receiver address (re-made when it dies).

Used by the prefill service (streams a prompt's blocks as chunks finish) and by peer
fetch (writes cached blocks another worker asked for). The pusher owns the sender and
its connections; the caller keeps owning the KV tensor, which must outlive it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtransfer.config import TransferConfig
from kvtransfer.layout import KVLayout, whole_blocks
from kvtransfer.registry import make_sender

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvtransfer.base import KVSender


class KVPusher:
    def __init__(self, config: TransferConfig, kv: Any, layout: KVLayout,
                 registry: CollectorRegistry | None = None) -> None:
        self.sender: KVSender = make_sender(config, registry)
        self.sender.register(kv, layout)
        # Makes blocks of `kv` current before they are sent: under tensor parallelism on
        # CUDA `kv` is rank 0's full-head staging copy, gathered from the ranks
        # (worker/server.py); on CPU `kv` is every rank's cache and nothing is staged
        self.stage: Callable[[list[int]], Awaitable[None]] | None = None
        self._peers: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    async def peer(self, address: str) -> Any:
        """A connected, handshaken peer for `address`. AuthError / LayoutMismatch /
        PeerUnavailable when the receiver refuses or cannot be reached."""
        async with self._lock:
            peer = self._peers.get(address)
            if peer is None or not peer.alive:
                if peer is not None:
                    await self.sender.disconnect(peer)
                peer = await self.sender.connect(address)
                self._peers[address] = peer
            return peer

    async def push(self, address: str, xfer_id: str, generation: int,
                   src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   timeout_s: float | None = None) -> None:
        """Writes whole blocks `src_blocks` here into `dst_blocks` there and waits for
        the receiver's verdict; on any failure the transfer is cancelled (fenced there)
        and the error raised."""
        peer = await self.peer(address)
        if self.stage is not None:
            await self.stage(list(src_blocks))
        try:
            await self.sender.begin(peer, whole_blocks(dst_blocks), xfer_id, generation,
                                    timeout_s=timeout_s)
            await self.sender.write(peer, whole_blocks(src_blocks), whole_blocks(dst_blocks),
                                    xfer_id, generation, timeout_s=timeout_s)
            await self.sender.finish(peer, xfer_id, generation, timeout_s=timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.sender.cancel(peer, xfer_id, generation,
                                                        "push failed"))
            raise

    async def close(self) -> None:
        await self.sender.close()
