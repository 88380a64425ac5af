"""Who sent a request: its tenant and labels, which scheduling strategies select on
(engine/strategies.py) and the gateway's admission queue shares service by.

Sources, strongest first:
1. the API key: `--tenants FILE` maps a key to a tenant and labels (plain `--api-key`
   keys identify nobody: they get the default tenant);
2. the client's own claims: `X-Tenant` / `X-Labels: k=v,k2=v2` headers on HTTP,
   `metadata.tenant` in the body, `GenerateRequest.tenant/labels` on gRPC — honoured
   only with `trust_client_identity` (e.g. behind a proxy that sets them);
3. the body's `metadata` (OpenAI's string map) always adds labels, never the tenant.

A stronger source's label wins over a weaker one's; the label "tenant" is always the
resolved tenant, so a selector on "tenant" cannot be spoofed through labels.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest, Unauthorized

TENANT_LABEL = "tenant"  # engine.strategies.TENANT_LABEL
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
MAX_LABELS = 16  # OpenAI's limit on `metadata` pairs
MAX_VALUE = 512


@dataclass(frozen=True, slots=True)
class TenantKey:
    """One API key of the key -> identity map."""

    key: str
    tenant: str
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("an API key must be non-empty")
        _check_tenant(self.tenant, "tenant of an API key")
        check_labels(dict(self.labels), "labels of an API key")


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    labels: Mapping[str, str]


def _check_tenant(tenant: Any, where: str) -> str:
    if not isinstance(tenant, str) or not _NAME.match(tenant):
        raise ValueError(f"{where} must be 1-128 characters of letters, digits and ._:/- "
                         f"(starting with a letter or digit), got {tenant!r}")
    return tenant


def check_labels(labels: Any, where: str) -> dict[str, str]:
    if not isinstance(labels, dict):
        raise ValueError(f"{where} must be an object of string values")
    if len(labels) > MAX_LABELS:
        raise ValueError(f"{where}: at most {MAX_LABELS} labels, got {len(labels)}")
    for k, v in labels.items():
        if not isinstance(k, str) or not _NAME.match(k):
            raise ValueError(f"{where}: label key {k!r} must be 1-128 characters of "
                             "letters, digits and ._:/-")
        if not isinstance(v, str) or len(v) > MAX_VALUE:
            raise ValueError(f"{where}: label {k!r} must be a string of at most "
                             f"{MAX_VALUE} characters")
    return dict(labels)


def parse_label_header(value: str) -> dict[str, str]:
    """`k=v,k2=v2` (as a Kubernetes label selector writes them) -> a dict."""
    out: dict[str, str] = {}
    for part in value.split(","):
        if not part.strip():
            continue
        k, sep, v = part.partition("=")
        if not sep:
            raise ValueError(f"X-Labels: {part.strip()!r} is not key=value")
        out[k.strip()] = v.strip()
    return check_labels(out, "X-Labels")


def load_tenant_keys(path: str) -> tuple[TenantKey, ...]:
    """A YAML/JSON file `{keys: {<key>: {tenant: gold, labels: {tier: paid}}}}`."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, dict):
        raise ValueError(f"{path}: expected a mapping `keys: {{<api key>: {{tenant: ...}}}}`")
    out = []
    for key, ident in keys.items():
        if not isinstance(ident, dict) or set(ident) - {"tenant", "labels"}:
            raise ValueError(f"{path}: key entries take `tenant` and `labels` only")
        labels = check_labels(ident.get("labels") or {}, f"{path}: labels")
        out.append(TenantKey(str(key), str(ident.get("tenant", "")),
                             tuple(sorted(labels.items()))))
    return tuple(out)


class IdentityResolver:
    """Answers "is this key accepted" and "who is this request" (immutable)."""

    def __init__(self, api_keys: Iterable[str], tenant_keys: Iterable[TenantKey],
                 default_tenant: str, trust_client: bool) -> None:
        self.by_key = {t.key: t for t in tenant_keys}
        self.plain_keys = tuple(api_keys)
        self.default_tenant = _check_tenant(default_tenant, "the default tenant")
        self.trust_client = trust_client

    @property
    def keys_required(self) -> bool:
        return bool(self.plain_keys or self.by_key)

    def accepts(self, token: str) -> bool:
        """Constant time per key (hmac.compare_digest), as the plain key check was."""
        import hmac

        return any(hmac.compare_digest(token.encode(), k.encode())
                   for k in (*self.plain_keys, *self.by_key))

    def authenticate(self, token: str) -> None:
        """The front door of both fronts (HTTP /v1/*, gRPC Generate): Unauthorized (401 /
        UNAUTHENTICATED) for a missing or wrong key when keys are configured."""
        if self.keys_required and not self.accepts(token):
            raise Unauthorized("invalid or missing API key")

    def resolve(self, token: str | None, claimed_tenant: str | None = None,
                claimed_labels: Mapping[str, str] | None = None,
                metadata: Mapping[str, str] | None = None) -> Identity:
        """`claimed_*` are the client's headers / gRPC fields (ignored unless trusted);
        `metadata` the body's. InvalidRequest (400) for a malformed claim."""
        key = self.by_key.get(token) if token else None
        labels = dict(metadata or {})
        tenant = self.default_tenant
        if self.trust_client:
            labels.update(claimed_labels or {})
            claim = claimed_tenant or labels.get(TENANT_LABEL)
            if claim:
                try:
                    tenant = _check_tenant(claim, "the tenant")
                except ValueError as e:
                    raise InvalidRequest(str(e), "tenant") from e
        if key is not None:
            labels.update(key.labels)
            tenant = key.tenant
        labels[TENANT_LABEL] = tenant
        return Identity(tenant, labels)


def bearer_token(authorization: str | bytes | None) -> str:
    """The key of an `Authorization: Bearer <key>` header (HTTP) or `authorization`
    metadata (gRPC), or "" (none, or not UTF-8: aiohttp hands such header bytes on as
    lone surrogates, which no key can equal and `str.encode` refuses)."""
    if not isinstance(authorization, str) or not authorization.startswith("Bearer "):
        return ""
    token = authorization[7:]
    try:
        token.encode()
    except UnicodeEncodeError:
        return ""
    return token


def metadata_labels(body: Mapping[str, Any]) -> dict[str, str]:
    """The body's OpenAI `metadata` (a map of strings) validated, or {}."""
    md = body.get("metadata")
    if md is None:
        return {}
    try:
        return check_labels(md, "`metadata`")
    except ValueError as e:
        raise InvalidRequest(str(e), "metadata") from e


def header_labels(value: str | None) -> dict[str, str]:
    if not value:
        return {}
    try:
        value.encode()  # aiohttp passes non-UTF-8 header bytes on as lone surrogates
    except UnicodeEncodeError:
        raise InvalidRequest("X-Labels must be UTF-8", "X-Labels") from None
    try:
        return parse_label_header(value)
    except ValueError as e:
        raise InvalidRequest(str(e), "X-Labels") from e
