"""Runs a worker: gRPC server (Worker + health), model load, metrics, registration,
and the graceful drain on SIGTERM/SIGINT.

Lifecycle: the server starts with `liveness` SERVING and `readiness` NOT_SERVING, loads
the model (in a thread), then turns readiness on and registers in Redis. On SIGTERM
readiness goes off, the Redis key is deleted, new Generate calls get UNAVAILABLE, and
in-flight requests get up to `drain_timeout_s` to finish before the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from decode.config import WorkerConfig
from decode.metrics import WorkerMetrics
from decode.registration import RedisRegistrar
from decode.service import WorkerService
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig, ModelConfig
from engine.scheduler import SchedulerStats
from protos import splitserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def kv_layout_string(engine_config: EngineConfig) -> str:
    from kvtransfer.layout import KVLayout

    m = ModelConfig.from_model_dir(engine_config.model_dir)
    return KVLayout(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                    block_size=engine_config.cache.block_size,
                    dtype=engine_config.dtype or m.dtype).to_json()


AddServices = Callable[[grpc.aio.Server, WorkerService], None]


async def serve(config: WorkerConfig, engine_config: EngineConfig,
                add_services: AddServices | None = None) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit code (0 after a clean drain).

    `add_services(server, service)` adds more servicers before the server starts (the
    prefill worker adds `Prefill`); they find the engine at `service.llm` once loaded
    (None before: answer UNAVAILABLE) and should refuse new work while
    `service.draining`."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    model = engine_config.model_id or engine_config.model_dir
    holder: list[AsyncLLM] = []

    def stats() -> SchedulerStats | None:
        return holder[0].stats() if holder else None

    metrics = WorkerMetrics(model, stats)
    service = WorkerService(config, metrics, kv_layout_string(engine_config))
    health = health_aio.HealthServicer()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_WorkerServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if add_services is not None:
        add_services(server, service)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await health.set("liveness", SERVING)
    await health.set("readiness", NOT_SERVING)
    await server.start()
    http = None
    if config.metrics_port is not None:
        http = start_http_server(config.metrics_port, addr=config.host,
                                 registry=metrics.registry)
    address = f"{config.advertise_host or config.host}:{port}"
    log.info("worker %s (%s) listening on %s; loading %s", config.worker_id, config.role,
             address, engine_config.model_dir)
    llm = await asyncio.to_thread(AsyncLLM, engine_config)
    holder.append(llm)
    service.attach(llm)
    registrar = _registrar(config, model, address, service)
    beat = asyncio.create_task(registrar.run()) if registrar else None
    await health.set("readiness", SERVING)
    log.info("worker %s ready on %s", config.worker_id, address)
    await stop.wait()
    await _drain(config, service, health, llm)
    if beat is not None:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
    if registrar is not None:
        await registrar.remove()
    service.stopping = True
    service.changed.set()
    await asyncio.sleep(0.1)  # let Load streams return before the server cancels them
    await health.enter_graceful_shutdown()
    await server.stop(grace=1.0)
    if http is not None:
        http[0].shutdown()
    llm.shutdown()
    log.info("worker %s stopped", config.worker_id)
    return 0


def _registrar(config: WorkerConfig, model: str, address: str,
               service: WorkerService) -> RedisRegistrar | None:
    if not config.redis_url:
        return None
    assert service.llm is not None
    eng = service.llm.engine
    fields = {"worker_id": config.worker_id, "address": address, "role": config.role,
              "model": model, "kv_layout": service.kv_layout,
              "transport_address": service.transport_address,
              "block_size": str(eng.block_size), "max_model_len": str(eng.max_model_len),
              "started": f"{time.time():.3f}"}
    return RedisRegistrar(config.redis_url, model, config.worker_id, fields,
                          config.registration_ttl_s, config.heartbeat_s,
                          config.redis_timeout_s)


async def _drain(config: WorkerConfig, service: WorkerService,
                 health: health_aio.HealthServicer, llm: AsyncLLM) -> None:
    """Readiness off, no new requests, then wait (bounded) for in-flight ones."""
    log.info("worker %s draining (%d in flight, up to %.0fs)", config.worker_id,
             llm.num_active, config.drain_timeout_s)
    service.draining = True
    service.changed.set()
    await health.set("readiness", NOT_SERVING)
    deadline = time.monotonic() + config.drain_timeout_s
    while llm.num_active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if llm.num_active:
        log.warning("worker %s: %d requests still running at the drain deadline; aborting",
                    config.worker_id, llm.num_active)


def with_model_id(engine_config: EngineConfig, model_id: str) -> EngineConfig:
    return replace(engine_config, model_id=model_id)
