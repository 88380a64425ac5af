"""The gRPC front without workers, through a real grpc.aio server on loopback: API keys
(`authorization: Bearer <key>` metadata) are the HTTP front's, checked before
validation; a request that passes every check of the gateway's own ends UNAVAILABLE
(no worker)."""

from __future__ import annotations

import asyncio

import grpc

from gateway.core import Gateway
from gateway.grpc_server import GenerateService
from gateway.identity import TenantKey
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from tests.factories import workerless_gateway

OK = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=2))
BAD = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=100_000))


async def _codes(gw: Gateway, calls: list[tuple[pb.GenerateRequest, str | None]],
                 ) -> list[grpc.StatusCode]:
    """Each call's status code; `authorization` metadata when given."""
    server = grpc.aio.server()
    pb_grpc.add_GenerateServicer_to_server(GenerateService(gw), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GenerateStub(ch)
            for req, auth in calls:
                md = (("authorization", auth),) if auth is not None else None
                try:
                    async for _ in stub.Generate(req, metadata=md, timeout=10):
                        pass
                    out.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    out.append(e.code())
    finally:
        await server.stop(None)
    return out


def test_api_keys_are_enforced_like_http() -> None:
    gw = workerless_gateway(api_keys=("sekret",), tenant_keys=(TenantKey("gold-key", "gold"),))
    codes = asyncio.run(_codes(gw, [
        (OK, None), (OK, "Bearer wrong"), (OK, "sekret"), (OK, "Basic sekret"),
        (BAD, None),  # the key first: a stranger learns nothing of validation
        (OK, "Bearer sekret"), (OK, "Bearer gold-key"), (BAD, "Bearer sekret"),
    ]))
    unauth, unavailable = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE
    assert codes == [unauth] * 5 + [unavailable, unavailable,
                                    grpc.StatusCode.INVALID_ARGUMENT]


def test_no_keys_configured_leaves_the_door_open() -> None:
    codes = asyncio.run(_codes(workerless_gateway(), [
        (OK, None), (OK, "Bearer anything"), (BAD, None)]))
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 2 + [grpc.StatusCode.INVALID_ARGUMENT]


def test_ids_outside_the_vocabulary_are_invalid_argument() -> None:
    """vLLM's 400s for allowed_token_ids and logit_bias keys outside the model's
    vocabulary are INVALID_ARGUMENT on gRPC, before any routing; a bias beyond
    [-100, 100] is clamped, as on HTTP."""
    gw = workerless_gateway()
    vocab = gw.ctx.vocab_size

    def req(**sampling: object) -> pb.GenerateRequest:
        return pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(
            max_tokens=2, **sampling))

    codes = asyncio.run(_codes(gw, [
        (req(allowed_token_ids=[5, vocab]), None), (req(allowed_token_ids=[-1]), None),
        (req(logit_bias={vocab: 1.0}), None),
        (req(allowed_token_ids=[5, vocab - 1], logit_bias={vocab - 1: 1.0}), None),
        (req(logit_bias={5: 1e9, 6: float("-inf")}), None),  # not refused (clamped)
    ]))
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3 + [grpc.StatusCode.UNAVAILABLE] * 2


def test_echo_asks_for_the_prompts_logprobs_as_http() -> None:
    """Chat echo asks for the prompt's logprobs always (top `logprobs` of them, 0 unset:
    vLLM's ChatCompletionRequest.to_sampling_params); completion echo with logprobs."""
    service = GenerateService(workerless_gateway())
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello")])

    def prompt_logprobs(**kw: object) -> int | None:
        return service._input(pb.GenerateRequest(echo=True, **kw)).params.prompt_logprobs

    assert prompt_logprobs(chat=chat) == 0
    assert prompt_logprobs(chat=chat, sampling=pb.SamplingParams(logprobs=3)) == 3
    assert prompt_logprobs(prompt="hello") is None
    assert prompt_logprobs(prompt="hello", sampling=pb.SamplingParams(logprobs=2)) == 2
