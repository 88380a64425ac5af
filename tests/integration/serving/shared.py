"""The shape of the cluster this package's tests share (conftest.py), and its workers."""

from __future__ import annotations

from cluster.launcher import LocalCluster
from cluster.supervisor import Child

NUM_BLOCKS = 128
MAX_MODEL_LEN = 768  # below the model's 1024: the gateway must learn it from the workers
WORKER_ARGS = ("--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "32",
               "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", "512", "--log-level", "INFO")
ADMIN_KEY = "serving-admin-key"


def workers(cluster: LocalCluster) -> list[Child]:
    return [c for c in cluster.children if c.name.startswith("colocated")]
