"""Tenants on the real Scheduler + KVCacheManager, driven step by step on a synthetic
step clock (no model): VTC against FCFS, weights, max_running, time slices, priority.

The clock charges each step 10 ms plus 20 us per scheduled token (a memory-bound decode
step and a cheap prefill token); every request asks for 256 prompt and 16 output tokens.
"""

from __future__ import annotations

import statistics
from typing import Any

from engine import strategies as st
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

STEP_S, TOKEN_S = 0.010, 0.000020
PROMPT, OUTPUT = 256, 16


class Sim:
    """One scheduler, arrivals at fixed rates per tenant, a step clock."""

    def __init__(self, policy: str, strategies: dict[str, Any] | None = None,
                 num_blocks: int = 1024, block_size: int = 16, max_num_seqs: int = 32,
                 budget: int = 512) -> None:
        self.t = 0.0
        self.s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                           max_num_batched_tokens=budget, policy=policy),
                           KVCacheManager(num_blocks, block_size), clock=lambda: self.t)
        if strategies is not None:
            self.s.set_strategies(st.parse(strategies))
        self.ttft: dict[str, list[float]] = {}
        self.n = 0

    def add(self, tenant: str, prompt: int = PROMPT, output: int = OUTPUT) -> Request:
        self.n += 1
        r = Request(f"{tenant}-{self.n}", [(self.n * 7919 + j) % 30000 for j in range(prompt)],
                    SamplingParams(max_tokens=output, ignore_eos=True), tenant=tenant,
                    arrival_time=self.t)
        self.s.add_request(r)
        return r

    def step(self) -> SchedulerOutput:
        out = self.s.schedule()
        self.t += STEP_S + TOKEN_S * out.num_tokens
        sampled = {x.request.request_id: (1, None) for x in out.scheduled
                   if x.request.num_computed_tokens + x.num_new_tokens >= x.request.num_tokens}
        for r in self.s.update_from_output(out, sampled):
            if r.num_output_tokens == 1:
                self.ttft.setdefault(r.tenant, []).append(self.t - r.arrival_time)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                self.s.finish(r.request_id, RequestStatus.FINISHED_LENGTH)
        self.s.kv.check_integrity()
        return out

    def run(self, rates: dict[str, float], until: float) -> None:
        due = dict.fromkeys(rates, self.t)
        while self.t < until:
            for tenant, rate in rates.items():
                while due[tenant] <= self.t:
                    self.add(tenant)
                    due[tenant] += 1.0 / rate
            self.step()

    def served(self, tenant: str) -> float:
        """Tokens served, weighted as VTC counts them (prompt 1, output 2)."""
        v = self.s.fair.served.get(tenant)
        return 0.0 if v is None else v.prompt_tokens + 2.0 * v.output_tokens


def light_ttft_p50(policy: str, heavy_rate: float, light_rate: float = 12.0) -> float:
    sim = Sim(policy)
    rates = {"light": light_rate} | ({"heavy": heavy_rate} if heavy_rate else {})
    sim.run(rates, until=6.0)
    if heavy_rate:
        assert len(sim.s.waiting) > 100  # heavy is past capacity: a backlog builds
    return statistics.median(sim.ttft["light"])


def test_vtc_keeps_a_light_tenant_fast_while_fcfs_queues_it_behind_a_flood() -> None:
    solo = light_ttft_p50("vtc", heavy_rate=0)
    assert light_ttft_p50("fcfs", heavy_rate=0) == solo  # no contention: same schedule
    vtc = light_ttft_p50("vtc", heavy_rate=120.0)  # 10x the light tenant's rate
    fcfs = light_ttft_p50("fcfs", heavy_rate=120.0)
    assert vtc <= 1.5 * solo, (vtc, solo)
    assert fcfs > 10 * solo, (fcfs, solo)


