"""Ranks 1..N-1 of a tensor-parallel engine: the model only, no scheduler.

Rank 0 (the engine's ModelRunner) spawns each rank with a command pipe. A rank builds
the same ModelRunner over its shard (the same steps in the same order as rank 0, so the
collectives of loading and of the CUDA memory profile meet), then runs rank 0's
commands in order:

    ("forward", ...)  the step's shape on the pipe, its staging buffer by one broadcast
                      (engine/step_inputs.py `send` / `receive`); runs the forward pass,
                      or replays the graph rank 0 names, ("decode", batch size) or
                      ("mixed", tokens) (every rank captured the same ones at
                      start-up), the logits' gather included
    ("logits", rows)  the LM head on rows of the last forward (None: its sampled rows);
                      the logits gather's other side
    ("copy", pairs)   KV block copies (a forked sample's partial block)
    ("read", ids)     this rank's heads of those blocks, all-gathered (the KV hand-off's
                      send side through rank 0's staging copy, CUDA: rank 0 assembles
                      full-head blocks)
    ("write", ids)    those blocks' full heads by one broadcast; keeps its own (the
                      hand-off's receive side through the staging copy)
    ("scales", src)   the float8 KV scales a sender's blocks carried, adopted before this
                      rank calculated its own (engine/kv_scales.py)
    ("exit",)         rank 0's engine is done

A closed pipe means rank 0's process is gone: the rank exits. The pipe has no timeout
(an idle engine sends nothing); the collectives do (engine/distributed.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.distributed import TP_FAILURE_EXIT, join_group, rank_device
from engine.gc_heap import freeze_startup_heap
from engine.kv_scales import calibrating
from engine.rank_segments import segment_names, unlink_segments

log = logging.getLogger(__name__)


def _watch_parent(parent_pid: int, segments: list[str]) -> None:
    """Exits when rank 0's process is gone (SIGKILLed rank 0 cannot close our pipe
    before a collective we wait in times out; this notices within half a second),
    removing the group's KV segments (rank 0 could not)."""
    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        unlink_segments(segments)
        os._exit(TP_FAILURE_EXIT)

    threading.Thread(target=run, name="tp-parent", daemon=True).start()


def rank_main(config: Any, rank: int, port: int, conn: Connection, parent_pid: int) -> None:
    logging.basicConfig(
        level=os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO").upper(),
        format=f"ts=%(asctime)s level=%(levelname)s service=worker tp_rank={rank} "
               "logger=%(name)s %(message)s")
    # A signal to the worker's process group (a supervisor's SIGTERM, Ctrl-C) is rank
    # 0's to act on: it drains, then stops us; we go when it says so or when it is gone.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    segments = segment_names(parent_pid, port, config.tensor_parallel_size) \
        if not config.device.startswith("cuda") else []
    _watch_parent(parent_pid, segments)
    from engine.config import ModelConfig
    from engine.model_runner import ModelRunner

    device = rank_device(torch.device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = join_group(config, rank, port, device, parent_pid)
    runner = ModelRunner(config, ModelConfig.from_model_dir(config.model_dir), tp=tp)
    log.info("tensor-parallel rank %d of %d ready on %s (%d KV blocks)",
             rank, tp.size, runner.device, runner.num_blocks)
    freeze_startup_heap()
    serve(runner, conn)


@torch.inference_mode()
def serve(runner: Any, conn: Connection) -> None:
    tp = runner.tp
    step = hidden = None
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            tp.unlink_segments()
            os._exit(TP_FAILURE_EXIT)  # rank 0 is gone
        op = command[0]
        if op == "forward" and command[-1] is not None:  # a graph's bucket
            kind, size = command[-1]
            graphs = runner.graphs if kind == "decode" else runner.mixed_graphs
            if graphs is None or command[2] != (*graphs.pad(size)[:2], graphs.width,
                                                graphs.pad(size)[2]):
                raise RuntimeError(f"rank 0's step {command[2]} ({kind} bucket {size}) "
                                   f"does not fit this rank's {kind} graphs")
            step = runner.inputs.receive(tp, command, out=graphs.buffer)
            graphs.run(size, step)  # its logits' gather ends it
            step = hidden = None
        elif op == "forward":
            step = runner.inputs.receive(tp, command)
            with calibrating(runner.kv_scales):  # as rank 0 (--calculate-kv-scales)
                hidden = runner.model(step.input_ids, step.positions, runner.kv_cache,
                                      step.meta)
        elif op == "logits":
            assert step is not None and hidden is not None
            rows = step.sample_rows if command[1] is None else torch.tensor(
                command[1], device=hidden.device)
            runner.model.compute_logits(hidden[rows])
        elif op == "copy":
            runner.copy_blocks(command[1])
        elif op == "read":
            runner.read_blocks(command[1])
        elif op == "write":
            runner.write_blocks(command[1])
        elif op == "scales":  # rank 0 adopted a KV sender's scales (engine/kv_scales.py)
            runner.kv_scales.adopt(command[1])
        elif op == "exit":
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op!r}")
