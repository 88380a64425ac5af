"""A real worker with vLLM's --kv-events-config: a ZMQ subscriber that declares the
event structs as vLLM's example subscriber does (examples/online_serving/
kv_events_subscriber.py) decodes every batch after real requests; sequence numbers are
consecutive from the AllBlocksCleared a (re)started worker sends first; stored blocks
carry the prompt's full blocks' token ids; removals follow evictions; replay resends
from a given number."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import zmq

from cluster.launcher import ClusterSpec, LocalCluster, free_port
from tests.factories import tiny_model_dir
from tests.integration.serving_util import call_http

BLOCK = 16
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# As vLLM declares them for its subscribers (vllm/distributed/kv_events.py).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,  # type: ignore[call-arg]
                   tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)


def _drain(sub: zmq.Socket, quiet_s: float = 1.0) -> list[tuple[int, KVEventBatch]]:
    out = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    return out


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    try:
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
        raise AssertionError("no end marker from the replay socket")
    finally:
        dealer.close(linger=0)


def test_vllm_subscriber_decodes_the_workers_kv_events(tmp_path) -> None:
    pub, replay = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
           "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    # 24 blocks: the later prompts evict the earlier ones' blocks.
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_colocated=1,
                       worker_args=("--num-blocks", "24", "--block-size", str(BLOCK),
                                    "--kv-events-config", json.dumps(cfg)),
                       log_dir=str(tmp_path / "logs"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        with LocalCluster(spec) as cluster:
            sub.connect(f"tcp://127.0.0.1:{pub}")
            time.sleep(0.5)  # PUB drops what it sends before the subscription lands
            prompts = [[(7 * i + j) % 500 + 3 for j in range(5 * BLOCK + 3)] for i in range(6)]
            for p in prompts:
                status, body, _ = call_http(cluster.http_port, "POST", "/v1/completions", {
                    "prompt": p, "max_tokens": 2, "temperature": 0})
                assert status == 200, body
            got = _drain(sub)
            # Replay from 0: the AllBlocksCleared this worker sent when it started, then
            # every batch the subscriber saw, consecutive.
            replayed = _replay(ctx, f"tcp://127.0.0.1:{replay}", 0)
            tail = _replay(ctx, f"tcp://127.0.0.1:{replay}", replayed[-1][0])
    finally:
        sub.close(linger=0)
        ctx.term()
    seqs = [s for s, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    assert [s for s, _ in replayed] == list(range(len(replayed)))
    assert replayed[0][1].events == [AllBlocksCleared()]
    assert [b for s, b in replayed if s >= seqs[0]] == [b for _, b in got]
    events = [e for _, b in replayed for e in b.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert all(e.block_size == BLOCK and e.medium == "GPU" and e.lora_id is None
               and len(e.token_ids) == BLOCK * len(e.block_hashes) for e in stored)
    # Each prompt's 5 full blocks were stored with its tokens (output blocks aside).
    tokens = [t for e in stored for t in e.token_ids]
    for p in prompts:
        full = p[:5 * BLOCK]
        assert any(tokens[i:i + len(full)] == full for i in range(0, len(tokens), BLOCK)), p[:3]
    # 6 prompts x 6 blocks > 24: blocks were evicted, and each removal names a stored hash.
    hashes = {h for e in stored for h in e.block_hashes}
    assert removed and removed <= hashes
    # Replay from a later number resends from there only.
    assert replayed[-1][0] == seqs[-1] and tail == replayed[-1:]


def test_host_tier_blocks_are_cpu_events(tmp_path) -> None:
    """A worker with a host tier: the blocks it copies there are announced as medium
    "CPU" (hashes of blocks first stored on the GPU), with no token ids, as vLLM's
    offloading connector announces them."""
    pub, replay = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
           "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_colocated=1,
                       worker_args=("--num-blocks", "24", "--block-size", str(BLOCK),
                                    "--host-cache-blocks", "64",
                                    "--kv-events-config", json.dumps(cfg)),
                       log_dir=str(tmp_path / "logs"))
    ctx = zmq.Context()
    try:
        with LocalCluster(spec) as cluster:
            for i in range(4):
                p = [(11 * i + j) % 500 + 3 for j in range(4 * BLOCK + 1)]
                status, body, _ = call_http(cluster.http_port, "POST", "/v1/completions", {
                    "prompt": p, "max_tokens": 2, "temperature": 0})
                assert status == 200, body
            deadline = time.monotonic() + 20
            while True:  # the tier copies run off the step loop: wait for them
                events = [e for _, b in _replay(ctx, f"tcp://127.0.0.1:{replay}", 0)
                          for e in b.events]
                cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
                if len({h for e in cpu for h in e.block_hashes}) >= 16 \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    finally:
        ctx.term()
    gpu = {h for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
           for h in e.block_hashes}
    on_host = {h for e in cpu for h in e.block_hashes}
    assert len(on_host) >= 16 and on_host <= gpu
    assert all(e.token_ids == [] and e.parent_block_hash is None and e.block_size == BLOCK
               for e in cpu)