def _paper_bound(sim: Sim) -> float:
    """Theorem 4.4 of the VTC paper: two backlogged clients' service differs by at most
    2U, U = max(w_p * L_input, w_q * M), M the tokens a batch can hold (the KV pool)."""
    kv_tokens = sim.s.kv.pool.num_blocks * sim.s.kv.block_size
    return 2 * max(1.0 * PROMPT, 2.0 * kv_tokens)


def test_vtc_backlogged_tenants_get_equal_service_within_the_paper_bound() -> None:
    sim = Sim("vtc")
    sim.run({"a": 150.0, "b": 50.0}, until=1.0)  # both past their half of ~90 req/s
    a0, b0 = sim.served("a"), sim.served("b")
    worst = 0.0
    while sim.t < 5.0:
        sim.run({"a": 150.0, "b": 50.0}, until=sim.t + 0.05)
        worst = max(worst, abs((sim.served("a") - a0) - (sim.served("b") - b0)))
    assert {r.tenant for r in sim.s.waiting} == {"a", "b"}  # still both backlogged
    assert worst <= _paper_bound(sim)
    assert worst <= 2 * (PROMPT + 2 * OUTPUT)  # in fact within two requests' worth
    share = (sim.served("a") - a0) / (sim.served("b") - b0)
    assert 0.95 < share < 1.05, share
    # FCFS serves them in proportion to their arrival rates instead
    f = Sim("fcfs")
    f.run({"a": 150.0, "b": 50.0}, until=5.0)
    assert f.served("a") / f.served("b") > 2.5


def test_weights_two_to_one_give_a_two_to_one_share() -> None:
    sim = Sim("vtc", {"scheduling": [
        {"weight": 2, "selectors": [{"key": "tenant", "value": "gold"}]}]})
    sim.run({"gold": 100.0, "free": 100.0}, until=1.0)
    g0, f0 = sim.served("gold"), sim.served("free")
    sim.run({"gold": 100.0, "free": 100.0}, until=5.0)
    assert {r.tenant for r in sim.s.waiting} == {"gold", "free"}
    share = (sim.served("gold") - g0) / (sim.served("free") - f0)
    assert abs(share - 2.0) <= 0.2, share


def test_max_running_caps_a_tenant_and_follows_a_live_change() -> None:
    sim = Sim("vtc", {"scheduling": [
        {"max_running": 3, "selectors": [{"key": "tenant", "value": "batch"}]}]})
    for _ in range(20):
        sim.add("batch")
    sim.add("chat")
    seen = []
    for _ in range(30):
        sim.step()
        seen.append(sum(r.tenant == "batch" for r in sim.s.running))
    assert max(seen) == 3 and sim.ttft["chat"]  # capped, and the other tenant ran
    sim.s.set_strategies(st.EMPTY)  # lifted: the next step admits more
    sim.step()
    assert sum(r.tenant == "batch" for r in sim.s.running) > 3


def _one_seat(strategies: dict[str, Any] | None) -> tuple[Sim, Request, Request]:
    sim = Sim("fcfs", strategies, max_num_seqs=1)
    long = sim.add("a", prompt=32, output=200)
    sim.step()
    short = sim.add("a", prompt=32, output=4)
    return sim, long, short


def test_a_time_slice_lets_a_waiting_request_of_the_same_priority_in() -> None:
    # no slice: the short request waits for the long one to finish
    sim, long, short = _one_seat(None)
    for _ in range(40):
        sim.step()
    assert short.num_output_tokens == 0 and long.status == RequestStatus.RUNNING
    # a 50 ms slice: the long request yields once it has run that long, and comes back
    sim, long, short = _one_seat({"scheduling": [
        {"execution_time": 50_000_000, "selectors": [{"key": "tenant", "value": "a"}]}]})
    steps = 0
    while short.status != RequestStatus.FINISHED_LENGTH:
        sim.step()
        steps += 1
    assert steps <= 10 and long.num_preemptions == 0  # a yield is not a preemption
    assert long.num_output_tokens < 20
    sim.step()
    assert long.status == RequestStatus.RUNNING
    # alone, nobody waits: it never yields again
    before = long.num_output_tokens
    for _ in range(30):
        sim.step()
    assert long.num_output_tokens == before + 30


