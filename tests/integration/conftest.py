"""Fixtures of the integration tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test if it leaves a socket of this process open or a shared-memory KV
    segment of this process or of a peer it started behind (a kvtransfer test marks
    itself with `pytest.mark.usefixtures("no_leaks")`)."""
    from tests.integration.kvtransfer_util import open_sockets, shm_segments

    # After a peer died, UCX may keep its worker's TCP listeners until process exit
    # (a UCX-internal reference); for ucx we count every socket but those.
    ucx = "ucx" in request.node.name
    sockets, segments = open_sockets(ucx), shm_segments()
    yield
    if open_sockets(ucx) > sockets or not shm_segments() <= segments:
        # what only a reference cycle still holds goes with a collection (UCX's worker
        # and its sockets go with the last Python reference); ~0.1 s, so only when needed
        gc.collect()
    assert open_sockets(ucx) <= sockets, "a socket was left open"
    assert shm_segments() <= segments, "a shared-memory segment was left behind"
