"""The in-process block index's bitmap walk answers what the plain walk over every
(block, holder) pair answers (RedisBlockIndex._walk's semantics), on random histories
of stores and removals in every tier."""

from __future__ import annotations

import random

from kvtransfer.index import TIERS, IndexLookup, tier_rank
from sim.index import InProcessBlockIndex


def plain_walk(state: dict[int, dict[str, set[str]]], hashes: list[int],
               nodes: frozenset[str] | None) -> IndexLookup:
    runs: dict[str, list[str]] = {}
    i = 0
    for h in hashes:
        holders = {n: min(t, key=tier_rank) for n, t in state.get(h, {}).items()
                   if t and (nodes is None or n in nodes)}
        if not holders:
            break
        for n, tier in holders.items():
            run = runs.setdefault(n, [])
            if len(run) == i:
                run.append(tier)
        i += 1
    return IndexLookup(i, {n: tuple(r) for n, r in runs.items() if r})


def test_bitmap_walk_matches_the_plain_walk() -> None:
    rng = random.Random(7)
    names = [f"w{i}" for i in range(70)]  # past 64: bitmaps wider than a machine word
    idx = InProcessBlockIndex()
    state: dict[int, dict[str, set[str]]] = {}
    chain = list(range(12))
    for step in range(3000):
        node = rng.choice(names)
        tier = rng.choice(TIERS) if rng.random() < 0.3 else "device"
        if rng.random() < 0.6:  # mostly prefixes: runs that share a chain
            ops = [(h, tier) for h in chain[:rng.randint(1, len(chain))]]
        else:
            ops = [(rng.choice(chain), tier) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.35:
            idx.apply(node, removed=ops)
            for h, t in ops:
                state.get(h, {}).get(node, set()).discard(t)
        else:
            idx.apply(node, stored=ops)
            for h, t in ops:
                state.setdefault(h, {}).setdefault(node, set()).add(t)
        if step % 7 == 0:
            allowed = None if step % 3 else frozenset(rng.sample(names, 40))
            start = rng.randint(0, 2)
            got = idx.lookup_now(chain[start:], allowed)
            want = plain_walk(state, chain[start:], allowed)
            assert got.num_blocks == want.num_blocks and got.nodes == want.nodes, step
    assert idx.num_entries() == sum(1 for h in state.values() for t in h.values() if t)
