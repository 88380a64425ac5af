"""The disk tier's float8 KV scales: its files outlive the process that wrote them, so
the directory records the scales its blocks were written under (`kv_scales.json`,
beside the blocks; one worker owns a directory, and its scales never change once
fixed), and the next process over the same directory starts from them.

At start-up, before any request (`bind_disk_scales`, on the engine thread):

- the record holds scales (for this layout): an engine still to calculate its scales
  (--calculate-kv-scales) adopts them, so the directory's blocks stay readable; an
  engine whose scales are fixed (the checkpoint's) and differ is refused in one line;
- no record but blocks: they come from a run that kept none, whose scales were the
  checkpoint's (or 1.0), and are treated as such;
- no record, no blocks: the record is written once the engine's scales are fixed
  (`KVScales.on_fixed`: before any block can be saved).
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING

from kvtransfer.tiers.disk import SCALES_FILE, DiskTier

if TYPE_CHECKING:
    from engine.kv_scales import ScaleList
    from engine.model_runner import ModelRunner
    from kvtransfer.tiers.manager import TieredCache

log = logging.getLogger(__name__)


def bind_disk_scales(tiers: TieredCache, runner: ModelRunner) -> None:
    """Ties the runner's float8 scales to `tiers`' disk tier, if both exist (see the
    module doc). Raises ValueError where the directory's blocks cannot be read."""
    from engine.kv_scales import adopt_scales

    scales = runner.kv_scales
    disk = next((t for t in tiers.tiers if isinstance(t, DiskTier)), None)
    if scales is None or disk is None:
        return
    path = os.path.join(disk.directory, SCALES_FILE)
    layout = disk.layout.to_json()
    saved = _read(path, layout)
    if saved is None and len(disk):
        saved = scales.initial
        if scales.pending:
            log.warning("the disk tier %r holds KV blocks without a scales record (%s): "
                        "they were written under the checkpoint's float8 scales, which "
                        "this worker adopts instead of calculating its own; empty the "
                        "directory to calculate them", disk.directory, SCALES_FILE)
    if saved is not None and scales.pending:
        adopt_scales(runner, saved)
    elif saved is not None and saved != scales.values():
        raise ValueError(f"the disk tier {disk.directory!r} holds KV blocks written under "
                         f"other float8 scales ({SCALES_FILE}); start with "
                         "--calculate-kv-scales to adopt them, or empty the directory")
    if scales.pending:
        scales.on_fixed.append(lambda values: _write(path, layout, values))
    else:
        _write(path, layout, scales.values())


def _read(path: str, layout: str) -> ScaleList | None:
    """The recorded scales, or None: no record, or one for another layout (whose blocks
    the disk tier has already dropped)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    if record.get("layout") != layout:
        return None
    return [(float(k), float(v)) for k, v in record["kv_scales"]]


def _write(path: str, layout: str, scales: ScaleList) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"layout": layout, "kv_scales": scales}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
