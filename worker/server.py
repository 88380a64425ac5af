"""Runs a worker: gRPC server (Worker + health; Prefill on a prefill worker), model
load, the KV-transfer side of its role, metrics, registration, and the graceful drain
on SIGTERM/SIGINT.

KV transfer by role: a decode worker runs a kvtransfer receiver over its KV cache (for
`shm` the cache itself is allocated in shared memory) and advertises its address; a
prefill worker's `Prefill` service connects to those addresses as a sender.

Lifecycle: the server starts with `liveness` SERVING and `readiness` NOT_SERVING, loads
the model (in a thread), then turns readiness on and registers in Redis. On SIGTERM
readiness goes off, the Redis key is deleted, new Generate calls get UNAVAILABLE, and
in-flight requests get up to `drain_timeout_s` to finish before the server stops. Each
step of the stop after the drain is bounded (a dead KV-transfer peer or an unreachable
Redis cannot hold it up) and logged at DEBUG with its duration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig, ModelConfig
from engine.gc_heap import freeze_startup_heap
from engine.kv_scales import accept_blocks
from engine.kv_sizing import kv_cache_dtype, num_kv_blocks
from engine.scheduler import SchedulerStats
from kvtransfer.config import TransferConfig
from kvtransfer.layout import KVLayout, engine_layout
from kvtransfer.memory import RankCaches
from kvtransfer.pusher import KVPusher
from kvtransfer.tiers.config import TierConfig
from kvtransfer.tiers.disk_scales import bind_disk_scales
from kvtransfer.tiers.worker import attach_index, open_tiers
from protos import splitserve_pb2_grpc as pb_grpc
from worker.config import WorkerConfig
from worker.handoff import HandoffConfig, HandoffConnector
from worker.kv_events import start_kv_publisher
from worker.kv_source import KVSource
from worker.metrics import StagingCollector, WorkerMetrics
from worker.registration import RedisRegistrar
from worker.service import WorkerService
from worker.strategies import StrategyWatcher

if TYPE_CHECKING:
    import torch

    from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def kv_layout_string(engine_config: EngineConfig) -> str:
    return engine_layout(engine_config).to_json()


class KVSide:
    """The KV-transfer part of a worker's role: its hand-off connector (a decode worker
    receives, prefill peers and kv peers write into its blocks; a prefill worker serves
    `Prefill`) and its pusher (the prefill's blocks, and cached blocks a peer asks for
    with FetchKV). Owns what it makes."""

    def __init__(self, config: WorkerConfig, transfer: TransferConfig | None,
                 service: WorkerService, metrics: WorkerMetrics) -> None:
        if config.role != "colocated" and transfer is None:
            raise ValueError(f"a {config.role} worker needs a TransferConfig")
        self.role = config.role
        self.transfer = transfer
        self.service = service
        self.registry = metrics.registry
        self.layout = KVLayout.from_json(service.kv_layout)
        self.handoff: HandoffConnector | None = None
        self.pusher: KVPusher | None = None
        if config.role != "colocated":
            assert transfer is not None
            self.handoff = HandoffConnector(
                HandoffConfig(transfer, config.kv_failure_policy, config.prefill_timeout_s,
                              config.security), service, metrics.registry)
        self._shared = False
        self._staging: torch.Tensor | None = None
        self._stage: Callable[[list[int]], Awaitable[None]] | None = None
        # one count of staged blocks: the runner's (none before the engine exists)
        self._runner: ModelRunner | None = None
        self.registry.register(StagingCollector(
            lambda: self._runner.staged_blocks if self._runner is not None else None))

    def add_to(self, server: grpc.aio.Server) -> None:
        if self.handoff is not None and self.role == "prefill":
            pb_grpc.add_PrefillServicer_to_server(self.handoff, server)

    def kv_cache(self, engine_config: EngineConfig) -> torch.Tensor | None:
        """The engine's KV tensor when the transport must own it (shm), else None."""
        if self.handoff is None or self.handoff.receiver is None:
            return None
        m = ModelConfig.from_model_dir(engine_config.model_dir)
        dtype = kv_cache_dtype(engine_config, m)
        tp = engine_config.tensor_parallel_size
        num_blocks = num_kv_blocks(engine_config, m.shard(tp), dtype)
        if num_blocks is None:  # CUDA, sized from free memory: the engine allocates it
            return None
        if tp > 1 and not engine_config.device.startswith("cuda"):
            return None  # the ranks' own caches, in named segments (RankCaches)
        kv = self.handoff.allocate_kv(self.layout, num_blocks)
        self._shared = kv is not None
        if tp > 1:  # the transport's memory is rank 0's full-head staging copy
            self._staging = cast("torch.Tensor | None", kv)
            return None
        return cast("torch.Tensor | None", kv)

    async def start(self, llm: AsyncLLM, advertise_host: str) -> None:
        kv = self._transport_kv(llm)
        if self.handoff is not None and self.handoff.receiver is not None:
            address = await self.handoff.start(kv, self.layout, self._shared)
            self.service.transport_address = advertised(address, advertise_host)
            llm.handoff = self.handoff
            log.info("kv receiver listening: %s", self.service.transport_address)
        if self.transfer is not None:
            self.pusher = KVPusher(self.transfer, kv, self.layout, self.registry)
            self.pusher.stage = self._stage
            self.service.kv_source = KVSource(llm, self.pusher, self.transfer.io_timeout_s,
                                              self.registry)
            if self.handoff is not None:
                self.handoff.pusher = self.pusher

    def _transport_kv(self, llm: AsyncLLM) -> torch.Tensor | RankCaches:
        """What the transports register: the engine's KV cache; under tensor parallelism
        (each rank holds its KV heads) every rank's cache where rank 0 maps them (CPU:
        each rank's heads move straight between its cache and the wire), else (CUDA)
        rank 0's staging copy with every head and the pool's block ids, gathered from
        the ranks before a send and scattered to them after a receive lands."""
        runner = self._runner = llm.engine.runner
        self._accept_into(llm, None)
        if runner.tp is None:
            return runner.kv_cache
        if runner.rank_caches is not None:
            return RankCaches(list(runner.rank_caches), runner.tp.segments)
        if self._staging is not None:  # shm's shared segment
            if self._staging.shape[0] != runner.num_blocks:
                raise ValueError(f"the shared KV staging holds {self._staging.shape[0]} "
                                 f"blocks, the engine's pool {runner.num_blocks}")
            runner.kv_staging = self._staging
        staging = runner.staging()

        async def stage(ids: list[int]) -> None:
            await llm.call(lambda eng: eng.runner.gather_blocks(ids, staging))

        async def land(ids: list[int]) -> None:
            await llm.call(lambda eng: eng.runner.scatter_blocks(ids, staging))

        if self.handoff is not None:
            self.handoff.land = land
        self._accept_into(llm, staging)
        self._stage = stage
        return staging

    def _accept_into(self, llm: AsyncLLM, staging: torch.Tensor | None) -> None:
        """Landed blocks take the engine's float8 scales where the transports wrote
        them: rank 0's staging copy (scattered afterwards), else the caches."""
        if self.handoff is None:
            return

        async def accept(ids: list[int], kv_scales: list[float]) -> None:
            await llm.call(lambda eng: accept_blocks(eng.runner, ids, kv_scales, staging))

        self.handoff.accept = accept

    async def close(self) -> None:
        if self.handoff is not None:
            await self.handoff.close()
        if self.pusher is not None:
            await self.pusher.close()


