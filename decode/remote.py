"""The decode side of disaggregation: a kvtransfer receiver over this worker's KV cache
and the `Prefill` calls to prefill peers.

For one request (`fetch`): the engine has allocated blocks for the prompt (after local
prefix hits); we announce the transfer into the missing blocks under a fresh
generation, call the peer's `Prefill` with our transport address and block ids, and
return its first token once the RPC has answered AND every block has landed verified.
On any failure the transfer is fenced (late writes are dropped) and the policy
decides: `recompute` returns None so the engine prefills locally, `fail` raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter

from engine.llm_engine import RemoteAlloc
from kvtransfer.base import KVReceiver
from kvtransfer.config import TransferConfig
from kvtransfer.errors import KVTransferError
from kvtransfer.layout import KVLayout, whole_blocks
from kvtransfer.registry import make_receiver
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

POLICIES = ("recompute", "fail")


class RemotePrefillFailed(RuntimeError):
    """The remote prefill failed and the policy is `fail`."""


@dataclass(frozen=True, slots=True)
class RemotePrefillConfig:
    transfer: TransferConfig
    policy: str = "recompute"
    rpc_timeout_s: float = 30.0  # a Prefill call's deadline (the lease, by default)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.rpc_timeout_s <= 0:
            raise ValueError("rpc_timeout_s must be positive")


class RemotePrefiller:
    def __init__(self, config: RemotePrefillConfig, worker_id: str,
                 registry: CollectorRegistry | None = None) -> None:
        """`registry`: where the receiver's transfer metrics go (the worker's)."""
        self.config = config
        self.worker_id = worker_id
        self.receiver: KVReceiver = make_receiver(config.transfer, registry)
        self._outcomes = Counter(
            "splitserve:remote_prefill", "Remote prefills by outcome (ok, or the policy "
            "that handled a failure: recompute, fail)", ["outcome"],
            registry=registry if registry is not None else CollectorRegistry())
        self._generations = itertools.count(1)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._address = ""
        self.failures = 0

    def allocate_kv(self, layout: KVLayout, num_blocks: int) -> object | None:
        """For `shm`: the KV cache tensor, allocated in shared memory the prefill can
        map. None for transports that register the engine's own tensor."""
        allocate = getattr(self.receiver, "allocate", None)
        return allocate(layout, num_blocks) if allocate is not None else None

    async def start(self, kv_cache: object, layout: KVLayout, shared: bool) -> str:
        """Registers the engine's KV cache (unless it was allocated here) and starts
        accepting senders. Returns the transport address prefill peers write to."""
        if not shared:
            self.receiver.register(kv_cache, layout)
        await self.receiver.start()
        self._address = self.receiver.address()
        return self._address

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        await self.receiver.close()

    def _stub(self, address: str) -> pb_grpc.PrefillStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return pb_grpc.PrefillStub(ch)

    async def fetch(self, alloc: RemoteAlloc, request: pb.WorkerGenerateRequest,
                    peer: pb.PrefillPeer, deadline: float | None = None) -> int | None:
        """Prefills `request` on `peer` into `alloc`'s blocks; see the module doc.
        `deadline` (time.monotonic) is the caller's: the Prefill call and the transfer's
        lease get what is left of it, capped by the configured timeouts."""
        rid = alloc.request_id
        gen = next(self._generations)
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        rpc_timeout = min(self.config.rpc_timeout_s, left or self.config.rpc_timeout_s)
        lease = min(self.config.transfer.lease_s, left or self.config.transfer.lease_s)
        landed = self.receiver.expect(rid, whole_blocks(alloc.missing_block_ids), gen, lease)
        call = pb.PrefillRequest(
            request_id=rid, token_ids=request.prompt_token_ids, sampling=request.sampling,
            dest=pb.KVDestination(transport_address=self._address, block_ids=alloc.block_ids,
                                  generation=gen, worker_id=self.worker_id,
                                  num_computed_tokens=alloc.num_computed_tokens))
        if request.HasField("cache_salt"):
            call.cache_salt = request.cache_salt
        try:
            resp = await self._stub(peer.address).Prefill(
                call, timeout=rpc_timeout, metadata=(("x-request-id", rid),))
            await asyncio.wait_for(asyncio.shield(landed), lease)
            self._outcomes.labels("ok").inc()
            return int(resp.first_token)
        except asyncio.CancelledError:
            await self._fence(rid, landed, "request cancelled")
            raise
        except (grpc.aio.AioRpcError, KVTransferError, asyncio.TimeoutError) as e:
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else repr(e)
            self.failures += 1
            log.warning("request %s: remote prefill on %s failed (%s); policy %s", rid,
                        peer.worker_id or peer.address, reason, self.config.policy)
            await self._fence(rid, landed, "remote prefill failed")
            self._outcomes.labels(self.config.policy).inc()
            if self.config.policy == "fail":
                raise RemotePrefillFailed(reason) from e
            return None

    async def _fence(self, rid: str, landed: asyncio.Future[None], reason: str) -> None:
        """Fences the transfer and waits until its blocks are safe to reuse (no write
        still landing in them)."""
        self.receiver.cancel(rid, reason)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(landed), self.config.transfer.io_timeout_s)
