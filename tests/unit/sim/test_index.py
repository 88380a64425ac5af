"""The in-process block index's bitmap walk answers what the plain walk over every
(block, holder) pair answers (RedisBlockIndex._walk's semantics), on random histories
of stores and removals in every tier."""

from __future__ import annotations

import random

import pytest

import sim.index
from kvtransfer.index import TIERS, IndexLookup, tier_rank
from sim.gateway import run_sync
from sim.index import InProcessBlockIndex
from sim.segments import LOW, SEGMENT_SHIFT, runs_of, runs_of_lazily


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


@pytest.mark.parametrize("keep", [64, 1])
def test_device_walk_matches_the_general_walk(keep: int, monkeypatch) -> None:
    """An index with the device tier alone (the walk skips the other tiers) against a
    twin that also holds one unrelated block on the host (the walk checks them). Same events
    (hashes listed twice, in both lists of one call, generators): the same lookups,
    to the order of the runs (routing iterates it), and the plain walk's answer. Also
    with every set of holders kept for the next lookups (`keep` 1; 64 by default)."""
    monkeypatch.setattr(sim.index, "_KEEP_HOLDERS", keep)
    rng = random.Random(11)
    names = [f"w{i}" for i in range(70)]
    fast, general = InProcessBlockIndex(), InProcessBlockIndex()
    fast.apply_device(names[0])
    general.apply(names[0], stored=[(-1, "host")])  # never queried: the general walk
    state: dict[int, dict[str, set[str]]] = {}
    chains = [list(range(100 * c, 100 * c + 16)) for c in range(3)]
    for c in chains[1:]:
        c[:4] = chains[0][:4]  # a shared prefix, then their own blocks
    for step in range(2500):
        node = rng.choice(names)
        chain = rng.choice(chains)
        if rng.random() < 0.5:
            stored = chain[:rng.randint(1, len(chain))]
        else:
            stored = [rng.choice(chain) for _ in range(rng.randint(0, 3))]
        removed = [rng.choice(chain) for _ in range(rng.randint(0, 3))] \
            if rng.random() < 0.4 else []
        for idx in (fast, general):
            if step % 5 == 0:  # generators, read once
                idx.apply_device(node, (h for h in stored), (h for h in removed))
            else:
                idx.apply_device(node, tuple(stored), removed)
        for h in removed:
            state.get(h, {}).get(node, set()).discard("device")
        for h in stored:
            state.setdefault(h, {}).setdefault(node, set()).add("device")
        if step % 3 == 0:
            allowed = (None, frozenset(rng.sample(names, 30)), set(rng.sample(names, 69)),
                       frozenset(names), frozenset())[step % 5]
            query = rng.choice(chains)[rng.randint(0, 1):rng.randint(6, 16)]
            # the same query again: the runs already built; a shorter one: the same
            # nodes end, at other depths
            # (a lookup's mapping is read, never changed: it may be a kept one, shared)
            for q in (query, query, query[:-2]):
                got = fast.lookup_now(q, allowed)
                want = general.lookup_now(q, allowed)
                assert got.num_blocks == want.num_blocks, step
                assert list(got.nodes.items()) == list(want.nodes.items()), step
            plain = plain_walk(state, q, None if allowed is None else frozenset(allowed))
            assert got.num_blocks == plain.num_blocks and got.nodes == plain.nodes, step
    assert {c: (s.any, s.full, s.length, s.masks) for c, s in fast._segments.items()} \
        == {c: (s.any, s.full, s.length, s.masks) for c, s in general._segments.items()}
    assert fast.num_entries() + 1 == general.num_entries()


@pytest.mark.parametrize("keep", [64, 1])
def test_segment_walk_matches_the_plain_walk(keep: int, monkeypatch) -> None:
    """Hashes laid out as the simulator's (sim/workload.py: a segment's blocks are
    consecutive ints): prompts of shared and own segments, stored as a pool stores
    them (prefixes), evicted tail first or at random, in batches long enough for the
    vectorized runs and short ones; every lookup is the plain walk's answer (also with
    every set of holders kept for the next lookups: `keep` 1)."""
    monkeypatch.setattr(sim.index, "_KEEP_HOLDERS", keep)
    rng = random.Random(5)
    names = [f"w{i}" for i in range(70)]
    idx = InProcessBlockIndex()
    state: dict[int, dict[str, set[str]]] = {}

    def seg(c: int, n: int) -> list[int]:
        return [c << SEGMENT_SHIFT | j for j in range(n)]

    system = seg(1, 20) + seg(2, 7)  # shared by every prompt
    prompts = [system + seg(10 + p, 32) + seg(100 + p, rng.randint(1, 40)) for p in range(6)]
    prompts += [seg(-3 - p, 5) for p in range(3)]  # negative segments (sampled tokens')
    for step in range(3000):
        node = rng.choice(names)
        p = rng.choice(prompts)
        removed: list[int] = []
        if rng.random() < 0.5:
            stored = p[:rng.randint(1, len(p))]
        else:
            stored = rng.sample(p, rng.randint(0, min(20, len(p))))
        if rng.random() < 0.5:
            removed = p[-rng.randint(1, len(p)):][::-1]  # tail first, as evictions come
        elif rng.random() < 0.5:
            removed = [rng.choice(p) for _ in range(rng.randint(1, 30))]  # repeats too
        idx.apply_device(node, stored, removed)
        for h in removed:
            state.get(h, {}).get(node, set()).discard("device")
        for h in stored:
            state.setdefault(h, {}).setdefault(node, set()).add("device")
        if step % 4 == 0:
            allowed = (None, frozenset(rng.sample(names, 30)), frozenset())[step % 3]
            q = rng.choice(prompts)
            q = q[rng.choice((0, 0, 3)):]
            got = idx.lookup_now(q, allowed)
            want = plain_walk(state, q, allowed)
            assert got.num_blocks == want.num_blocks and got.nodes == want.nodes, step
            assert list(got.nodes) == sorted(got.nodes, key=lambda n: (
                len(got.nodes[n]), idx._bit[n])), step  # by run length, then node number
    assert idx.num_entries() == sum(1 for h in state.values() for t in h.values() if t)
    every = {h for p in prompts for h in p}
    assert run_sync(idx.holders(sorted(every))) == {
        h: frozenset(n for n, t in state.get(h, {}).items() if t) for h in every}