def check_device_transport(engine_config: EngineConfig, transfer: TransferConfig | None) -> None:
    """Refuse, at start-up, a transport that cannot serve this KV cache: tcp and shm move
    bytes through host memory; cuda_ipc maps a cache on a GPU. The message names the
    option that works. (cuda_ipc across nodes is refused at connect, naming ucx.)"""
    if transfer is None:
        return
    cuda, transport = engine_config.device.startswith("cuda"), transfer.transport
    if cuda and transport in ("tcp", "shm"):
        raise ValueError(f"--transport {transport} needs the KV cache in host memory; with "
                         "--device cuda use --transport cuda_ipc (workers on one node), "
                         "ucx (between nodes) or auto (each peer the fastest that works)")
    if not cuda and transport == "cuda_ipc":
        raise ValueError("--transport cuda_ipc needs the KV cache on a GPU; with --device "
                         "cpu use --transport shm (workers on one node) or tcp")


def check_kv_scales(engine_config: EngineConfig, tier_config: TierConfig | None) -> None:
    """Refuse, at start-up, what --calculate-kv-scales does not cover: LMCache's blocks
    outlive the process whose scales wrote them (and may be shared between workers), and
    carry none. (The hand-off and peer fetch carry the sender's scales, the disk tier
    records its own, the host tier holds this process's bytes only: engine/kv_scales.py,
    kvtransfer/tiers/disk_scales.py.)"""
    lmcache = tier_config is not None and tier_config.lmcache is not None
    if engine_config.cache.calculate_kv_scales and lmcache:
        raise ValueError("--calculate-kv-scales runs without --lmcache-config (LMCache's "
                         "blocks outlive the process whose scales wrote them); drop the "
                         "flag to use the checkpoint's scales")


