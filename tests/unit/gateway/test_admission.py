"""The gateway's admission queue: VTC order across tenants (the counter lift, weights),
priority strategies first, max_running, fair shedding when full, deadlines. Room on
workers is a fixed number of slots here; completions are driven by hand, so every
test is exact and takes milliseconds."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.strategies import StrategySet, parse
from gateway.admission import INPUT_COST, OUTPUT_COST, AdmissionQueue, Ticket
from gateway.errors import Overloaded, UpstreamTimeout


class FixedSlots:
    def __init__(self, n: int) -> None:
        self.n = n

    def free(self, outstanding: int) -> int:
        return self.n - outstanding


async def _settle() -> None:
    """Lets every woken admit() return (asyncio.wait resumes a few loop turns later)."""
    for _ in range(10):
        await asyncio.sleep(0)


def _strategies(*items: dict) -> StrategySet:
    return parse({"scheduling": list(items)})


async def _submit(q: AdmissionQueue, tenant: str, n: int, prompt: int = 10,
                  deadline_s: float = 30.0) -> list[asyncio.Task[Ticket]]:
    tasks = [asyncio.create_task(q.admit(tenant, {}, f"{tenant}-{i}", 0, prompt,
                                         time.monotonic() + deadline_s)) for i in range(n)]
    await _settle()  # each reaches the queue, in order
    return tasks


def _granted(tasks: list[asyncio.Task[Ticket]]) -> list[Ticket]:
    return [t.result() for t in tasks if t.done() and not t.exception()]


async def _serve_in_order(q: AdmissionQueue, pending: dict[str, list[asyncio.Task[Ticket]]],
                          rounds: int, output: int) -> list[str]:
    """Completes the oldest running request `rounds` times (each produced `output`
    tokens) and returns the tenants in the order their requests were dispatched."""
    order: list[str] = []
    running: list[Ticket] = []
    seen: set[int] = set()

    def collect() -> None:
        for tasks in pending.values():
            for t in tasks:
                if t.done() and id(t) not in seen and not t.exception():
                    seen.add(id(t))
                    running.append(t.result())
                    order.append(t.result().tenant)
    collect()
    for _ in range(rounds):
        ticket = running.pop(0)
        ticket.charge(output)
        ticket.release()
        await _settle()
        collect()
    return order


def _light_after_heavy_backlog(fair: bool) -> list[str]:
    async def main() -> list[str]:
        q = AdmissionQueue(FixedSlots(1), max_waiting=100, fair=fair)
        heavy = await _submit(q, "heavy", 30)
        light = await _submit(q, "light", 3)
        order = await _serve_in_order(q, {"heavy": heavy, "light": light}, 8, output=20)
        for t in heavy + light:
            t.cancel()
        return order

    return asyncio.run(main())


def test_light_tenant_is_released_before_a_heavy_backlog() -> None:
    """10x the rate: the heavy tenant has 30 waiting when the light one sends; the light
    request is the next dispatched (its counter is lifted to the heavy one's, which
    grows past it as soon as the running heavy request is charged). FCFS, the same
    run: the light requests wait behind the whole backlog."""
    order = _light_after_heavy_backlog(fair=True)
    # heavy's first request held the slot; then light and heavy alternate (equal cost).
    assert order[:7] == ["heavy", "light", "heavy", "light", "heavy", "light", "heavy"]
    assert _light_after_heavy_backlog(fair=False)[:9] == ["heavy"] * 9


def test_weights_two_to_one_give_a_two_to_one_token_share() -> None:
    async def main() -> dict[str, int]:
        q = AdmissionQueue(FixedSlots(2), max_waiting=1000, strategies=_strategies(
            {"weight": 2, "selectors": [{"key": "tenant", "value": "a"}]}))
        a = await _submit(q, "a", 200)
        b = await _submit(q, "b", 200)
        order = await _serve_in_order(q, {"a": a, "b": b}, 150, output=30)
        for t in a + b:
            t.cancel()
        return {t: order.count(t) for t in ("a", "b")}

    served = asyncio.run(main())
    cost = 10 * INPUT_COST + 30 * OUTPUT_COST  # per request: both tenants send the same
    share = served["a"] * cost / (served["b"] * cost)
    assert abs(share - 2.0) / 2.0 < 0.10, served


def test_priority_strategy_first_and_max_running_caps_a_tenant() -> None:
    async def main() -> tuple[list[str], int]:
        q = AdmissionQueue(FixedSlots(3), max_waiting=100)
        bulk = await _submit(q, "bulk", 10)  # takes all three slots
        q.set_strategies(_strategies(
            {"priority": True, "selectors": [{"key": "tenant", "value": "gold"}]},
            {"max_running": 1, "selectors": [{"key": "tenant", "value": "bulk"}]}))
        gold = await _submit(q, "gold", 4)
        order = await _serve_in_order(q, {"bulk": bulk, "gold": gold}, 6, output=5)
        running_bulk = q.running.get("bulk", 0)
        for t in bulk + gold:
            t.cancel()
        return order, running_bulk

    order, running_bulk = asyncio.run(main())
    # Three bulk requests were running before the strategies; gold goes first after,
    # and bulk gets one slot at a time once its cap applies.
    assert order[:3] == ["bulk"] * 3
    assert order[3:7] == ["gold"] * 4
    assert running_bulk == 1


def test_full_queue_sheds_the_biggest_tenants_newest_with_retry_after() -> None:
    async def main() -> None:
        q = AdmissionQueue(FixedSlots(1), max_waiting=4)
        heavy = await _submit(q, "heavy", 5)  # 1 running + 4 waiting: full
        light = await _submit(q, "light", 1)
        # The light request took the place of heavy's newest, which got a 429.
        assert isinstance(heavy[4].exception(), Overloaded)
        assert heavy[4].exception().retry_after >= 1
        assert not light[0].done() and q.waiting() == 4
        more = await _submit(q, "heavy", 1)  # heavy is the biggest: its newcomer goes
        err = more[0].exception()
        assert isinstance(err, Overloaded) and err.status == 429
        assert err.headers()["Retry-After"] == str(err.retry_after)
        heavy[0].result().charge(5)  # its output makes heavy the more-served tenant
        heavy[0].result().release()
        await _settle()
        assert light[0].done()  # the light request is next, ahead of heavy's backlog
        for t in heavy + light:
            t.cancel()

    asyncio.run(main())


def test_deadline_and_cancellation_leave_the_queue() -> None:
    async def main() -> None:
        q = AdmissionQueue(FixedSlots(1), max_waiting=10)
        first = await _submit(q, "t", 1)
        late = await _submit(q, "t", 1, deadline_s=0.05)
        gone = await _submit(q, "u", 1)
        with pytest.raises(UpstreamTimeout):
            await late[0]
        gone[0].cancel()
        await _settle()
        assert q.waiting() == 0
        ticket = first[0].result()
        ticket.release()
        ticket.release()  # idempotent
        assert q.outstanding == 0 and not q.running

    asyncio.run(main())
