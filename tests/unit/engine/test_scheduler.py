"""Scheduler logic on its own (no model): budgets, chunking, preemption, policies."""

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput


def make_scheduler(num_blocks=64, block_size=4, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw), KVCacheManager(num_blocks, block_size))


def make_requests(n, prompt_len=10, priority=0, start=0):
    return [Request(f"r{start + i}", [1000 * (start + i) + j for j in range(prompt_len)],
                    SamplingParams(max_tokens=8), priority=priority) for i in range(n)]


def finish_step(s: Scheduler, out: SchedulerOutput, token=7) -> None:
    """Feeds back one sampled token for every request whose computation caught up."""
    sampled = {x.request.request_id: (token, None) for x in out.scheduled
               if x.request.num_computed_tokens + x.num_new_tokens == x.request.num_tokens}
    s.update_from_output(out, sampled)


def scheduled(out):
    return {x.request.request_id: x.num_new_tokens for x in out.scheduled}


def test_token_budget_chunks_prefill():
    s = make_scheduler(max_num_batched_tokens=16)
    for r in make_requests(3):
        s.add_request(r)
    out = s.schedule()
    assert scheduled(out) == {"r0": 10, "r1": 6}
    finish_step(s, out)
    out = s.schedule()
    # Running first: r0 decodes one token, r1 finishes its prompt, r2 gets the rest.
    assert scheduled(out) == {"r0": 1, "r1": 4, "r2": 10}


def test_without_chunked_prefill_a_prompt_waits_for_room():
    s = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    for r in make_requests(2):
        s.add_request(r)
    assert scheduled(s.schedule()) == {"r0": 10}


def test_max_num_seqs():
    s = make_scheduler(max_num_seqs=2)
    for r in make_requests(3):
        s.add_request(r)
    assert set(scheduled(s.schedule())) == {"r0", "r1"}
    assert len(s.waiting) == 1


def test_preempts_least_progressed_and_recomputes():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b = make_requests(2, prompt_len=8)
    b.all_token_ids = b.prompt_token_ids = b.prompt_token_ids[:4]
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    finish_step(s, out)  # a: 8 tokens + 1 sampled (3 blocks), b: 4 + 1 (2 blocks)
    for _ in range(10):
        out = s.schedule()
        if out.preempted:
            break
        finish_step(s, out)
    # Pool is 6 blocks; growth forces a preemption; b has computed fewer tokens.
    assert out.preempted == [b] and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and a.num_preemptions == 0
    assert scheduled(out) == {"r0": 1}
    s.kv.check_integrity()
    # b resumes once blocks free up, recomputing what the prefix cache lost.
    finish_step(s, out)
    s.finish("r0", RequestStatus.FINISHED_LENGTH)
    out = s.schedule()
    assert b.status == RequestStatus.RUNNING
    assert b.num_computed_tokens + scheduled(out)["r1"] == b.num_tokens
    assert b.num_computed_tokens % 4 == 0  # whole cached blocks only
    s.kv.check_integrity()


def test_priority_policy_orders_waiting_and_picks_victims():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    low = make_requests(1, priority=5)[0]
    high = make_requests(1, priority=0, start=1)[0]
    s.add_request(low)
    s.add_request(high)
    assert scheduled(s.schedule()) == {"r1": 10}
    assert s.order.victim([low, high]) is low


def test_finish_frees_blocks_wherever_the_request_is():
    s = make_scheduler()
    reqs = make_requests(3)
    for r in reqs:
        s.add_request(r)
    s.schedule()
    s.finish("r0", RequestStatus.FINISHED_ABORTED)
    s.finish("r2", RequestStatus.FINISHED_ABORTED)
    assert s.finish("nope", RequestStatus.FINISHED_ABORTED) is None
    s.finish("r1", RequestStatus.FINISHED_ABORTED)
    s.kv.check_integrity()
    assert s.kv.pool.num_free_blocks == 64 and not s.has_work()


def test_requests_holding_their_kv_run_past_a_head_that_does_not_fit():
    # 10 blocks of 4 tokens. Two requests whose KV arrived remotely hold 3 blocks each
    # (10-token prompts); a 20-token prompt (5 blocks) waits ahead of them with 4 free.
    # Kept behind it, the holders would keep the blocks it waits for with nothing running.
    s = make_scheduler(num_blocks=10, block_size=4)
    head = make_requests(1, prompt_len=20)[0]
    s.add_request(head)
    holders = make_requests(2, start=1)
    for r in holders:
        assert s.allocate_remote(r)
        s.remote_kv_ready(r, first_token=7)
    out = s.schedule()
    assert set(scheduled(out)) == {"r1", "r2"}  # each computes its first token's KV
    assert head.status == RequestStatus.WAITING
    finish_step(s, out)
    for r in holders:  # they finish (the engine's stop check) and give their blocks back
        s.finish(r.request_id, RequestStatus.FINISHED_STOPPED)
    assert scheduled(s.schedule()) == {"r0": 20}
