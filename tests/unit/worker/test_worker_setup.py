"""Worker set-up checks that need no model run: transport vs device, the CLI's token
and role rules, the advertised receiver address."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.llm import make_engine_config
from tests.factories import tiny_model_dir
from tests.integration.kvtransfer_util import fast_config
from worker import cli
from worker.server import advertised, check_device_transport


def test_a_transport_that_cannot_serve_the_cache_is_refused_at_start() -> None:
    cuda = make_engine_config(tiny_model_dir("llama"), device="cuda")
    cpu = make_engine_config(tiny_model_dir("llama"))
    for transport in ("tcp", "shm"):
        with pytest.raises(ValueError, match="use --transport cuda_ipc .* ucx"):
            check_device_transport(cuda, fast_config(transport))
    with pytest.raises(ValueError, match="use --transport shm .* or tcp"):
        check_device_transport(cpu, fast_config("cuda_ipc"))
    for transport in ("ucx", "cuda_ipc", "auto"):
        check_device_transport(cuda, fast_config(transport))
    for transport in ("tcp", "shm", "ucx"):
        check_device_transport(cpu, fast_config(transport))


def test_auto_is_cuda_ipc_or_ucx_on_a_gpu_and_tcp_on_the_host(monkeypatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CLUSTER_TOKEN", "t")
    for device, want in (("cuda", "auto"), ("cuda:1", "auto"), ("cpu", "tcp")):
        cfg = cli.transfer_config(_args("--role", "decode", "--transport", "auto",
                                        "--device", device))
        assert cfg is not None and cfg.transport == want
    cfg = cli.transfer_config(_args("--role", "prefill", "--transport", "cuda_ipc",
                                    "--device", "cuda"))
    assert cfg is not None and cfg.transport == "cuda_ipc"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_prefill_and_decode_roles_need_the_cluster_token(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("SPLITSERVE_CLUSTER_TOKEN", raising=False)
    assert cli.transfer_config(_args("--role", "colocated")) is None
    for role in ("prefill", "decode"):
        with pytest.raises(SystemExit, match="cluster's KV-transfer token"):
            cli.transfer_config(_args("--role", role))
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = cli.transfer_config(_args("--role", "decode", "--transport", "shm",
                                    "--cluster-token-file", str(token), "--kv-lease", "7"))
    assert cfg is not None
    assert (cfg.token, cfg.transport, cfg.lease_s) == ("s3cret", "shm", 7.0)
    monkeypatch.setenv("SPLITSERVE_CLUSTER_TOKEN", "from-env")
    cfg = cli.transfer_config(_args("--role", "prefill", "--host", "10.0.0.5"))
    assert cfg is not None and (cfg.token, cfg.host) == ("from-env", "10.0.0.5")


def test_a_wildcard_receiver_is_dialled_at_the_advertised_host() -> None:
    desc = json.dumps({"transport": "tcp", "host": "0.0.0.0", "port": 9})
    assert json.loads(advertised(desc, "10.1.2.3"))["host"] == "10.1.2.3"
    bound = json.dumps({"transport": "tcp", "host": "10.0.0.7", "port": 9})
    assert json.loads(advertised(bound, "10.1.2.3"))["host"] == "10.0.0.7"


def test_ucx_settings_from_the_cli(monkeypatch) -> None:
    from kvtransfer.config import CUDA_UCX_OPTIONS, HOST_UCX_OPTIONS

    monkeypatch.setenv("SPLITSERVE_CLUSTER_TOKEN", "t")
    cfg = cli.transfer_config(_args("--role", "decode", "--transport", "ucx"))
    assert cfg is not None and cfg.ucx_lanes == 2 and cfg.ucx_options is None
    # Defaults by memory: host caches pin UCX to tcp, CUDA ones let UCX choose.
    assert cfg.ucx_options_for(False) == HOST_UCX_OPTIONS
    assert cfg.ucx_options_for(True) == CUDA_UCX_OPTIONS
    assert not any(name == "TLS" for name, _ in CUDA_UCX_OPTIONS)
    cfg = cli.transfer_config(_args("--role", "decode", "--transport", "ucx", "--ucx-lanes",
                                    "1", "--ucx-option", "UCX_TLS=rc,cuda_ipc",
                                    "--ucx-option", "RNDV_THRESH=16384"))
    assert cfg is not None and cfg.ucx_lanes == 1
    expect = (("TLS", "rc,cuda_ipc"), ("RNDV_THRESH", "16384"))
    assert cfg.ucx_options == expect
    assert cfg.ucx_options_for(True) == cfg.ucx_options_for(False) == expect
    for bad in (("--ucx-option", "TLS"), ("--ucx-lanes", "0")):
        with pytest.raises(SystemExit):
            cli.transfer_config(_args("--role", "decode", "--transport", "ucx", *bad))
