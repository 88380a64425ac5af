"""KV events on vLLM's wire: what vLLM's `ZmqEventPublisher` publishes, for consumers
written against vLLM (llm-d's KV-cache indexer, Dynamo's router, SGLang's model gateway).

Each engine step's block events become one `KVEventBatch` (msgpack, msgspec structs
declared as vLLM declares them: array-like, tagged), sent on a PUB socket as the
multipart message `[topic, 8-byte big-endian sequence number, payload]`. The last
`buffer_steps` batches stay in memory; a ROUTER socket (`replay_endpoint`) answers
`[identity, b"", start sequence]` with every buffered batch from that number on, as
`[identity, b"", sequence, payload]`, then `[identity, b"", -1 (8 bytes, signed), b""]`.
The first batch (sequence 0) is `AllBlocksCleared`: a restarted worker holds nothing.

The device tier's blocks are medium "GPU" (vLLM's name for the engine's own cache,
whatever the device); the offload tiers' (kvtransfer/tiers) are "CPU" (host) and "DISK"
(disk), as vLLM's offloading connector names its media, sent when a block is stored in
or removed from a tier (demotion: removed from one, stored in the next). Tier events
carry no token ids and no parent hash, as vLLM's offloading events do. LMCache's tier
is shared storage, not this node's medium: not published. The Redis index
(worker/kv_events.py) stays the gateway's source; this publisher is beside it.

Ownership: the publisher owns its sockets and its thread (`start` / `close`); the engine
calls `on_engine_events` from its own thread (a non-blocking queue put).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import msgspec

from engine.block_hash import BlockHash
from engine.block_pool import BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
# Offload tier name (kvtransfer/tiers) -> vLLM's medium.
TIER_MEDIUM = {"host": "CPU", "disk": "DISK"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# -- vLLM's structs (vllm/distributed/kv_events.py) ------------------------------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,  # type: ignore[call-arg]
                   tag=True):
    """Base class for all KV cache-related events."""


class ZmqBlockStored(KVCacheEvent, tag="BlockStored"):  # type: ignore[call-arg]
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ZmqBlockRemoved(KVCacheEvent, tag="BlockRemoved"):  # type: ignore[call-arg]
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[ZmqBlockStored | ZmqBlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


# -- config ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (`--kv-events-config` JSON), same fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "null" or "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv events publisher must be null or zmq, got {self.publisher!r}")
        if min(self.buffer_steps, self.hwm, self.max_queue_size) < 1:
            raise ValueError("buffer_steps, hwm and max_queue_size must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Raises ValueError naming what is wrong (not JSON, an unknown field, a type)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown fields {unknown}; known: "
                             f"{sorted(fields)}")
        for name, value in data.items():
            want: tuple[type, ...] = {"enable_kv_cache_events": (bool,),
                                      "replay_endpoint": (str, type(None))}.get(
                name, (int,) if name in ("buffer_steps", "hwm", "max_queue_size") else (str,))
            if not isinstance(value, want) or (bool not in want and isinstance(value, bool)):
                raise ValueError(f"--kv-events-config: `{name}` has the wrong type: {value!r}")
        return cls(**data)


# -- the publisher -----------------------------------------------------------------------

def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, ipc or inproc address is bound, any other connected."""
    return any(w in endpoint for w in ("*", "::", "0.0.0.0")) \
        or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    def __init__(self, config: KVEventsConfig, block_size: int,
                 data_parallel_rank: int = 0) -> None:
        self.config = config
        self.block_size = block_size
        self.rank = data_parallel_rank
        self.dropped = 0  # batches refused by a full queue
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._thread: threading.Thread | None = None
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None

    def start(self) -> None:
        """Binds (or connects) the sockets and starts the sending thread; the first batch
        is AllBlocksCleared. Raises zmq.ZMQError when an endpoint cannot be bound."""
        import zmq

        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(self.config.hwm)
        if _binds(self.config.endpoint):
            self._pub.bind(self.config.endpoint)
        else:
            self._pub.connect(self.config.endpoint)
        if self.config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(self.config.replay_endpoint)
        self._put(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()],
                               data_parallel_rank=self.rank))
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        log.info("kv events: publishing on %s (replay %s, topic %r)", self.config.endpoint,
                 self.config.replay_endpoint, self.config.topic)

    def on_engine_events(self, events: list[KVEvent]) -> None:
        """The engine's sink (AsyncLLM.add_kv_event_sink): one step's events, one batch."""
        out: list[ZmqBlockStored | ZmqBlockRemoved | AllBlocksCleared] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                out.append(ZmqBlockStored(
                    block_hashes=list(ev.block_hashes), parent_block_hash=ev.parent_hash,
                    token_ids=list(ev.token_ids), block_size=self.block_size, lora_id=None,
                    medium=MEDIUM_GPU))
            elif isinstance(ev, BlockRemoved):
                out.append(ZmqBlockRemoved(block_hashes=list(ev.block_hashes),
                                           medium=MEDIUM_GPU))
        if out:
            self._put(KVEventBatch(ts=time.time(), events=out, data_parallel_rank=self.rank))

    def on_tier_events(self, stored: Sequence[tuple[BlockHash, str]] = (),
                       removed: Sequence[tuple[BlockHash, str]] = ()) -> None:
        """The offload tiers' listener (TieredCache.add_listener; any thread): one call,
        one batch, removals first (a demotion leaves one medium, then enters the next)."""
        out: list[ZmqBlockStored | ZmqBlockRemoved | AllBlocksCleared] = []
        for entries, stores in ((removed, False), (stored, True)):
            by_medium: dict[str, list[BlockHash]] = {}
            for h, tier in entries:
                if tier in TIER_MEDIUM:
                    by_medium.setdefault(TIER_MEDIUM[tier], []).append(h)
            for medium, hashes in by_medium.items():
                out.append(ZmqBlockStored(
                    block_hashes=list(hashes), parent_block_hash=None, token_ids=[],
                    block_size=self.block_size, lora_id=None, medium=medium) if stores
                    else ZmqBlockRemoved(block_hashes=list(hashes), medium=medium))
        if out:
            self._put(KVEventBatch(ts=time.time(), events=out, data_parallel_rank=self.rank))

    def _put(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # never block the engine: the consumer replays or resyncs
            self.dropped += 1

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = count()
        topic = self.config.topic.encode()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a malformed request must not stop publishing
                    log.exception("kv events: replay failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(seqs)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            except Exception:
                log.exception("kv events: send failed")
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: invalid replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        """Sends what is queued (up to 1 s), stops the thread, closes the sockets."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=1.0)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
