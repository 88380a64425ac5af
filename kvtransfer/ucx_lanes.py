"""UCX lanes for `kvtransfer.ucx`: a UCX context and worker with its own progress and
notifier threads (`Lane`), and the teardown of lanes and endpoints."""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from typing import Any

log = logging.getLogger(__name__)
EPOLL_MS = 50


class Lane:
    """One UCX context and worker with its own progress and notifier threads.

    Not ucxx's ApplicationContext: that keeps one progress thread per event loop in
    a module-global table, so a second context on the same loop (a decode worker's
    receiver and sender, or a receiver's lanes) is never progressed. The progress
    thread waits on the worker's event fd (UCX events and `ucp_worker_signal` wake
    it); ucxx's 1 ms wake-ups would cost the copying lanes ~8% on two cores.
    """

    def __init__(self, options: tuple[tuple[str, str], ...],
                 loop: asyncio.AbstractEventLoop) -> None:
        from ucxx._lib import libucxx as ucx_api
        from ucxx._lib_async.continuous_ucx_progress import _create_context
        from ucxx._lib_async.notifier_thread import _notifierThread

        self.context = ucx_api.UCXContext(dict(options))
        self.worker = ucx_api.UCXWorker(self.context, enable_delayed_submission=True,
                                        enable_python_future=True)
        # The progress thread needs a CUDA context for device buffers (cuda_ipc).
        self.worker.set_progress_thread_start_callback(_create_context)
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=EPOLL_MS)
        self._stop: queue.Queue[str] = queue.Queue()
        self._notifier = threading.Thread(target=_notifierThread,
                                          args=(loop, self.worker, self._stop),
                                          name="kvtransfer-ucx-notifier", daemon=True)
        self._notifier.start()

    @property
    def address(self) -> str:
        return bytes(self.worker.address.tobytes()).hex()

    def connect(self, address: str) -> Any:
        """An endpoint to the worker at `address`, with UCX's peer error handling: the
        peer's death fails its operations, never this process."""
        from ucxx._lib import libucxx as ucx_api

        peer = ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(address))
        return ucx_api.UCXEndpoint.create_from_worker_address(self.worker, peer, True)

    def close(self) -> None:
        """Cancel what is in flight, stop both threads; the worker goes with the
        last reference (its sockets with it)."""
        try:
            self.worker.cancel_inflight_requests(10**9, 1)
            self.worker.stop_progress_thread()
        except Exception as e:  # noqa: BLE001 - best effort at teardown
            log.debug("ucx lane close: %r", e)
        self._stop.put("shutdown")
        self.worker.stop_request_notifier_thread()
        deadline = time.monotonic() + 5.0
        # Short joins: the notifier may need the GIL to finish (ucxx does the same).
        while self._notifier.is_alive() and time.monotonic() < deadline:
            self._notifier.join(timeout=0.01)
        if self._notifier.is_alive():
            log.warning("ucx notifier thread did not stop within 5 s")


def close_lanes(lanes: list[Lane]) -> None:
    for lane in lanes:
        lane.close()
    lanes.clear()
    gc.collect()  # UCX's workers (and their sockets) go with the last reference


def close_endpoint(ep: Any) -> None:
    try:
        ep.close_blocking(period=10**9, max_attempts=1)
        ep.remove_close_callback()
    except Exception as e:  # noqa: BLE001 - the peer may be gone
        log.debug("ucx endpoint close: %r", e)
