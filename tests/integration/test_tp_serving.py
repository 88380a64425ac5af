"""A tensor-parallel (TP 2, CPU, gloo) colocated worker under `splitserve up`, real
processes: greedy output through the gateway equals transformers'; SIGKILL to rank 1
takes the worker down whole at once (its other rank too, no hang), and the supervisor's
restart serves again."""

from __future__ import annotations

import os
import signal
import time

import psutil

from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.integration.serving_util import wait_for
from tests.integration.test_up_supervision import MAX_TOKENS, PROMPT, Up, _gone, pytestmark

__all__ = ["pytestmark"]


def test_tp2_worker_serves_and_a_dead_rank_takes_it_down_whole() -> None:
    hf = hf_model(tiny_model_dir("llama"))
    eos = hf.generation_config.eos_token_id
    expected = hf_greedy(hf, PROMPT, MAX_TOKENS, eos[0] if isinstance(eos, list) else eos)
    up = Up("--colocated", "1", "-tp", "2", "--device", "cpu", "--dtype", "float32",
            "--restart-backoff", "0.2")
    try:
        assert up.generate(PROMPT) == expected
        worker = up.child("colocated-0")
        ranks = [p for p in psutil.Process(worker["pid"]).children()
                 if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(ranks) == 1, [p.cmdline() for p in ranks]
        t0 = time.monotonic()
        os.kill(ranks[0].pid, signal.SIGKILL)
        wait_for(lambda: _gone(worker["pid"]), 10, "the worker to go down with its rank")
        assert time.monotonic() - t0 < 10
        with open(os.path.join(os.path.dirname(up.status_path), "colocated-0.log")) as f:
            assert "tensor-parallel rank(s) exited: rank 1" in f.read()
        # restarted under its id, both ranks anew, and serving the same tokens
        wait_for(lambda: up.child("colocated-0")["pid"] != worker["pid"]
                 and up.routable("colocated-0"), 60, "the worker's restart")
        assert up.generate(PROMPT) == expected
    finally:
        up.kill()