def test_a_priority_strategy_set_mid_run_preempts_lower_requests_under_block_pressure() -> None:
    # 20 blocks of 16 tokens: three 88-token prompts hold 18, a 64-token one needs 4
    sim = Sim("vtc", num_blocks=20, max_num_seqs=8)
    low = [sim.add("free", prompt=88, output=64) for _ in range(3)]
    sim.step()
    gold = sim.add("gold", prompt=64, output=8)
    for _ in range(3):
        sim.step()
    assert gold.num_output_tokens == 0  # without a strategy it waits its turn for blocks
    sim.s.set_strategies(st.parse({"scheduling": [
        {"priority": True, "selectors": [{"key": "tenant", "value": "gold"}]}]}))
    out = sim.step()
    assert gold in {x.request for x in out.scheduled}
    assert out.preempted and all(r.tenant == "free" for r in out.preempted)
    while gold.status != RequestStatus.FINISHED_LENGTH:
        sim.step()
    while any(r.status != RequestStatus.FINISHED_LENGTH for r in low):
        sim.step()
    assert all(r.num_output_tokens == 64 for r in low)
    assert sim.s.stats().tenants["free"].preemptions >= 1
    assert sim.s.kv.pool.num_free_blocks == sim.s.kv.pool.num_blocks


def test_a_request_id_strategy_targets_the_clients_id_not_the_engines() -> None:
    # The gateway sends "<client id>-<8 hex>" as the engine's id and the client's id beside
    # it; a prefill worker runs "prefill-<that>": the strategy names the client's id.
    sim = Sim("vtc", strategies={"scheduling": [{"priority": True, "request_id": "vip"}]})
    r = Request("vip-0badc0de", [1, 2, 3], SamplingParams(max_tokens=2), client_id="vip")
    other = Request("vip", [1, 2, 3], SamplingParams(max_tokens=2), client_id="someone")
    sim.s.add_request(r)
    sim.s.add_request(other)
    assert r.policy.priority and not other.policy.priority


def test_priority_preemption_on_a_real_engine_resumes_token_identical() -> None:
    from engine.llm import LLM
    from tests.factories import tiny_model_dir

    def run(strategy_at: int | None, num_blocks: int = 24,
            ) -> tuple[dict[str, list[int]], list[str], int]:
        eng = LLM(tiny_model_dir("llama"), dtype="float32", block_size=4,
                  num_blocks=num_blocks, policy="vtc").engine
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for i in range(3):  # 3 x (20 + 24 tokens) need 33 blocks: the pool is short
            eng.add_request(f"free-{i}", [(31 * i + 7 * j) % 400 + 5 for j in range(20)],
                            greedy, tenant="free")
        done: dict[str, list[int]] = {}
        order: list[str] = []
        steps = 0
        while eng.has_work() or steps < 4:
            if steps == 3:
                eng.add_request("gold-0", [(11 * j) % 300 + 9 for j in range(20)],
                                SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                                tenant="gold", labels={"tier": "paid"})
            if steps == strategy_at:
                eng.set_strategies(st.parse({"scheduling": [
                    {"priority": True, "selectors": [{"key": "tier", "value": "paid"}]}]}))
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
                    order.append(out.request_id)
            steps += 1
        eng.check_integrity()
        return done, order, eng.stats().tenants["free"].preemptions

    undisturbed, _, none = run(None, num_blocks=256)
    _, fair_order, _ = run(None)
    prio, prio_order, preempted = run(strategy_at=4)
    assert fair_order[0] != "gold-0"  # without the strategy it waits for blocks
    assert prio_order[0] == "gold-0" and preempted > 0 and none == 0
    assert prio == undisturbed  # preempted requests resumed token-identical
