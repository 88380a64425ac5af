"""Runs the gateway: registry, HTTP front, gRPC front (+ health), until SIGTERM/SIGINT.

Health: `liveness` SERVING while the process runs; `readiness` SERVING while at least
one decode/colocated worker is routable. /health on HTTP says the same as readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from engine.gc_heap import freeze_startup_heap
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.grpc_server import GenerateService
from gateway.http_server import build_app
from gateway.metrics import GatewayMetrics
from gateway.protocol import ModelContext
from gateway.registry import WorkerRegistry
from kvtransfer.wire import deadline
from protos import splitserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _follow_readiness(gw: Gateway, health: health_aio.HealthServicer) -> None:
    ready: bool | None = None
    while True:
        now = gw.ready()
        if now != ready:
            await health.set("readiness", SERVING if now else NOT_SERVING)
            log.info("gateway readiness: %s", "SERVING" if now else "NOT_SERVING")
            ready = now
        gw.registry.changed.clear()
        with contextlib.suppress(TimeoutError):
            async with deadline(0.5):  # (wait_for may swallow a cancel)
                await gw.registry.changed.wait()


async def serve(config: GatewayConfig, block_size: int = 16,
                max_model_len: int | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ctx = ModelContext(config.model_dir, config.served_model_name, max_model_len,
                       config.tool_call_parser, generation_config=config.generation_config)
    # Callbacks fire only after registry.start(), by which time `gw` exists.
    registry = WorkerRegistry(config, on_info=lambda info: gw.observe_info(info))
    gw = Gateway(config, ctx, registry, GatewayMetrics(), block_size)
    await registry.start()
    await gw.start()  # the stored scheduling strategies
    runner = web.AppRunner(build_app(gw), handler_cancellation=True, access_log=None)
    await runner.setup()
    freeze_startup_heap()  # before the first request: full collections skip start-up
    site = web.TCPSite(runner, config.host, config.http_port)
    await site.start()
    server = None
    health = health_aio.HealthServicer()
    follow = None
    if config.grpc_port is not None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_GenerateServicer_to_server(GenerateService(gw), server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        # TLS when configured; clients are not asked for certificates (API keys).
        config.security.add_port(server, f"{config.host}:{config.grpc_port}",
                                 require_client_cert=False)
        await health.set("liveness", SERVING)
        await health.set("readiness", NOT_SERVING)
        await server.start()
        follow = asyncio.create_task(_follow_readiness(gw, health))
    log.info("gateway serving %s: http://%s:%d grpc %s", config.served_model_name, config.host,
             config.http_port, config.grpc_port)
    await stop.wait()
    log.info("gateway stopping")
    if follow is not None:
        follow.cancel()
    if server is not None:
        await health.enter_graceful_shutdown()
        await server.stop(grace=2.0)
    await runner.cleanup()
    await registry.stop()
    await gw.close()
    ctx.close()
    return 0
