"""`bench experiment transports`: what each device's run starts (no cluster here; the
experiment itself runs on demand): a colocated baseline and 1P1D per transport, 8k-token
prompts on one GPU with `--device cuda`, per-core pins on the CPU."""

from __future__ import annotations

from bench.experiments.common import ExperimentConfig
from bench.experiments.transports import _workload, configurations
from engine.model_shapes import model_shape_dir
from tests.factories import tiny_model_dir


def test_cuda_runs_8k_prompts_colocated_then_each_transport_on_one_gpu(tmp_path) -> None:
    cfg = ExperimentConfig(model_shape_dir("llama3-8b"), str(tmp_path), device="cuda",
                           load_format="dummy", transports=("cuda_ipc", "ucx"))
    n, prompt_len, out_len = _workload(cfg)
    # an 8k context the gateway admits (on the H200 an 8192-token prompt + 4 was a 400)
    assert prompt_len + out_len == 8192 and n >= 8
    runs = configurations(cfg, prompt_len)
    assert [name for name, _ in runs] == ["colocated", "cuda_ipc", "ucx"]
    for name, kw in runs:
        args = kw["worker_args"]
        assert kw["pins"] is None  # all on the one device
        assert args[args.index("--device") + 1] == "cuda"
        assert args[args.index("--load-format") + 1] == "dummy"
        assert int(args[args.index("--max-model-len") + 1]) > prompt_len
        assert "--kv-cache-memory" in args  # two processes share the GPU's memory
        if name != "colocated":
            assert (kw["prefill"], kw["decode"], kw["transport"]) == (1, 1, name)


def test_cpu_keeps_one_core_per_worker(tmp_path) -> None:
    cfg = ExperimentConfig(tiny_model_dir("llama"), str(tmp_path), quick=True)
    runs = dict(configurations(cfg, _workload(cfg)[1]))
    assert list(runs) == ["colocated", "ucx", "tcp", "shm"]
    assert runs["colocated"]["pins"] == {"colocated-0": "0"} and not runs["tcp"]["worker_args"]
    assert runs["shm"]["pins"] == {"prefill-0": "0", "decode-0": "1"}
