"""A worker stops promptly on SIGINT/SIGTERM whatever its peers did: a prefill worker
whose KV-transfer peer (the decode worker its sender is connected to) has gone still
drains, closes and logs "stopped" within seconds, not at the launcher's kill timeout."""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.disagg_util import child, generate_remotely, logs, start_cluster

STOP_WITHIN_S = 8.0  # drain with nothing in flight, then 1 s of gRPC grace, then close


@pytest.mark.parametrize(("transport", "decode_sig", "prefill_sig"), [
    ("shm", signal.SIGINT, signal.SIGINT),  # decode drained and gone first, then Ctrl-C
    ("tcp", signal.SIGKILL, signal.SIGTERM),  # decode died outright
])
def test_prefill_stops_promptly_after_its_decode_peer_is_gone(
        tmp_path, transport: str, decode_sig: int, prefill_sig: int) -> None:
    # DEBUG: the worker logs each step of its stop, so a slow one shows in the log.
    cluster = start_cluster(tmp_path, transport, ("--log-level", "DEBUG"))
    try:
        # One hand-off: the prefill's sender is connected to the decode's receiver.
        got, moved = generate_remotely(cluster, [[5, 6, 7, 8, 9, 10, 11]], [4])
        assert len(got[0]) == 4 and moved > 0
        decode, prefill = child(cluster, "decode-0"), child(cluster, "prefill-0")
        cluster.stop_child(decode, decode_sig, timeout_s=30)
        time.sleep(1.5)  # the prefill's sender sees its peer close (the reader, a ping)
        assert prefill.proc.poll() is None, prefill.log_tail()
        t0 = time.monotonic()
        code = cluster.stop_child(prefill, prefill_sig, timeout_s=STOP_WITHIN_S)
        took = time.monotonic() - t0
        tail = "".join(line for line in prefill.log_tail(400).splitlines(True)
                       if "logger=worker." in line or "logger=kvtransfer." in line)
        assert code == 0, f"exit {code} after {took:.1f}s:\n{tail}"
        assert "prefill-0 stopped" in tail and "stopping: kv transfer done" in tail, tail
        assert took < STOP_WITHIN_S, tail
    except BaseException:
        print(logs(cluster))
        raise
    finally:
        cluster.stop()
