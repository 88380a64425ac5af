"""TransferConfig's copy budget: the grants' default, positive, the same on both sides
(a peer process gets the config as a dict)."""

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
