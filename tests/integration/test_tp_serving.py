"""A tensor-parallel (TP 2, CPU, gloo) colocated worker under `splitserve up`, real
processes: greedy output through the gateway equals transformers'; SIGKILL to rank 1
takes the worker down whole at once, and the supervisor's restart serves again; a hung
rank ends the engine within the collective timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc

from cluster.launcher import ROOT
from protos import splitserve_pb2 as pb
from tests.factories import child_env, hf_greedy, hf_model, tiny_model_dir
from tests.integration.serving_util import wait_for
from tests.integration.test_failover import PROMPT as STREAM_PROMPT
from tests.integration.test_failover import Stream
from tests.integration.test_up_supervision import MAX_TOKENS, PROMPT, Up, _gone, pytestmark

__all__ = ["pytestmark"]
LONG = 200  # tokens: a stream still running when its worker's rank is killed


def _ranks(pid: int) -> list[int]:
    """The tensor-parallel ranks a process spawned (its children but multiprocessing's
    resource tracker), from /proc."""
    kids: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    out = []
    for k in kids:
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                out.append(k)
    return out


def test_tp2_worker_serves_and_a_dead_rank_takes_it_down_whole() -> None:
    hf = hf_model(tiny_model_dir("llama"))
    eos = hf.generation_config.eos_token_id
    expected = hf_greedy(hf, PROMPT, MAX_TOKENS, eos[0] if isinstance(eos, list) else eos)
    up = Up("--colocated", "1", "-tp", "2", "--device", "cpu", "--dtype", "float32",
            "--restart-backoff", "0.2")
    try:
        assert up.generate(PROMPT) == expected
        worker = up.child("colocated-0")
        ranks = _ranks(worker["pid"])
        assert len(ranks) == 1, ranks
        # a stream in flight when the rank dies: it resumes on the restarted worker
        # (token-identical) or ends with a clean error, never hangs
        stream = Stream(f"127.0.0.1:{up.status()['grpc_port']}",
                        pb.SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True))
        stream.start()
        wait_for(lambda: len(stream.tokens) >= 3, 30, "the stream under way")
        t0 = time.monotonic()
        os.kill(ranks[0], signal.SIGKILL)
        wait_for(lambda: _gone(worker["pid"]), 10, "the worker to go down with its rank")
        assert time.monotonic() - t0 < 10
        stream.join(90)
        assert not stream.is_alive()
        if stream.error is None:
            assert stream.tokens == hf_greedy(hf, STREAM_PROMPT, LONG, None)
        else:
            assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
        with open(os.path.join(os.path.dirname(up.status_path), "colocated-0.log")) as f:
            log = f.read()  # whichever rank 0 noticed first: the rank's exit, or the
            # collective it was in failing as the rank's socket closed
            assert ("tensor-parallel rank(s) exited: rank 1" in log
                    or "tensor-parallel rank 0: all-reduce failed" in log
                    or "tensor-parallel rank 0: broadcast failed" in log
                    or "tensor-parallel rank 0: all-gather failed" in log), log[-2000:]
        # restarted under its id, both ranks anew, and serving the same tokens
        wait_for(lambda: up.child("colocated-0")["pid"] != worker["pid"]
                 and up.routable("colocated-0"), 60, "the worker's restart")
        assert up.generate(PROMPT) == expected
        # Ctrl-C: the worker drains and stops its rank itself (the rank ignores the
        # group's signal), a clean exit, not a rank failure
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, up.out[-3000:]
        with open(os.path.join(os.path.dirname(up.status_path), "colocated-0.log")) as f:
            log = f.read()
        assert log.count("goes down whole") == 1, log[-2000:]  # the SIGKILL's only
        assert "stopped" in log.rsplit("goes down whole", 1)[1], log[-2000:]
    finally:
        up.kill()


def test_a_hung_rank_ends_generate_within_the_collective_timeout() -> None:
    """Rank 1 stopped (SIGSTOP) mid-generation: rank 0's next collective times out, the
    process exits with the reason and takes the stopped rank with it."""
    proc, rank = _generating("--collective-timeout", "3")
    try:
        os.kill(rank, signal.SIGSTOP)
        t0 = time.monotonic()
        rest = proc.communicate(timeout=30)[1]
        assert time.monotonic() - t0 < 3 + 10
        assert proc.returncode == 70, rest
        assert "collective timeout 3s" in rest and "goes down whole" in rest
        wait_for(lambda: _gone(rank), 10, "the stopped rank to be killed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _generating(*extra: str) -> tuple[subprocess.Popen[str], int]:
    """`splitserve generate -tp 2` on CPU, running once rank 1 is ready: (process, rank)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "generate", "--model", tiny_model_dir("llama"),
         "-tp", "2", "--device", "cpu", "--num-blocks", "128", "--prompt", "hello",
         "--max-tokens", "1000", "--ignore-eos", *extra],
        cwd=ROOT, env=child_env(PYTHONUNBUFFERED="1"), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    err = ""
    while "rank 1 of 2 ready" not in err:
        line = proc.stderr.readline()
        assert line, err
        err += line
    [rank] = _ranks(proc.pid)
    return proc, rank


def _segments(pid: int) -> list[str]:
    """The KV segments of the group whose rank 0 is `pid` (engine/rank_segments.py)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"splitserve-kv-{pid}-tp")]


def test_a_killed_rank_leaves_no_kv_segment() -> None:
    """Each rank's KV cache is a shared-memory segment: SIGKILL to rank 1 (rank 0 removes
    every name as it goes down) or to rank 0 (rank 1 does) leaves none behind."""
    for victim in ("rank 1", "rank 0"):
        proc, rank = _generating()
        try:
            assert len(_segments(proc.pid)) == 2
            os.kill(rank if victim == "rank 1" else proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
            wait_for(lambda r=rank: _gone(r), 10, "rank 1 to end")
            assert _segments(proc.pid) == [], victim
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
