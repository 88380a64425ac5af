"""`splitserve up` settings: flags over the YAML config, defaults, clear errors."""

from __future__ import annotations

import argparse

import pytest

from cluster import up
from cluster.launcher import ClusterSpec
from tests.factories import tiny_model_dir


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_override_the_config_file(tmp_path) -> None:
    model = tiny_model_dir("llama")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {model}\ncolocated: 3\nhttp_port: 9001\nnum_blocks: 64\n"
                   "gateway_args: ['--max-in-flight', '8']\n")
    spec = up.build_spec(_args("--config", str(cfg), "--colocated", "2"))
    assert (spec.model_dir, spec.num_colocated, spec.http_port) == (model, 2, 9001)
    assert spec.worker_args == ("--num-blocks", "64")
    assert spec.gateway_args == ("--max-in-flight", "8")


def test_default_cluster_is_one_prefill_one_decode_over_tcp() -> None:
    spec = up.build_spec(_args("--model", tiny_model_dir("llama")))
    assert (spec.num_prefill, spec.num_decode, spec.num_colocated) == (1, 1, 0)
    assert spec.transport == "tcp"
    assert (spec.http_port, spec.grpc_port) == (8000, 50051)
    spec = up.build_spec(_args("--model", tiny_model_dir("llama"), "--colocated", "2"))
    assert (spec.num_prefill, spec.num_decode, spec.num_colocated) == (0, 0, 2)


def test_spec_errors() -> None:
    with pytest.raises(ValueError):
        ClusterSpec(model_dir="m", num_colocated=0)
    with pytest.raises(ValueError):
        ClusterSpec(model_dir="m", transport="carrier-pigeon")
    with pytest.raises(ValueError, match="decode worker"):
        ClusterSpec(model_dir="m", num_prefill=1, num_decode=0, num_colocated=1)


def test_device_and_dtype_reach_every_worker(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("worker_args: ['--device', 'cuda:1', '--max-num-seqs', '8']\n")
    spec = up.build_spec(_args("--model", tiny_model_dir("llama"), "--config", str(cfg),
                               "--device", "cpu", "--dtype", "bfloat16"))
    # the flags come after worker_args, so they win (argparse keeps the last)
    assert spec.worker_args == ("--device", "cuda:1", "--max-num-seqs", "8",
                                "--device", "cpu", "--dtype", "bfloat16")
    assert "--device" not in up.build_spec(_args("--model", tiny_model_dir("llama"))).worker_args


def test_kv_cache_dtype_reaches_every_worker(tmp_path) -> None:
    spec = up.build_spec(_args("--model", tiny_model_dir("llama"), "--kv-cache-dtype", "fp8"))
    assert spec.worker_args == ("--kv-cache-dtype", "fp8")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kv_cache_dtype: fp8_e4m3\n")
    spec = up.build_spec(_args("--model", tiny_model_dir("llama"), "--config", str(cfg)))
    assert spec.worker_args == ("--kv-cache-dtype", "fp8_e4m3")
    with pytest.raises(SystemExit):
        _args("--kv-cache-dtype", "fp8_e5m2")
    spec = up.build_spec(_args("--model", tiny_model_dir("llama"), "--kv-cache-dtype", "fp8",
                               "--calculate-kv-scales"))
    assert spec.worker_args == ("--kv-cache-dtype", "fp8", "--calculate-kv-scales")
    cfg.write_text("kv_cache_dtype: fp8\ncalculate_kv_scales: true\n")
    spec = up.build_spec(_args("--model", tiny_model_dir("llama"), "--config", str(cfg)))
    assert spec.worker_args == ("--kv-cache-dtype", "fp8", "--calculate-kv-scales")