def _plain_runs(hashes: list[int]) -> list[tuple[int, int, int]]:
    """Runs block by block: each hash one past the last and in its segment joins it."""
    out: list[tuple[int, int, int]] = []
    prev = None
    for h in hashes:
        if prev is not None and h == prev + 1 and h & LOW:
            c, j, m = out[-1]
            out[-1] = (c, j, m + 1)
        else:
            out.append((h >> SEGMENT_SHIFT, h & LOW, 1))
        prev = h
    return out


def test_runs_are_the_plain_runs() -> None:
    """runs_of, the walk's lazy runs (a whole segment's range in one comparison) and the
    unordered runs (found up or down, then sorted) are the block-by-block runs on any
    list: consecutive or not, going up or down, negative, long, broken mid-segment,
    with repeats."""
    rng = random.Random(3)
    for t in range(4000):
        hashes: list[int] = []
        if t % 3 == 0:
            hashes = [rng.randrange(-100, 100) for _ in range(rng.randrange(40))]
        else:
            for _ in range(rng.randrange(6)):
                base = rng.randrange(-50, 50) << SEGMENT_SHIFT | rng.randrange(32)
                run = list(range(base, base + rng.randrange(1, 70)))
                hashes += run[::-1] if rng.random() < 0.5 else run  # freed tail first
            for _ in range(t % 3 * rng.randrange(3)):  # a block off by one here and there
                if hashes:
                    i = rng.randrange(len(hashes))
                    hashes[i] += rng.choice((-1, 1))
        want = _plain_runs(hashes)
        assert runs_of(hashes) == want, hashes
        assert runs_of(tuple(hashes)) == want, hashes
        assert list(runs_of_lazily(hashes)) == want, hashes
        assert runs_of(hashes, ordered=False) == _plain_runs(sorted(hashes)), hashes


def test_deferred_removals_take_effect_at_their_times() -> None:
    """A decode window's evictions deferred to its iterations' starts: every read (the
    walk, holders, the entry count) sees them exactly from their times on, as removals
    applied then would show; `settle` applies the due ones the reads left and drops the
    later ones (the window was cut before their iterations)."""
    now = [0.0]
    idx, twin = InProcessBlockIndex(lambda: now[0]), InProcessBlockIndex()
    seg = [1 << SEGMENT_SHIFT | j for j in range(8)] + [2 << SEGMENT_SHIFT | j for j in range(4)]
    for i in (idx, twin):
        i.apply_device("a", seg)
        i.apply_device("b", seg[:6])
    # "a" loses blocks 9, 2 and 5 at 1.0, 2.0 and 3.0; "b" block 4 at 2.5
    da = idx.defer("a", [seg[9], seg[2], seg[5]], [1.0, 2.0, 3.0])
    db = idx.defer("b", [seg[4]], [2.5])
    for t, gone in ((0.5, []), (1.0, [("a", 9)]), (2.2, [("a", 2)]), (2.7, [("b", 4)])):
        now[0] = t
        for node, j in gone:
            twin.apply_device(node, (), [seg[j]])
        for start in (0, 3, 8):
            assert idx.lookup_now(seg[start:]) == twin.lookup_now(seg[start:]), (t, start)
        assert run_sync(idx.holders(seg)) == run_sync(twin.holders(seg))
    assert idx.num_entries() == twin.num_entries()
    idx.settle(db, 2.7)  # already applied by the reads: nothing more
    idx.settle(da, 2.7)  # cut before 3.0: block 5 stays with "a"
    now[0] = 9.0
    assert idx.lookup_now(seg) == twin.lookup_now(seg)
    assert idx.num_entries() == twin.num_entries() and not idx._deferred
    # settled before any read: the due ones at once
    d = idx.defer("b", [seg[0], seg[1]], [5.0, 20.0])
    idx.settle(d, 9.0)
    twin.apply_device("b", (), [seg[0]])
    assert idx.lookup_now(seg) == twin.lookup_now(seg)
    assert idx.num_entries() == twin.num_entries()
