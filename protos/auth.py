"""The cluster credential on worker RPCs: a per-call signature, and optional mTLS.

Every call to a worker but health (Worker.Generate/Load/Info/FetchKV, Prefill.Prefill)
carries one metadata entry signed with the cluster token (the secret prefill and decode
workers already share for KV transfer, SPLITSERVE_CLUSTER_TOKEN / --cluster-token-file):

    x-splitserve-auth: v1:<unix time, ms>:<nonce, 32 hex>:<HMAC-SHA256(token, "v1\\n"
                       method "\\n" time "\\n" nonce), hex>

The server (`AuthInterceptor`, one per worker gRPC server) accepts a call when the MAC
is right, its time is within `window_s` of the server's clock, and its nonce has not
been seen inside the window (a replayed call is refused). Anything else gets
UNAUTHENTICATED before the handler runs (the request body is not even parsed), is
logged and counted (`splitserve:rpc_auth_failures_total{reason}` on the worker's
/metrics). Callers sign with `RpcSecurity.channel` (a grpc.aio client interceptor) or
`signed_metadata` (synchronous helpers).

With no token configured (a colocated worker started without one: only colocated
workers may start without it) nothing is signed or checked and the worker logs that
its RPCs are open. A gateway must then have no token either, or it could not tell.

mTLS (`TLSFiles`): servers present `cert`/`key`; with `ca`, a server requires client
certificates signed by it, and clients verify servers against it and present their own
`cert`/`key`. The signature is still checked on top (TLS authenticates the channel,
the token the cluster).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

AUTH_KEY = "x-splitserve-auth"
VERSION = "v1"
# Open to anyone: health probes (kubelets, load balancers) carry no credential.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def _mac(token: str, method: str, stamp: str, nonce: str) -> str:
    msg = "\n".join((VERSION, method, stamp, nonce)).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def sign(token: str, method: str, now: float | None = None, nonce: str | None = None) -> str:
    """The credential of one call to `method` ("/package.Service/Method")."""
    stamp = str(int((time.time() if now is None else now) * 1000))
    nonce = nonce or secrets.token_hex(16)
    return f"{VERSION}:{stamp}:{nonce}:{_mac(token, method, stamp, nonce)}"


def signed_metadata(token: str, method: str) -> tuple[tuple[str, str], ...]:
    """Metadata for one call (empty without a token), for synchronous stubs."""
    return ((AUTH_KEY, sign(token, method)),) if token else ()


class Verifier:
    """Checks credentials: MAC, time window, and nonces seen inside the window.

    Nonces are remembered until their time leaves the window (a replay older than that
    fails the time check instead), so memory is bounded by the call rate times the
    window; past `max_nonces` the oldest are dropped and calls that old are refused as
    stale."""

    def __init__(self, token: str, window_s: float = 30.0, max_nonces: int = 1 << 20,
                 clock: Callable[[], float] = time.time) -> None:
        if not token:
            raise ValueError("a Verifier needs the cluster token")
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self._token = token
        self._window = window_s
        self._max = max_nonces
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its time, in order
        self._floor = 0.0  # calls at or before this time may have lost their nonce

    def check(self, method: str, credential: str | None) -> str | None:
        """None when the call may run, else why not (missing, malformed, bad_mac,
        stale, replay)."""
        if not credential:
            return "missing"
        parts = credential.split(":")
        if len(parts) != 4 or parts[0] != VERSION or not parts[1].isdigit() \
                or len(parts[2]) != 32 or len(parts[3]) != 64:
            return "malformed"
        _, stamp, nonce, mac = parts
        if not hmac.compare_digest(mac, _mac(self._token, method, stamp, nonce)):
            return "bad_mac"
        now, t = self._clock(), int(stamp) / 1000.0
        self._forget(now)
        if abs(now - t) > self._window or t <= self._floor:
            return "stale"
        if nonce in self._seen:
            return "replay"
        self._seen[nonce] = max(t, next(reversed(self._seen.values()), t))
        if len(self._seen) > self._max:
            _, self._floor = self._seen.popitem(last=False)
        return None

    def _forget(self, now: float) -> None:
        # Kept in arrival order with non-decreasing times (a late-stamped call is filed
        # at its predecessor's time: kept a little longer, never dropped too early).
        while self._seen:
            nonce, t = next(iter(self._seen.items()))
            if now - t <= self._window:
                break
            del self._seen[nonce]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health without a valid credential (see the module doc)."""

    def __init__(self, token: str, window_s: float = 30.0,
                 registry: CollectorRegistry | None = None) -> None:
        self.verifier = Verifier(token, window_s)
        self.failures = Counter(
            "splitserve:rpc_auth_failures", "Worker RPCs refused as UNAUTHENTICATED, by "
            "reason (missing, malformed, bad_mac, stale, replay)", ["reason"],
            registry=registry if registry is not None else CollectorRegistry())

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        credential = None
        for key, value in details.invocation_metadata or ():
            if key == AUTH_KEY:
                credential = value if isinstance(value, str) else value.decode()
        reason = self.verifier.check(method, credential)
        if reason is None:
            return await continuation(details)
        self.failures.labels(reason).inc()
        log.warning("event=unauthenticated method=%s reason=%s", method, reason)
        handler = await continuation(details)  # looks the method up; runs nothing
        return _refusal(handler, f"worker RPCs need the cluster credential ({reason})")


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that aborts at once; the request stays unparsed."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED as usual
        return handler  # type: ignore[return-value]
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class _Signer:
    """Adds a fresh credential to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        md = grpc.aio.Metadata(*(d.metadata or ()))
        md.add(AUTH_KEY, sign(self._token, method))
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials,
                                          d.wait_for_ready)


# grpc.aio files an interceptor under one call shape only, so one class per shape.
class _UnarySigner(_Signer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamSigner(_Signer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files: this process's certificate and key, and the CA peers are checked
    against (with `ca`: mutual TLS)."""

    cert: str
    key: str
    ca: str | None = None

    def __post_init__(self) -> None:
        if not self.cert or not self.key:
            raise ValueError("TLS needs both a certificate and its key")

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        pair = [(_read(self.key), _read(self.cert))]
        ca = _read(self.ca)
        return grpc.ssl_server_credentials(
            pair, root_certificates=ca, require_client_auth=require_client_cert and ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca),
                                            private_key=_read(self.key),
                                            certificate_chain=_read(self.cert))


