"""`splitserve bench chaos`, short and bounded: 2 prefill, 2 decode, 2 gateways and a
real redis-server under a steady load for ~35 s while processes of every role are
SIGKILLed or SIGSTOPped; no output may be wrong, no request hang, no KV block leak, and
every process must be back at the end. Faults must actually have happened: a SIGSTOP and
a SIGKILL at least (seed 0 draws a gateway SIGKILL, a decode SIGSTOP, a prefill SIGKILL
and a redis SIGKILL first)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from bench.chaos import failures, report, run_chaos
from cluster.launcher import ClusterSpec, LocalCluster
from tests.factories import tiny_model_dir

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make sysdeps)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_prefill=2, num_decode=2,
                       num_colocated=0, num_gateways=2, worker_args=("--num-blocks", "96"),
                       ready_timeout_s=180,
                       log_dir=str(tmp_path_factory.mktemp("chaos") / "logs"))
    with LocalCluster(spec) as c:
        yield c


def test_kills_and_freezes_under_load_leave_nothing_wrong_hung_or_leaked(
        cluster: LocalCluster) -> None:
    result = run_chaos(cluster, duration_s=35, every_s=5, stop_s=3, stop_share=0.4,
                       concurrency=3, timeout_s=60, seed=0)
    print(f"chaos: {result['requests']} requests, {result['success_rate']:.1%} succeeded, "
          f"{result['clean_errors']} clean errors, faults {result['kills']}, "
          f"recovery {result['recovery_s']}")
    assert failures(result) == [], (result["problems"], result["faults"])
    assert result["wrong"] == result["hung"] == result["leaked_blocks"] == 0
    kills = result["kills"]
    assert kills["stop"] >= 1 and sum(kills.values()) - kills["stop"] >= 1, kills
    assert sum(kills.values()) >= 2, result["faults"]
    assert result["requests"] >= 30 and result["succeeded"] >= 0.8 * result["requests"]
    page = report(result, {"duration_s": 35, "kill_every_s": 5, "seed": 0})
    assert page["name"] == "chaos" and page["summary"]["wrong"] == 0
