"""The prefill→decode hand-off connector, both sides, in vLLM's KV-connector shape: the
engine's scheduler decides, the connector moves bytes. A request the decode worker gets
with peers (`HandoffParams`) is parked by the scheduler with blocks for its whole prompt
after local prefix and tier hits (`Scheduler.allocate_remote`); the engine hands it to
its one hook, `AsyncLLM.handoff`, whose `fill` returns how the fill ended, and the
scheduler makes it runnable (`remote_kv_ready`): with the prefill's first token, from
the KV that landed, or ended with an error.

Decode side (`fill`), over this worker's KV cache:

    | local hit | pulled from the kv peer | pushed by the prefill peer, or computed here |

`pull` asks the peer the index named for the blocks it holds (FetchKV); `fetch`
announces a transfer into the still missing blocks under a fresh generation, calls the
prefill peer's `Prefill` with our receiver's address and block ids, and returns its
answer once the RPC has answered AND every block has landed verified. On any failure the
transfer is fenced (late writes are dropped): a failed pull just computes more; after a
failed prefill the policy decides (`recompute` here, or `fail` the request).

Prefill side (`Prefill`, worker/prefill_side.py): the prompt runs as a producer and its
blocks go to the decode's as the engine computes them, chunk by chunk.

Under tensor parallelism on CPU the transports see every rank's cache and move each
rank's heads directly (the receiver's `expect` covers every rank); on CUDA they see rank
0's full-head staging copy: `land` scatters received blocks to the ranks, the pusher's
`stage` gathers blocks before a send (worker/server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter

from engine.async_llm import RemoteResult
from engine.llm_engine import RemoteAlloc
from kvtransfer.base import KVReceiver
from kvtransfer.config import TransferConfig
from kvtransfer.errors import KVTransferError, ProtocolError
from kvtransfer.layout import KVLayout, whole_blocks
from kvtransfer.pusher import KVPusher
from kvtransfer.registry import make_receiver
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from protos.auth import RpcSecurity
from protos.convert import logprobs_from_proto
from worker.prefill_side import PrefillSide

if TYPE_CHECKING:
    from worker.service import WorkerService

log = logging.getLogger(__name__)

POLICIES = ("recompute", "fail")


class RemotePrefillFailed(RuntimeError):
    """The remote prefill failed and the policy is `fail`."""


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    transfer: TransferConfig
    policy: str = "recompute"  # after a failed remote prefill: recompute here, or fail
    rpc_timeout_s: float = 30.0  # a Prefill call's deadline (the lease, by default)
    security: RpcSecurity = field(default_factory=RpcSecurity)  # signs calls to peers

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.rpc_timeout_s <= 0:
            raise ValueError("rpc_timeout_s must be positive")


@dataclass(slots=True)
class HandoffParams:
    """A decode request's hand-off: the peers the gateway named, the caller's deadline
    (time.monotonic) and where the fill's timings go ("remote_s": the whole fill,
    "prefill_s": the prefill peer's compute)."""

    request: pb.WorkerGenerateRequest
    prefill_peer: pb.PrefillPeer | None
    kv_peer: pb.KVPeer | None
    deadline: float | None = None
    timings: dict[str, float] = field(default_factory=dict)


def remote_result(resp: pb.PrefillResponse, num_computed_tokens: int) -> RemoteResult:
    """The engine's view of a prefill's answer: the first token of every sample (n /
    best_of) with its logprobs, and the prompt's logprobs when they were asked for."""
    firsts = list(resp.first_tokens) or [resp.first_token]
    lps: list[dict[int, float] | None] = list(logprobs_from_proto(list(resp.first_logprobs)))
    lps += [None] * (len(firsts) - len(lps))
    return RemoteResult(
        first_token=int(resp.first_token), num_computed_tokens=num_computed_tokens,
        samples=tuple(zip(firsts, lps, strict=False)),
        prompt_logprobs=logprobs_from_proto(list(resp.prompt_logprobs))
        if len(resp.prompt_logprobs) else None)


