"""GPU placement for `splitserve up` (cluster/placement.py), with the GPU count given."""

import argparse

import pytest

from cluster.placement import parse_gpus, plan, visible_gpus
from cluster.up import add_arguments, place_workers


def _env(p):
    return dict(p.env)["CUDA_VISIBLE_DEVICES"]


def test_disjoint_gpu_sets_in_order():
    workers = [(f"colocated-{i}", "colocated", 2) for i in range(4)]
    out = plan(workers, visible=[str(i) for i in range(8)])
    assert [_env(out[w]) for w, _, _ in workers] == ["0,1", "2,3", "4,5", "6,7"]
    assert out["colocated-3"].args == ("--tensor-parallel-size", "2")


def test_refusal_names_the_arithmetic():
    workers = [(f"colocated-{i}", "colocated", 2) for i in range(4)]
    with pytest.raises(ValueError, match=r"4 workers × TP 2 need 8 GPUs; 4 visible"):
        plan(workers, visible=["0", "1", "2", "3"])
    mixed = [("prefill-0", "prefill", 1), ("decode-0", "decode", 1),
             ("colocated-0", "colocated", 2)]
    with pytest.raises(ValueError, match=r"\+ 1 colocated worker × TP 2 need 4 GPUs; "
                                         r"2 given by --gpus"):
        plan(mixed, visible=["0", "1", "2"], gpus=[0, 2])


def test_gpus_pick_and_map_through_the_launchers_own_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    visible = visible_gpus(4)
    assert visible == ["4", "5", "6", "7"]
    out = plan([("colocated-0", "colocated", 2)], visible=visible, gpus=[3, 1])
    assert _env(out["colocated-0"]) == "7,5"
    with pytest.raises(ValueError, match="--gpus names GPU 4; 4 visible"):
        plan([("colocated-0", "colocated", 1)], visible=visible, gpus=[4])
    for bad in ("a,b", "0,0", ""):
        with pytest.raises(ValueError):
            parse_gpus(bad)


def test_shared_gpus_split_memory_utilization():
    workers = [(f"colocated-{i}", "colocated", 1) for i in range(4)]
    out = plan(workers, visible=["0", "1"], share=True, memory_utilization=0.8)
    assert [_env(out[w]) for w, _, _ in workers] == ["0", "1", "0", "1"]
    assert out["colocated-0"].args[-2:] == ("--gpu-memory-utilization", "0.4")
    with pytest.raises(ValueError, match="TP 4 needs 4 GPUs; 2 visible"):
        plan([("colocated-0", "colocated", 4)], visible=["0", "1"], share=True)


def _spec(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "/m", *argv])
    return args


def test_up_flags_place_workers():
    args = _spec("--colocated", "2", "-tp", "2", "--device", "cuda")
    from cluster.up import _settings

    s = _settings(args)
    out = place_workers(s, 0, 0, 2, gpu_count=4)
    assert [_env(out[w]) for w in ("colocated-0", "colocated-1")] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="2 workers × TP 2 need 4 GPUs; 2 visible"):
        place_workers(s, 0, 0, 2, gpu_count=2)
    # on CPU: only the TP size
    cpu = place_workers(_settings(_spec("--colocated", "1", "-tp", "2", "--device", "cpu")),
                        0, 0, 1)
    assert cpu["colocated-0"].args == ("--tensor-parallel-size", "2") and not cpu[
        "colocated-0"].env


def test_up_places_each_role_at_its_own_tp_size():
    from cluster.up import _settings

    args = _spec("--prefill", "1", "--decode", "1", "--decode-tensor-parallel-size", "2",
                 "--device", "cpu")
    s = _settings(args)
    out = place_workers(s, 1, 1, 0)
    assert out["decode-0"].args == ("--tensor-parallel-size", "2")
    assert out["prefill-0"].args == ("--tensor-parallel-size", "1")


def test_launcher_gives_each_worker_its_gpus(tmp_path):
    import sys

    from cluster.launcher import ClusterSpec, LocalCluster
    from tests.integration.serving_util import wait_for

    placement = plan([("colocated-0", "colocated", 2), ("colocated-1", "colocated", 2)],
                     visible=["0", "1", "2", "3"])
    cluster = LocalCluster(ClusterSpec("/m", num_colocated=2, placement=placement,
                                       log_dir=str(tmp_path)))
    try:
        child = cluster.spawn("colocated-1", [sys.executable, "-c",
                                              "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"])
        wait_for(lambda: child.proc.poll() is not None, 30, "the child")
        assert open(child.log_path).read().strip() == "2,3"
    finally:
        cluster.stop()


def test_cuda_ipc_placement_lets_workers_see_the_pool_each_on_its_own_device():
    """Peer access needs both GPUs visible to the sender: with cuda_ipc / auto every
    worker sees the pool and gets --device cuda:N (its ranks take N, N+1, ...)."""
    workers = [("prefill-0", "prefill", 1), ("decode-0", "decode", 2)]
    out = plan(workers, visible=["0", "1", "2", "3"], gpus=[1, 2, 3], peer_view=True)
    assert _env(out["prefill-0"]) == _env(out["decode-0"]) == "1,2,3"
    assert out["prefill-0"].args == ("--tensor-parallel-size", "1", "--device", "cuda:0")
    assert out["decode-0"].args == ("--tensor-parallel-size", "2", "--device", "cuda:1")
    assert out["prefill-0"].gpus == ("1",) and out["decode-0"].gpus == ("2", "3")
    # A set that wraps around the pool (--share-gpus) is not consecutive: isolated.
    wrap = plan([("prefill-0", "prefill", 2), ("decode-0", "decode", 2)], visible=["0", "1", "2"],
                share=True, peer_view=True)
    assert _env(wrap["prefill-0"]) == "0,1,2" and "--device" in wrap["prefill-0"].args
    assert _env(wrap["decode-0"]) == "2,0" and "--device" not in wrap["decode-0"].args


def test_up_transport_decides_the_gpu_view():
    from cluster.up import _settings

    for transport, seen in (("auto", ["0,1", "0,1"]), ("cuda_ipc", ["0,1", "0,1"]),
                            ("ucx", ["0", "1"])):
        s = _settings(_spec("--prefill", "1", "--decode", "1", "--gpus", "0,1",
                            "--transport", transport, "--device", "cuda"))
        out = place_workers(s, 1, 1, 0, gpu_count=2)
        assert [_env(out[w]) for w in ("prefill-0", "decode-0")] == seen, transport
        devices = [dict(zip(out[w].args[::2], out[w].args[1::2], strict=True)).get("--device")
                   for w in ("prefill-0", "decode-0")]
        assert devices == (["cuda:0", "cuda:1"] if transport != "ucx" else [None, None])
