"""A user's mistake on the command line gets one line on stderr and exit 2, not a
traceback; `--debug` (or SPLITSERVE_DEBUG=1) keeps the traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster.cli import main
from engine.config import ModelDirError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    errors = [line for line in err if line.startswith("splitserve: error: ")]
    assert len(errors) == 1, err
    assert not any("Traceback" in line for line in err), err
    return errors[0]


def unsupported_model_dir(tmp_path: str) -> str:
    d = os.path.join(tmp_path, "gpt2")
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, f)
    return d


def test_missing_model_directory(capsys: pytest.CaptureFixture[str], tmp_path: str) -> None:
    line = one_line_error(capsys, ["generate", "--model", f"{tmp_path}/nowhere",
                                   "--prompt", "hi"])
    assert "does not exist" in line and "--model-shape" in line


def test_unsupported_architecture(capsys: pytest.CaptureFixture[str], tmp_path: str) -> None:
    line = one_line_error(capsys, ["generate", "--model", unsupported_model_dir(tmp_path),
                                   "--prompt", "hi"])
    assert "GPT2LMHeadModel" in line and "LlamaForCausalLM" in line  # what would work


def test_impossible_flag_combination(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(capsys, ["generate", "--model-shape", "llama3-8b",
                                   "--load-format", "auto", "--prompt", "hi"])
    assert "--load-format dummy" in line


def test_debug_keeps_the_traceback(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["generate", "--model", unsupported_model_dir(tmp_path), "--prompt", "hi"]
    with pytest.raises(ModelDirError):
        main([*argv, "--debug"])
    monkeypatch.setenv("SPLITSERVE_DEBUG", "1")
    with pytest.raises(ModelDirError):
        main(argv)


def test_the_process_exits_2_without_a_traceback(tmp_path: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_DEBUG"}
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "worker", "--model",
                           unsupported_model_dir(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("splitserve: error: "), done.stderr


def test_tensor_parallel_refusals_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.factories import tiny_model_dir

    d = tiny_model_dir("llama")
    line = one_line_error(capsys, ["generate", "--model", d, "--device", "cpu", "-tp", "3",
                                   "--prompt", "hi"])
    assert "tensor parallel size 3 does not divide the model's 4 attention heads" in line
    line = one_line_error(capsys, ["worker", "--model", d, "-tp", "2",
                                   "--lmcache-config", "lmcache.yaml"])
    assert "runs without --lmcache-config" in line
    line = one_line_error(capsys, ["up", "--model", d, "--colocated", "2", "-tp", "2",
                                   "--device", "cuda", "--gpus", "0"])
    assert "2 workers × TP 2 need 4 GPUs; 1 given by --gpus" in line or "--gpus names GPU 0" in line