class HandoffConnector(PrefillSide):
    """One per prefill or decode worker. A decode worker's runs the kvtransfer receiver
    over the engine's KV cache and is the engine's `handoff`; a prefill worker's serves
    `Prefill`. `pusher` (set once the KV cache exists) sends blocks on either."""

    def __init__(self, config: HandoffConfig, worker: WorkerService,
                 registry: CollectorRegistry | None = None) -> None:
        """`registry`: where the transfer metrics go (the worker's)."""
        self.config = config
        self.worker = worker
        self.pusher: KVPusher | None = None
        self.receiver: KVReceiver | None = None
        if worker.config.role == "decode":
            self.receiver = make_receiver(config.transfer, registry)
        reg = registry if registry is not None else CollectorRegistry()
        self._outcomes = Counter(
            "splitserve:remote_prefill", "Remote prefills by outcome (ok, or the policy "
            "that handled a failure: recompute, fail)", ["outcome"], registry=reg)
        self._pulls = Counter(
            "splitserve:peer_fetch", "Peer fetches by outcome (ok, miss: the peer no "
            "longer held every block, error)", ["outcome"], registry=reg)
        self._generations = itertools.count(1)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._address = ""
        self.failures = 0
        # Makes landed blocks the engine's before the request runs (tensor parallelism on
        # CUDA: the scatter from the staging copy, worker/server.py)
        self.land: Callable[[list[int]], Awaitable[None]] | None = None
        # Blocks landed with the sender's float8 KV scales: adopted or requantized to
        # ours before `land` and before the engine reads them (engine/kv_scales.py)
        self.accept: Callable[[list[int], list[float]], Awaitable[None]] | None = None
        self._float8 = False  # the registered cache is float8: landed blocks need scales

    # -- decode side: the receiver ------------------------------------------------------
    def allocate_kv(self, layout: KVLayout, num_blocks: int) -> object | None:
        """For `shm`: the KV cache tensor, allocated in shared memory the prefill can
        map. None for transports that register the engine's own tensor."""
        allocate = getattr(self.receiver, "allocate", None)
        return allocate(layout, num_blocks) if allocate is not None else None

    async def start(self, kv_cache: object, layout: KVLayout, shared: bool) -> str:
        """Registers the engine's KV cache (unless it was allocated here) and starts
        accepting senders. Returns the transport address prefill peers write to."""
        assert self.receiver is not None
        self._float8 = layout.dtype.startswith("float8")
        if not shared:
            self.receiver.register(kv_cache, layout)
        await self.receiver.start()
        self._address = self.receiver.address()
        return self._address

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        if self.receiver is not None:
            await self.receiver.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.config.security.channel(address)
        return ch

    def _timeouts(self, deadline: float | None) -> tuple[float, float]:
        """(rpc timeout, lease): the configured ones, capped by the caller's deadline."""
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        return (min(self.config.rpc_timeout_s, left or self.config.rpc_timeout_s),
                min(self.config.transfer.lease_s, left or self.config.transfer.lease_s))

    # -- decode side: the engine's hook -------------------------------------------------
    async def fill(self, alloc: RemoteAlloc, params: HandoffParams) -> RemoteResult:
        """Fills `alloc`'s blocks from the peers `params` names; see the module doc."""
        t0 = time.monotonic()
        try:
            return await self._fill(alloc, params)
        finally:
            params.timings["remote_s"] = time.monotonic() - t0

    async def _fill(self, alloc: RemoteAlloc, params: HandoffParams) -> RemoteResult:
        prefill_peer, kv_peer = params.prefill_peer, params.kv_peer
        remote_prefill = prefill_peer is not None and bool(prefill_peer.address)
        if kv_peer is not None and kv_peer.address:
            alloc = await self.pull(alloc, kv_peer, params.deadline, whole_prompt=remote_prefill)
        if remote_prefill:
            assert prefill_peer is not None
            resp = await self.fetch(alloc, params.request, prefill_peer, params.deadline)
            if resp is not None:
                params.timings["prefill_s"] = resp.timings.compute_s
                return remote_result(resp, alloc.num_computed_tokens)
        # Computed here from what landed; one token always stays to compute (its logits).
        bs = alloc.block_size
        return RemoteResult(num_computed_tokens=min(
            alloc.num_computed_tokens, (alloc.num_prompt_tokens - 1) // bs * bs))

    async def pull(self, alloc: RemoteAlloc, peer: pb.KVPeer, deadline: float | None,
                   whole_prompt: bool) -> RemoteAlloc:
        """Pulls the prompt blocks `peer` holds past our own into their places; returns
        `alloc` advanced past them (unchanged if the pull failed or had nothing to do)."""
        assert self.receiver is not None
        bs = alloc.block_size
        first = alloc.num_computed_tokens // bs
        limit = len(alloc.block_hashes) if whole_prompt else (alloc.num_prompt_tokens - 1) // bs
        end = min(int(peer.num_blocks), limit)
        if end <= first:
            return alloc
        xid, gen = f"{alloc.request_id}-pull", next(self._generations)
        # Cached blocks only move (no compute): a pull gets one I/O deadline, not a lease.
        rpc_timeout, lease = (min(t, self.config.transfer.io_timeout_s)
                              for t in self._timeouts(deadline))
        landed = self.receiver.expect(xid, whole_blocks(alloc.block_ids[first:end]), gen, lease)
        call = pb.FetchKVRequest(
            request_id=xid, block_hashes=alloc.block_hashes[first:end],
            dest=pb.KVDestination(transport_address=self._address, generation=gen,
                                  block_ids=alloc.block_ids[first:end],
                                  worker_id=self.worker.config.worker_id))
        try:
            resp = await pb_grpc.WorkerStub(self._channel(peer.address)).FetchKV(
                call, timeout=rpc_timeout, metadata=(("x-request-id", alloc.request_id),))
            await asyncio.wait_for(asyncio.shield(landed), lease)
            await self._landed(list(alloc.block_ids[first:end]), list(resp.kv_scales))
        except asyncio.CancelledError:
            await self._fence(xid, landed, "request cancelled")
            raise
        except (grpc.aio.AioRpcError, KVTransferError, asyncio.TimeoutError) as e:
            miss = isinstance(e, grpc.aio.AioRpcError) \
                and e.code() == grpc.StatusCode.FAILED_PRECONDITION
            self._pulls.labels("miss" if miss else "error").inc()
            log.info("request %s: pull of %d blocks from %s failed (%s); computing them",
                     alloc.request_id, end - first, peer.worker_id or peer.address,
                     e.details() if isinstance(e, grpc.aio.AioRpcError) else repr(e))
            await self._fence(xid, landed, "peer fetch failed")
            return alloc
        self._pulls.labels("ok").inc()
        log.info("event=peer_fetch request_id=%s blocks=%d from=%s", alloc.request_id,
                 end - first, peer.worker_id)
        return replace(alloc, num_computed_tokens=end * bs)

    async def fetch(self, alloc: RemoteAlloc, request: pb.WorkerGenerateRequest,
                    peer: pb.PrefillPeer, deadline: float | None = None,
                    ) -> pb.PrefillResponse | None:
        """Prefills `request` on `peer` into `alloc`'s blocks; see the module doc.
        `deadline` (time.monotonic) is the caller's: the Prefill call and the transfer's
        lease get what is left of it, capped by the configured timeouts. None: failed,
        and the policy is `recompute`."""
        assert self.receiver is not None
        rid = alloc.request_id
        gen = next(self._generations)
        rpc_timeout, lease = self._timeouts(deadline)
        landed = self.receiver.expect(rid, whole_blocks(alloc.missing_block_ids), gen, lease)
        call = pb.PrefillRequest(
            request_id=rid, token_ids=request.prompt_token_ids, sampling=request.sampling,
            dest=pb.KVDestination(transport_address=self._address, block_ids=alloc.block_ids,
                                  generation=gen, worker_id=self.worker.config.worker_id,
                                  num_computed_tokens=alloc.num_computed_tokens),
            tenant=request.tenant, labels=request.labels, priority=request.priority,
            client_request_id=request.client_request_id)
        if request.HasField("cache_salt"):
            call.cache_salt = request.cache_salt
        try:
            resp = await pb_grpc.PrefillStub(self._channel(peer.address)).Prefill(
                call, timeout=rpc_timeout, metadata=(("x-request-id", rid),))
            await asyncio.wait_for(asyncio.shield(landed), lease)
            await self._landed(list(alloc.missing_block_ids), list(resp.kv_scales))
            self._outcomes.labels("ok").inc()
            return resp
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

    async def _landed(self, block_ids: list[int], kv_scales: list[float]) -> None:
        """Blocks that landed whole, made readable by the engine: the sender's scales
        applied, then (CUDA tensor parallelism) scattered to the ranks; float8 blocks
        without scales fail the hand-off."""
        if self._float8 and not kv_scales:
            raise ProtocolError("float8 KV blocks arrived without the sender's KV scales")
        if self.accept is not None and kv_scales:
            await self.accept(block_ids, kv_scales)
        if self.land is not None:
            await self.land(block_ids)

    async def _fence(self, rid: str, landed: asyncio.Future[None], reason: str) -> None:
        """Fences the transfer and waits until its blocks are safe to reuse (no write
        still landing: an in-place grant answered, or past the bound the receiver
        keeps, `InPlaceReceiver._revoke`: no guess here that could free them early)."""
        assert self.receiver is not None
        self.receiver.cancel(rid, reason)
        with contextlib.suppress(BaseException):
            await asyncio.shield(landed)
