"""The worker RPC credential (protos/auth.py): the verifier's window and replay rules,
and signing + mutual TLS over a real gRPC server on a local socket."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest

from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from protos.auth import RpcSecurity, TLSFiles, Verifier, sign

INFO = "/splitserve.v1.Worker/Info"


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_verifier_window_and_replay() -> None:
    clock = Clock()
    v = Verifier("tok", window_s=30, clock=clock)
    good = sign("tok", INFO, now=clock.t)
    assert v.check(INFO, good) is None
    assert v.check(INFO, good) == "replay"
    assert v.check("/splitserve.v1.Worker/Load", sign("tok", INFO, now=clock.t)) == "bad_mac"
    assert v.check(INFO, sign("other", INFO, now=clock.t)) == "bad_mac"
    assert v.check(INFO, None) == "missing"
    assert v.check(INFO, "v1:abc:def:ghi") == "malformed"
    assert v.check(INFO, sign("tok", INFO, now=clock.t - 31)) == "stale"
    assert v.check(INFO, sign("tok", INFO, now=clock.t + 31)) == "stale"  # skew both ways
    assert v.check(INFO, sign("tok", INFO, now=clock.t - 29)) is None
    # Past the window the nonce is forgotten, and the credential is stale anyway.
    clock.t += 31
    assert v.check(INFO, good) == "stale"
    assert not v._seen or min(v._seen.values()) >= clock.t - 30


def test_verifier_memory_is_bounded() -> None:
    clock = Clock()
    v = Verifier("tok", window_s=30, max_nonces=4, clock=clock)
    creds = [sign("tok", INFO, now=clock.t + i * 0.001) for i in range(6)]
    assert all(v.check(INFO, c) is None for c in creds)
    assert len(v._seen) == 4
    # The two forgotten nonces must not be replayable: calls that old are refused.
    assert v.check(INFO, creds[0]) == "stale" and v.check(INFO, creds[1]) == "stale"
    assert v.check(INFO, creds[5]) == "replay"


def _certs(tmp: Path) -> tuple[TLSFiles, TLSFiles, TLSFiles]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (PEM files)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def make(name: str, issuer: tuple | None, ca: bool, ip: bool) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        b = (x509.CertificateBuilder().subject_name(subject)
             .issuer_name(issuer[0].subject if issuer else subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=1))
             .not_valid_after(now + datetime.timedelta(hours=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ip:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = b.sign(issuer[1] if issuer else key, hashes.SHA256())
        for suffix, data in ((".crt", cert.public_bytes(serialization.Encoding.PEM)),
                             (".key", key.private_bytes(
                                 serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()))):
            (tmp / (name + suffix)).write_bytes(data)
        return cert, key

    ca = make("ca", None, True, False)
    make("server", ca, False, True)
    make("client", ca, False, False)
    make("stranger", None, False, False)  # self-signed: not from the cluster's CA

    def files(name: str) -> TLSFiles:
        return TLSFiles(str(tmp / f"{name}.crt"), str(tmp / f"{name}.key"), str(tmp / "ca.crt"))
    return files("server"), files("client"), files("stranger")


class _Info(pb_grpc.WorkerServicer):
    async def Info(self, request: pb.InfoRequest,
                   context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return pb.InfoResponse(worker_id="w")


def test_signed_calls_over_mutual_tls(tmp_path: Path) -> None:
    server_tls, client_tls, stranger_tls = _certs(tmp_path)

    async def main() -> None:
        served = RpcSecurity("tok", server_tls)
        server = grpc.aio.server(interceptors=served.interceptors())
        pb_grpc.add_WorkerServicer_to_server(_Info(), server)
        port = served.add_port(server, "127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"

        async def info(security: RpcSecurity) -> grpc.StatusCode:
            async with security.channel(address) as ch:
                try:
                    await pb_grpc.WorkerStub(ch).Info(pb.InfoRequest(), timeout=3)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    return e.code()
        try:
            assert await info(RpcSecurity("tok", client_tls)) == grpc.StatusCode.OK
            # TLS alone is not enough: the token is checked on top.
            assert await info(RpcSecurity("", client_tls)) == grpc.StatusCode.UNAUTHENTICATED
            # A client certificate from another CA fails the handshake; so does plaintext.
            assert await info(RpcSecurity("tok", stranger_tls)) == grpc.StatusCode.UNAVAILABLE
            assert await info(RpcSecurity("tok")) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)

    asyncio.run(main())
