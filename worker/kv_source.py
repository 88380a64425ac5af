"""Peer fetch, the holder's side: `FetchKV` writes blocks this worker holds (device
prefix cache, else its offload tiers) into another worker's blocks over kvtransfer.

For one call: pin the blocks holding the asked hashes on the engine thread (they can
be neither evicted nor reused while pinned), push them to the asker's receiver, unpin.
All or nothing: if any block is gone (evicted since the index said otherwise) nothing
is written and the asker computes instead.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from prometheus_client import CollectorRegistry, Counter

from engine.async_llm import AsyncLLM
from engine.block_hash import BlockHash
from engine.kv_scales import wire_scales
from kvtransfer.errors import KVTransferError
from kvtransfer.pusher import KVPusher
from protos import splitserve_pb2 as pb

log = logging.getLogger(__name__)


class KVSource:
    def __init__(self, llm: AsyncLLM, pusher: KVPusher, io_timeout_s: float,
                 registry: CollectorRegistry | None = None) -> None:
        self.llm = llm
        self.pusher = pusher
        self.io_timeout_s = io_timeout_s
        self._served = Counter("splitserve:peer_fetch_served", "FetchKV calls served, by "
                               "outcome (ok, miss: blocks gone, error: transfer failed)",
                               ["outcome"], registry=registry or CollectorRegistry())

    async def fetch(self, request: pb.FetchKVRequest,
                    context: grpc.aio.ServicerContext) -> pb.FetchKVResponse:
        hashes: list[BlockHash] = list(request.block_hashes)
        dest = request.dest
        if not hashes or len(dest.block_ids) != len(hashes) or not dest.transport_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "FetchKV needs one destination block per hash and an address")
        ids = await self.llm.call(lambda eng: eng.pin_cached(hashes))
        try:
            if len(ids) < len(hashes):
                self._served.labels("miss").inc()
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"holds {len(ids)} of the {len(hashes)} blocks asked for")
            left = context.time_remaining()
            timeout = min(self.io_timeout_s, left) if left else self.io_timeout_s
            try:
                await self.pusher.push(dest.transport_address, request.request_id,
                                       int(dest.generation), ids, list(dest.block_ids),
                                       timeout_s=timeout)
            except KVTransferError as e:
                self._served.labels("error").inc()
                log.warning("request %s: FetchKV to %s failed: %s", request.request_id,
                            dest.worker_id, e)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
            # (the scales they were written under, read while they are still pinned)
            scales = await self.llm.call(lambda eng: wire_scales(eng.runner))
        finally:
            await asyncio.shield(self.llm.call(lambda eng: eng.unpin(ids)))
        self._served.labels("ok").inc()
        log.info("event=peer_fetch_served request_id=%s blocks=%d to=%s", request.request_id,
                 len(ids), dest.worker_id)
        return pb.FetchKVResponse(num_blocks=len(ids), kv_scales=scales)
