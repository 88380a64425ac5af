"""The block index's walk done by the client: HGETALL of each block's hash, pipelined in
growing chunks (16, 64, 256 ... blocks per round trip), every holder field of every
block parsed in Python. It was RedisBlockIndex.lookup's walk until the walk moved onto
the Redis server (kvtransfer/index_walk.py); it stays as the reference the server
walk is tested against (tests/unit/kvtransfer/test_index_walk.py) and as the baseline
of `splitserve bench index`. Its cost grows with holders x blocks in gateway Python
(~7 ms per lookup when 512 workers hold a 30-block prefix), which is why it moved.

Imports no torch (the gateway's package may import it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtransfer.index import IndexLookup, StaleEntry, tier_rank

if TYPE_CHECKING:
    from engine.block_hash import BlockHash
    from kvtransfer.index import RedisBlockIndex


async def python_walk(index: RedisBlockIndex, hashes: list[BlockHash],
                      nodes: set[str] | frozenset[str] | None = None, first_chunk: int = 16
                      ) -> tuple[IndexLookup, list[StaleEntry]]:
    """RedisBlockIndex.lookup's answer, read with plain HGETALLs (no breaker, no deadline,
    no cleanup: the stale entries met on the way are returned, in the order met)."""
    runs: dict[str, list[str]] = {}
    stale: list[StaleEntry] = []
    epochs: dict[str, str] = {}
    i, chunk = 0, first_chunk
    while i < len(hashes):
        pipe = index.client.pipeline(transaction=False)
        if i == 0:
            pipe.hgetall(index.epochs_key)
        keys = [index.block_key(h) for h in hashes[i:i + chunk]]
        for k in keys:
            pipe.hgetall(k)
        rows = await pipe.execute()
        if i == 0:
            epochs = rows.pop(0)
        for key, row in zip(keys, rows, strict=True):
            if not _extend(runs, i, key, row, epochs, nodes, stale):
                return _result(runs, i), stale
            i += 1
        chunk *= 4
    return _result(runs, i), stale


def _extend(runs: dict[str, list[str]], i: int, key: str, row: dict[str, str],
            epochs: dict[str, str], nodes: set[str] | frozenset[str] | None,
            stale: list[StaleEntry]) -> bool:
    """Adds block `i` (its hash row) to the runs of the nodes that hold it and whose run
    reaches block i - 1. False when no allowed node holds it (the chain ends)."""
    best: dict[str, str] = {}
    for field, epoch in row.items():
        node, _, tier = field.rpartition("@")
        if not node or (nodes is not None and node not in nodes):
            continue
        current = epochs.get(node)
        if current is None or epoch != current:
            if current is not None and _older(epoch, current):
                stale.append((key, field, epoch))
            continue
        if node not in best or tier_rank(tier) < tier_rank(best[node]):
            best[node] = tier
    if not best:
        return False
    for node, tier in best.items():
        run = runs.setdefault(node, [])
        if len(run) == i:
            run.append(tier)
    return True


def _older(epoch: str, current: str) -> bool:
    try:
        return int(epoch) < int(current)
    except ValueError:
        return True  # garbage: clean it


def _result(runs: dict[str, list[str]], num_blocks: int) -> IndexLookup:
    return IndexLookup(num_blocks, {n: tuple(r) for n, r in runs.items() if r})
