"""TransferConfig's copy budget: the grants' default, positive, the same on both sides
(a peer process gets the config as a dict); a grant's ttl longer than the heartbeat."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from kvtransfer.config import TransferConfig
from kvtransfer.grants import COPY_BUDGET_S


def test_the_copy_budget_defaults_to_the_grants_and_must_be_positive() -> None:
    assert TransferConfig(token="t").copy_budget_s == COPY_BUDGET_S == 2.0
    short = TransferConfig(token="t", copy_budget_s=0.5)
    assert TransferConfig(**asdict(short)).copy_budget_s == 0.5
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="copy_budget_s must be positive"):
            TransferConfig(token="t", copy_budget_s=bad)


def test_a_grant_ttl_within_two_heartbeats_is_refused() -> None:
    """io_timeout_s is an in-place grant's ttl past the newest answered PING: one under
    two PING intervals could lapse while every PING is answered, late."""
    TransferConfig(token="t", io_timeout_s=0.4, heartbeat_s=0.2, liveness_timeout_s=1.0)
    for ttl in (0.39, 0.3, 0.2, 0.1):
        with pytest.raises(ValueError, match="io_timeout_s must be at least twice heartbeat_s"):
            TransferConfig(token="t", io_timeout_s=ttl, heartbeat_s=0.2,
                           liveness_timeout_s=1.0)


def test_a_negative_inline_copy_size_is_refused() -> None:
    assert TransferConfig(token="t", inline_copy_bytes=0).inline_copy_bytes == 0
    with pytest.raises(ValueError, match="inline_copy_bytes"):
        TransferConfig(token="t", inline_copy_bytes=-1)
