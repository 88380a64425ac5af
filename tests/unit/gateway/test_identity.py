"""Request identity: which source wins, what untrusted clients cannot claim, and the
key file's shape."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest
from gateway.identity import (
    IdentityResolver,
    TenantKey,
    header_labels,
    load_tenant_keys,
    metadata_labels,
)

GOLD = TenantKey("gold-key", "gold", (("tier", "paid"),))


def _resolver(trust: bool) -> IdentityResolver:
    return IdentityResolver(["plain-key"], [GOLD], "default", trust)


def test_key_beats_claims_and_metadata_only_adds_labels() -> None:
    r = _resolver(trust=True)
    ident = r.resolve("gold-key", "mallory", {"tier": "free", "team": "x"},
                      {"tier": "free", "tenant": "mallory", "app": "y"})
    assert ident.tenant == "gold"
    assert dict(ident.labels) == {"tier": "paid", "team": "x", "app": "y", "tenant": "gold"}
    claimed = r.resolve("plain-key", "silver", {"team": "x"}, {"team": "y"})
    assert claimed.tenant == "silver" and claimed.labels["team"] == "x"
    assert r.resolve(None, None, None, {"tenant": "bronze"}).tenant == "bronze"


def test_untrusted_clients_cannot_name_their_tenant() -> None:
    r = _resolver(trust=False)
    ident = r.resolve("plain-key", "silver", {"team": "x"}, {"tenant": "silver", "app": "y"})
    assert ident.tenant == "default"
    assert dict(ident.labels) == {"app": "y", "tenant": "default"}
    assert r.accepts("gold-key") and r.accepts("plain-key") and not r.accepts("gold")


def test_malformed_identity_is_a_400() -> None:
    assert header_labels("a=1, b = 2") == {"a": "1", "b": "2"}
    for bad in ("novalue", "=x", "a b=1"):
        with pytest.raises(InvalidRequest):
            header_labels(bad)
    for md in ([1], {"k": 1}, {f"k{i}": "v" for i in range(17)}):
        with pytest.raises(InvalidRequest):
            metadata_labels({"metadata": md})
    with pytest.raises(InvalidRequest):
        _resolver(trust=True).resolve(None, "bad tenant!")


def test_key_file(tmp_path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("keys:\n  k1: {tenant: gold, labels: {tier: paid}}\n  k2: {tenant: b}\n")
    assert load_tenant_keys(str(path)) == (TenantKey("k1", "gold", (("tier", "paid"),)),
                                           TenantKey("k2", "b"))
    path.write_text("keys:\n  k1: {tenant: gold, color: red}\n")
    with pytest.raises(ValueError, match="tenant"):
        load_tenant_keys(str(path))
