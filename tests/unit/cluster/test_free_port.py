"""free_port: a port a child can bind, out of reach of the machine's outgoing connections."""

from __future__ import annotations

import socket

import pytest

from cluster import launcher
from cluster.launcher import free_port


def test_ports_are_below_the_ephemeral_range_bindable_and_never_handed_out_twice() -> None:
    top = launcher._ephemeral_start()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(launcher._LOWEST_PORT <= p < top for p in ports), (top, min(ports), max(ports))
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_something_listens_on_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # a range of one port, taken: the kernel's choice instead
        monkeypatch.setattr(launcher, "_LOWEST_PORT", taken)
        monkeypatch.setattr(launcher, "_ephemeral_start", lambda: taken + 1000)
        monkeypatch.setattr(launcher._RANDOM, "randrange", lambda lo, hi: taken)
        port = free_port()
        assert port != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_kernel_chooses_when_the_range_below_is_too_small(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_ephemeral_start", lambda: launcher._LOWEST_PORT + 10)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