@dataclass(frozen=True, slots=True)
class RpcSecurity:
    """How this process talks to workers and serves worker RPCs: the cluster token
    ("" : unsigned and unchecked) and optional TLS."""

    token: str = field(default="", repr=False)
    tls: TLSFiles | None = None
    window_s: float = 30.0

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError("the replay window must be positive")

    def channel(self, address: str,
                options: Sequence[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        """A channel to a worker whose every call is signed (and TLS when configured).
        The caller owns and closes it."""
        interceptors: list[Any] | None = [_UnarySigner(self.token), _StreamSigner(
            self.token)] if self.token else None
        if self.tls is not None:
            return grpc.aio.secure_channel(address, self.tls.channel_credentials(), options,
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options, interceptors=interceptors)

    def sync_channel(self, address: str) -> grpc.Channel:
        """A synchronous channel (TLS when configured); sign calls with `metadata`."""
        if self.tls is not None:
            return grpc.secure_channel(address, self.tls.channel_credentials())
        return grpc.insecure_channel(address)

    def metadata(self, method: str) -> tuple[tuple[str, str], ...]:
        return signed_metadata(self.token, method)

    def interceptors(self, registry: CollectorRegistry | None = None,
                     ) -> list[grpc.aio.ServerInterceptor]:
        """The server side: the credential check, or nothing without a token."""
        return [AuthInterceptor(self.token, self.window_s, registry)] if self.token else []

    def add_port(self, server: grpc.aio.Server, address: str,
                 require_client_cert: bool = True) -> int:
        if self.tls is not None:
            return server.add_secure_port(address,
                                          self.tls.server_credentials(require_client_cert))
        return server.add_insecure_port(address)


def tls_from_args(cert: str | None, key: str | None, ca: str | None) -> TLSFiles | None:
    """--tls-cert/--tls-key/--tls-ca as TLSFiles (None when none is given)."""
    if not (cert or key or ca):
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together (--tls-ca is optional)")
    return TLSFiles(cert, key, ca)


def add_tls_arguments(p: Any, what: str) -> None:
    """--tls-cert/--tls-key/--tls-ca on an argparse parser; `what` names the server."""
    p.add_argument("--tls-cert", default=None,
                   help=f"PEM certificate of {what} (TLS on its gRPC server and as the "
                        "client certificate towards workers)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None,
                   help="PEM CA that worker certificates (and, on workers, client "
                        "certificates: mutual TLS) must chain to")