def advertised(address: str, host: str) -> str:
    """A receiver bound to a wildcard address is dialled at the advertised host."""
    desc = json.loads(address)
    if desc.get("host") in ("0.0.0.0", "::", "") and host:
        desc["host"] = host
    return json.dumps(desc)


async def serve(config: WorkerConfig, engine_config: EngineConfig,
                transfer: TransferConfig | None = None,
                tier_config: TierConfig | None = None) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit code (0 after a clean drain).
    `transfer` is required for the prefill and decode roles; `tier_config`: the KV
    offload tiers (host, disk, LMCache), if any."""
    check_device_transport(engine_config, transfer)
    check_kv_scales(engine_config, tier_config)
    if engine_config.tensor_parallel_size > 1 and engine_config.device.startswith("cuda") \
            and (config.role != "colocated" or (tier_config is not None and tier_config.enabled)):
        # rank 0's full-head staging copy (KVSide._transport_kv, the tiers' copies): its
        # memory counts in the KV budget
        engine_config = replace(engine_config, kv_staging=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    model = engine_config.model_id or engine_config.model_dir
    holder: list[AsyncLLM] = []

    def stats() -> SchedulerStats | None:
        return holder[0].stats() if holder else None

    def cache_info() -> dict[str, str] | None:
        if not holder:
            return None
        c = engine_config.cache
        return {"block_size": str(c.block_size), "num_gpu_blocks": str(holder[0].stats().num_blocks),
                "cache_dtype": engine_config.cache.cache_dtype,
                "enable_prefix_caching": str(c.enable_prefix_caching),
                "gpu_memory_utilization": str(c.gpu_memory_utilization)}

    metrics = WorkerMetrics(model, stats, cache_info)
    service = WorkerService(config, metrics, kv_layout_string(engine_config))
    kv_side = KVSide(config, transfer, service, metrics)
    health = health_aio.HealthServicer()
    # Every RPC but health needs the cluster credential (protos/auth.py); then, when
    # testing, injected faults (worker/faults.py).
    interceptors = config.security.interceptors(metrics.registry)
    if config.faults is not None:
        from worker.faults import RpcFaults

        log.warning("fault injection on: %s", config.faults)
        interceptors.append(RpcFaults(config.faults, metrics.registry))
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    kv_side.add_to(server)
    port = config.security.add_port(server, f"{config.host}:{config.port}")
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
    tiers = open_tiers(tier_config, engine_config, metrics.registry)
    try:
        llm = await asyncio.to_thread(AsyncLLM, engine_config, kv_side.kv_cache(engine_config),
                                      tiers)
        if tiers is not None:  # the disk tier's blocks keep the scales they were written under
            await llm.call(lambda eng: bind_disk_scales(tiers, eng.runner))
        await kv_side.start(llm, config.advertise_host or config.host)
    except BaseException:
        if tiers is not None:
            tiers.close()
        await kv_side.close()
        await server.stop(grace=None)
        raise
    holder.append(llm)
    llm.set_step_sink(metrics.observe_step)
    service.attach(llm)
    registrar = _registrar(config, model, address, service)
    beat = asyncio.create_task(registrar.run()) if registrar else None
    kv_index = start_kv_publisher(config.redis_url, model, config.worker_id, llm,
                                  config.redis_timeout_s, metrics.registry)
    zmq_events = None  # vLLM's KV events wire, beside the Redis index
    if config.kv_events is not None and config.kv_events.enabled:
        from worker.kv_events_zmq import ZmqKVEventPublisher

        zmq_events = ZmqKVEventPublisher(config.kv_events, engine_config.cache.block_size)
        zmq_events.start()
        llm.add_kv_event_sink(zmq_events.on_engine_events)
        if tiers is not None:  # host and disk stores / removals as CPU / DISK events
            tiers.add_listener(zmq_events.on_tier_events)
    strategies = None  # scheduling strategies, polled and applied live
    if config.redis_url:
        strategies = StrategyWatcher(config.redis_url, model, llm, config.redis_timeout_s)
        await strategies.first_read()  # the current version before the first request
        strategies.start()
    sparing = None  # tier eviction spares blocks no other node holds (index view)
    if kv_index is not None and tiers is not None:
        sparing = attach_index(tiers, kv_index)  # host/disk stores and evictions, resyncs
    freeze_startup_heap()  # before the first request: full collections skip start-up
    await health.set("readiness", SERVING)
    log.info("worker %s ready on %s", config.worker_id, address)
    await stop.wait()
    await _drain(config, service, health, llm)
    # Every step is bounded and logged (DEBUG): a dead peer or an unreachable Redis
    # must not keep the worker from stopping.
    redis_s = 2 * config.redis_timeout_s + 1.0
    if beat is not None:
        beat.cancel()
        await _step("registration heartbeat", beat, redis_s)
    if registrar is not None:
        await _step("registration removal", registrar.remove(), redis_s)
    if sparing is not None:
        await _step("tier sparing", sparing.close(), redis_s)
    if strategies is not None:
        await _step("strategy watcher", strategies.close(), redis_s)
    if kv_index is not None:
        await _step("kv index publisher", kv_index.close(), 2 * redis_s)
    service.stopping = True
    service.changed.set()
    await asyncio.sleep(0.1)  # let Load streams return before the server cancels them
    await _step("health shutdown", health.enter_graceful_shutdown(), 2.0)
    await _step("grpc server", server.stop(grace=1.0), 3.0)
    if http is not None:
        _sync_step("metrics http", http[0].shutdown)
    _sync_step("engine", lambda: llm.shutdown(timeout=5.0))
    if zmq_events is not None:
        _sync_step("kv events (zmq)", zmq_events.close)
    if tiers is not None:
        _sync_step("kv tiers", tiers.close)
    # Its transports bound their own waits (wire.cancel_all) and must get to release
    # the shared memory, so this one waits longer than they do.
    await _step("kv transfer", kv_side.close(), 3.0)
    log.info("worker %s stopped", config.worker_id)
    return 0


async def _step(what: str, aw: Awaitable[object], timeout_s: float) -> None:
    """Awaits one shutdown step for at most `timeout_s`; past it the step is cancelled
    and left behind (not awaited again: a step that ignores its cancellation must not
    block the stop either). Its errors are logged, never raised."""
    log.debug("stopping: %s", what)
    t0 = time.monotonic()
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        log.warning("stopping: %s did not finish within %.1fs; going on", what, timeout_s)
    elif not task.cancelled() and task.exception() is not None:
        log.warning("stopping: %s failed: %r", what, task.exception())
    else:
        log.debug("stopping: %s done in %.3fs", what, time.monotonic() - t0)


def _sync_step(what: str, fn: Callable[[], object]) -> None:
    log.debug("stopping: %s", what)
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # the rest of the stop still runs
        log.warning("stopping: %s failed: %r", what, e)
    else:
        log.debug("stopping: %s done in %.3fs", what, time.monotonic() - t0)


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
