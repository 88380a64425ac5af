"""vLLM's KV events for the offload tiers: a real TieredCache (host -> disk) wired to a
real ZMQ publisher; the replay socket returns, in order, the blocks already held when
the listener joined, then each store and removal with vLLM's medium ("CPU" for host,
"DISK" for disk), a demotion as a CPU removal then a DISK store."""

from __future__ import annotations

import time

import msgspec
import zmq

from kvtransfer.tiers import TierConfig
from kvtransfer.tiers.manager import TieredCache
from tests.unit.kvtransfer.test_tiers import LAYOUT, make_blocks
from worker.kv_events_zmq import (
    END_SEQ,
    AllBlocksCleared,
    KVEventBatch,
    KVEventsConfig,
    ZmqBlockRemoved,
    ZmqBlockStored,
    ZmqKVEventPublisher,
)

DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)


def _replay(endpoint: str, want: int) -> list[KVEventBatch]:
    """Every buffered batch from 0, once `want` of them are there (the publisher's
    thread sends them a moment after they are queued)."""
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + 10
        while True:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(endpoint)
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            out = []
            while dealer.poll(5000):
                _, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    break
                out.append(DECODE.decode(payload))
            dealer.close(linger=0)
            if len(out) >= want or time.monotonic() > deadline:
                return out
            time.sleep(0.05)
    finally:
        ctx.term()


def test_host_and_disk_stores_and_removals_are_cpu_and_disk_events(tmp_path) -> None:
    replay = f"ipc://{tmp_path}/replay"
    pub = ZmqKVEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=replay), block_size=LAYOUT.block_size)
    pub.start()
    hashes, data = make_blocks(5)
    try:
        cfg = TierConfig(host_blocks=2, disk_dir=str(tmp_path / "disk"), disk_blocks=2)
        with TieredCache(cfg, LAYOUT) as tc:
            tc.put(hashes[:1], list(data[:1]))  # held before the listener joins
            tc.add_listener(pub.on_tier_events)
            tc.put(hashes[1:3], list(data[1:3]))  # host full: block 0 demoted to disk
            tc.put(hashes[3:5], list(data[3:5]))  # 1, 2 to disk, which drops 0
            got = _replay(replay, 8)
    finally:
        pub.close()

    def stored(medium: str, *idx: int) -> ZmqBlockStored:
        return ZmqBlockStored(block_hashes=[hashes[i] for i in idx], parent_block_hash=None,
                              token_ids=[], block_size=LAYOUT.block_size, lora_id=None,
                              medium=medium)

    def removed(medium: str, *idx: int) -> ZmqBlockRemoved:
        return ZmqBlockRemoved(block_hashes=[hashes[i] for i in idx], medium=medium)

    assert [b.events for b in got] == [
        [AllBlocksCleared()],
        [stored("CPU", 0)],
        [removed("CPU", 0)], [stored("DISK", 0)], [stored("CPU", 1, 2)],
        [removed("CPU", 1, 2)], [removed("DISK", 0), stored("DISK", 1, 2)],
        [stored("CPU", 3, 4)]]
