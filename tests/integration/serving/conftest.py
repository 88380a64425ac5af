"""One cluster for every test of this package: redis-server, two colocated workers and
the gateway, started by cluster.launcher (as `splitserve up` does) before the package's
first test and stopped after its last.

Order matters. pytest runs the files in name order (test_fuzz.py, test_openai_api.py,
test_serving.py) and each file's tests top to bottom; the last tests of test_serving.py
kill a worker, stop Redis and drain the other worker, so test_serving.py sorts last and
a new file must sort before it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cluster.launcher import ClusterSpec, LocalCluster
from engine.llm import LLM
from tests.factories import tiny_model_dir
from tests.integration.serving.shared import ADMIN_KEY, MAX_MODEL_LEN, NUM_BLOCKS, WORKER_ARGS


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_colocated=2,
                       worker_args=WORKER_ARGS, ready_timeout_s=150,
                       gateway_args=("--admin-key", ADMIN_KEY),
                       log_dir=str(tmp_path_factory.mktemp("cluster-logs")))
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="package")
def model(cluster: LocalCluster) -> str:
    return os.path.basename(os.path.normpath(cluster.spec.model_dir))


@pytest.fixture(scope="package")
def offline(cluster: LocalCluster) -> LLM:
    return LLM(cluster.spec.model_dir, num_blocks=NUM_BLOCKS, max_num_seqs=32,
               max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN)
