"""The engine loop: add requests, step (schedule -> forward -> sample -> stop checks),
collect outputs. Synchronous and single-threaded; AsyncLLM drives it from a thread.
With async scheduling (engine/async_step.py) each step launches the next forward before
it reads the previous one's tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.async_step import AsyncSteps
from engine.block_hash import BlockHash, make_extra_key
from engine.config import EngineConfig, ModelConfig, stop_eos_ids
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.model_runner import ModelRunner
from engine.offload import KVOffload, OffloadConnector, RankGatheredOffload
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.pins import Pins
from engine.request import Request, RequestStatus
from engine.sampler import Logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from engine.strategies import StrategySet
from engine.structured import StructuredOutputs
from engine.tokenizer import Tokenizer, bad_word_ids

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine will not run; the message says why (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class RemoteAlloc:
    """Where a remote prefill must write: the request's blocks, of which the first
    `num_computed_tokens // block_size` already hold a local prefix hit."""

    request_id: str
    block_ids: list[int]
    num_computed_tokens: int
    block_size: int
    block_hashes: tuple[BlockHash, ...] = ()  # the prompt's full blocks (peer fetch)
    num_prompt_tokens: int = 0

    @property
    def missing_block_ids(self) -> list[int]:
        return self.block_ids[self.num_computed_tokens // self.block_size:]


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_cache: torch.Tensor | None = None,
                 offload: KVOffload | None = None) -> None:
        """`offload`: external KV tiers (e.g. kvtransfer.tiers.TieredCache); the caller
        owns it and closes it after the engine is done."""
        self.config = config
        self.model_config = ModelConfig.from_model_dir(config.model_dir)
        self.model_id = config.model_id or config.model_dir
        self.tokenizer = Tokenizer(config.model_dir)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.runner = ModelRunner(config, self.model_config, kv_cache)
        self.block_size = config.cache.block_size
        self.kv = KVCacheManager(self.runner.num_blocks, self.block_size,
                                 config.cache.enable_prefix_caching)
        self.offload: OffloadConnector | None = None
        if offload is not None and config.cache.enable_prefix_caching:
            if self.runner.tp is not None:  # the tiers hold full-head blocks
                offload = self._rank_offload(offload)
            self.offload = OffloadConnector(offload, self.block_size)
            self.kv.pool.track_new_cached = True
        self.scheduler = Scheduler(config.scheduler, self.kv, self.offload)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.kv.block_ids)
        self.pins = Pins(self.kv.pool)  # blocks peers fetch from here (pin_cached)
        # Every id that ends generation as EOS, the tokenizer's first (engine/config.py
        # stop_eos_ids); a request ignoring EOS still has them held back by min_tokens.
        self.eos_token_ids = stop_eos_ids(config.model_dir, self.model_config.eos_token_ids,
                                          self.tokenizer.eos_token_id)
        self.last_step_tokens = 0
        # A completed grammar ends on the tokenizer's EOS alone, as vLLM's xgrammar backend
        # (TokenizerInfo.from_huggingface); the model's list without one.
        tok_eos = self.tokenizer.eos_token_id
        self.structured = StructuredOutputs(
            config.model_dir, self.model_config.vocab_size,
            self.model_config.eos_token_ids if tok_eos is None else (tok_eos,))
        self.async_steps = AsyncSteps(self) if config.schedules_async else None

    def _rank_offload(self, offload: KVOffload) -> KVOffload:
        """The tiers' view of a tensor-parallel pool: every rank's cache directly where
        rank 0 maps them (CPU), else through rank 0's staging copy (CUDA)."""
        runner = self.runner
        if runner.rank_caches is None:
            return RankGatheredOffload(offload, runner)
        from engine.models.parallel_layers import kv_head_range
        from engine.offload import RankView, RankViewOffload

        assert runner.tp is not None
        heads = [kv_head_range(self.model_config, r, runner.tp.size)
                 for r in range(runner.tp.size)]
        return RankViewOffload(offload, RankView(runner.rank_caches, heads))

    # -- requests -----------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 resume_token_ids: Sequence[int] = ()) -> None:
        """Raises RequestError if the request cannot run on this engine. Sets
        `params.bad_words_token_ids` unless set for these words and this vocabulary, so
        a request's bad words are tokenized once however often it is validated."""
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError(f"prompt holds token ids outside [0, {vocab})")
        if any(not 0 <= t < vocab for t in resume_token_ids):
            raise RequestError(f"resume_token_ids holds token ids outside [0, {vocab})")
        if len(resume_token_ids) >= params.max_tokens:
            raise RequestError(f"{len(resume_token_ids)} resumed tokens leave nothing to "
                               f"generate under max_tokens={params.max_tokens}")
        try:
            params.validate(vocab)
            key = (tuple(params.bad_words), vocab)
            if params.bad_words_key != key:
                params.bad_words_token_ids = bad_word_ids(self.tokenizer, params.bad_words,
                                                          vocab)
                params.bad_words_key = key
            if params.structured is not None:  # compiled (and cached) before any work
                self.structured.compile(params.structured)
        except ValueError as e:
            raise RequestError(str(e)) from e
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {total} ({len(prompt_token_ids)} prompt + "
                f"{params.max_tokens} max_tokens)")
        if cdiv(total, self.block_size) > self.runner.num_blocks:
            raise RequestError(f"the request needs {cdiv(total, self.block_size)} KV blocks; "
                               f"this engine has {self.runner.num_blocks}")

    def _new_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, cache_salt: str | None, priority: int,
                     hold_kv: bool = False, resume_token_ids: Sequence[int] = (),
                     tenant: str = "", labels: Mapping[str, str] | None = None,
                     client_id: str = "") -> Request:
        if request_id in self.scheduler.requests or request_id in self.scheduler.held:
            raise RequestError(f"request id {request_id!r} is already running")
        self.validate(prompt_token_ids, params, resume_token_ids)
        req = Request(request_id, list(prompt_token_ids), params,
                      extra_key=make_extra_key(self.model_id, cache_salt),
                      eos_token_ids=self.eos_token_ids,
                      bad_words_token_ids=params.bad_words_token_ids or [],
                      priority=priority, hold_kv=hold_kv, tenant=tenant,
                      labels=dict(labels or {}), client_id=client_id)
        if params.structured is not None:
            req.grammar = self.structured.new_state(params.structured)
        for tok in resume_token_ids:  # outputs with no KV yet: computed like a preemption's
            req.append_token(tok)
        return req

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, cache_salt: str | None = None,
                    priority: int = 0, hold_kv: bool = False,
                    resume_token_ids: Sequence[int] = (), tenant: str = "",
                    labels: Mapping[str, str] | None = None, client_id: str = "") -> Request:
        """Queues a request. With `hold_kv` (a prefill producer) its blocks outlive it
        until `release`, and every step reports its KV progress.

        `resume_token_ids` (fail-over): output tokens another worker already streamed.
        The request continues after them as if it had produced them itself: they count
        toward max_tokens, positions (and so seeded sampling, engine/sampler.py) and
        penalties continue, stop strings see their text, and outputs neither repeat
        them nor their text. Their KV is computed here (prefix hits apply)."""
        req = self._new_request(request_id, prompt_token_ids, params, cache_salt, priority,
                                hold_kv, resume_token_ids, tenant, labels, client_id)
        self.outputs.add(req)
        self.scheduler.add_request(req)
        return req

    def _fork(self, parent: Request, firsts: Sequence[tuple[int, Logprobs | None]],
              ) -> list[RequestOutput]:
        """Starts the samples waiting on `parent`'s prompt KV, each with its first token
        (`firsts`, in fork order); returns their outputs."""
        forks, parent.forks = parent.forks, []
        outs, copies = [], []
        for child, (tok, lp) in zip(forks, firsts, strict=True):
            child.prompt_logprobs = parent.prompt_logprobs
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_token_time = parent.first_token_time
            child.append_token(tok, lp)
            status = self.outputs.check(child)
            if status is not None:  # done already: its KV is never needed
                child.status = status
                outs += self.outputs.emit(child, final=True)
                continue
            copy = self.scheduler.fork(parent, child)
            if copy is not None:
                copies.append(copy)
            outs += self.outputs.emit(child, final=False)
        self.runner.copy_blocks(copies)
        return outs

    # -- remote prefill (decode side) -------------------------------------------------
    def add_remote_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, cache_salt: str | None = None,
                           priority: int = 0, resume_token_ids: Sequence[int] = (),
                           tenant: str = "", labels: Mapping[str, str] | None = None,
                           client_id: str = "") -> RemoteAlloc | None:
        """Allocates blocks for the whole prompt and parks the request until its KV
        arrives from a prefill node (then call `finish_remote`). Returns where the KV
        must land, or None when the blocks are not free now (nothing was queued).
        With `resume_token_ids` (add_request) the "prompt" whose KV arrives is the
        prompt plus those tokens: only a peer's cached blocks (FetchKV) can fill it."""
        req = self._new_request(request_id, prompt_token_ids, params, cache_salt, priority,
                                resume_token_ids=resume_token_ids, tenant=tenant,
                                labels=labels, client_id=client_id)
        if self.async_steps is not None:
            self.async_steps.wait()  # its blocks may be ones the step in flight writes
        if not self.scheduler.allocate_remote(req):
            return None
        self._run_loads(None)
        self.outputs.add(req)
        return RemoteAlloc(request_id, self.kv.block_ids(request_id),
                           req.num_computed_tokens, self.block_size,
                           tuple(req.update_block_hashes(self.block_size)),
                           req.num_tokens)

    def finish_remote(self, request_id: str, first_token: int | None,
                      num_computed_tokens: int | None = None,
                      samples: Sequence[tuple[int, Logprobs | None]] = (),
                      prompt_logprobs: list[Logprobs] | None = None) -> list[RequestOutput]:
        """The remote prefill is over: with `first_token` the prompt's KV is in place;
        with None it is computed locally from `num_computed_tokens` (KV that arrived
        from a peer, block aligned; default: the local hit). Returns outputs to deliver
        (the first token's, final if that token already ends the request).

        `samples`: the remote sampler's first token of every sample (n / best_of; the
        first is `first_token`) with their logprobs; `prompt_logprobs`, if asked for.
        Samples it did not draw prefill here (prefix-cache hits apply)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return []  # aborted meanwhile
        lp = samples[0][1] if samples and samples[0][0] == first_token else None
        self.scheduler.remote_kv_ready(req, first_token, num_computed_tokens, lp)
        if first_token is None:
            return []
        if prompt_logprobs is not None:
            req.prompt_logprobs = prompt_logprobs
        req.first_token_time = time.monotonic()
        outs = []
        if req.forks:
            drawn = list(samples[1:1 + len(req.forks)])
            for child in req.forks[len(drawn):]:  # not drawn remotely: computed here
                req.forks.remove(child)
                self.scheduler.add_request(child)
            outs += self._fork(req, drawn)
        got, ended = self.outputs.take_tokens([req])
        for r, status in ended:
            self._finish(r.request_id, status)
        return outs + got

    def set_strategies(self, strategies: StrategySet) -> None:
        """Scheduling strategies for every request, from the next step on."""
        self.scheduler.set_strategies(strategies)

    def release(self, request_id: str) -> bool:
        """Frees the blocks a finished producer held for sending."""
        return self.scheduler.release(request_id)

    # -- peer fetch (holder side) -------------------------------------------------------
    def pin_cached(self, hashes: list[BlockHash]) -> list[int]:
        """Block ids holding the leading run of `hashes` here, pinned until `unpin`
        (engine/pins.py: device prefix-cache hits, then the offload tiers')."""
        store = self.offload.offload if self.offload is not None else None
        if store is not None and self.async_steps is not None:
            self.async_steps.wait()  # tier hits load into free blocks
        return [b.block_id for b in self.pins.pin(hashes, store, self.runner.kv_cache)]

    def unpin(self, block_ids: list[int]) -> None:
        """Drops the references `pin_cached` took."""
        self.pins.unpin([self.kv.pool.blocks[i] for i in block_ids])

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Ends the request (as "error" when `error` is given) and frees its blocks;
        returns its final output, or None if the request is unknown or finished."""
        status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED
        group = self.outputs.groups.get(request_id)
        if group is not None and request_id == group.request_id:
            outs: list[RequestOutput] = []
            for m in group.members:  # every sample still live, started or not
                if m.request_id not in self.outputs.groups:
                    continue
                if self._finish(m.request_id, status) is None:
                    m.status = status  # a fork not started yet
                outs += self.outputs.emit(m, final=True)
            if not outs:
                return None
            outs[-1].error = error
            return outs[-1]
        req = self._finish(request_id, status)
        if req is None:
            return None
        out = self.outputs.finish(req)
        out.error = error
        return out

    def _finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends the request in the scheduler and frees its persistent-batch slot (a
        held producer's too: it is never scheduled again; its blocks stay the
        scheduler's until `release`). None if the scheduler does not know it."""
        req = self.scheduler.finish(request_id, status)
        self.runner.batch.remove(request_id)
        return req

    def has_work(self) -> bool:
        """Requests to run, or device blocks held until their offload copy is done."""
        return self.scheduler.has_work() or bool(self.offload and self.offload.saving) \
            or bool(self.async_steps and self.async_steps.in_flight)

    # -- the loop -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.async_steps is not None:
            return self.async_steps.step()
        if self.offload is not None:
            self.offload.save_new(self.kv.pool, self.runner.kv_cache)
            self.offload.reap(self.kv.pool)
        out = self.scheduler.schedule()
        self.last_step_tokens = out.num_tokens  # prompt + output tokens this step computes
        if not out.scheduled:
            if self.offload is not None:  # idle but copies pending: wait, don't spin
                self.offload.reap(self.kv.pool, timeout=0.01)
            return []
        self._run_loads(out)
        sampled = self.runner.execute(out, self.kv)
        kv_ready = self.runner.record_kv_ready() if self.runner.step_holds_kv else None
        got_token = self.scheduler.update_from_output(out, sampled)
        return self._step_outputs(out, sampled, got_token, kv_ready,
                                  self.runner.step_holds_kv)

    def _step_outputs(self, out: SchedulerOutput,
                      sampled: Mapping[str, tuple[int, Logprobs | None]],
                      got_token: list[Request], kv_ready: torch.cuda.Event | None,
                      producers: bool) -> list[RequestOutput]:
        """A step's outputs, once its tokens were appended (`got_token`): forks start,
        stops end requests, producers report KV progress (`producers`: the step may
        have some)."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        for req in got_token:
            if req.first_token_time is None:
                req.first_token_time = now
            if req.forks:  # before its own stop check: they fork off its blocks
                outputs += self._fork(req, [sampled[c.request_id] for c in req.forks])
        got, ended = self.outputs.take_tokens(got_token)
        outputs += got
        for req, status in ended:
            self._finish(req.request_id, status)
        for s in out.scheduled if producers else ():  # their KV progress, chunks too
            if s.request.hold_kv and s.request not in got_token:
                outputs += self.outputs.emit(s.request, final=False)
        if kv_ready is not None:
            for o in outputs:
                if o.block_ids is not None:  # a producer: its KV is final at this event
                    o.kv_ready = kv_ready
        if self.offload is not None:  # copy newly cached blocks out, off this thread
            self.offload.save_new(self.kv.pool, self.runner.kv_cache)
        return outputs

    def _run_loads(self, out: SchedulerOutput | None) -> None:
        """Fills blocks planned from the external tiers; what did not land is computed
        (this step's `out`) or left to the remote prefill (out None)."""
        if self.offload is None:
            return
        for ld, got in self.offload.run_loads(self.runner.kv_cache):
            lost = (len(ld.block_ids) - got) * self.block_size
            log.warning("request %s: %d blocks failed to load from the offload tiers",
                        ld.request.request_id, len(ld.block_ids) - got)
            if out is not None:
                self.scheduler.load_failed(out, ld.request, lost)
            else:
                ld.request.num_computed_tokens -= lost
                ld.request.num_cached_tokens = ld.request.num_computed_tokens

    def close(self) -> None:
        """Stops the tensor-parallel ranks, if any (also done when the engine is
        collected, and at exit)."""
        self.runner.close()

    # -- introspection ------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def check_integrity(self) -> None:
        held = dict(self.pins.counts)
        for b in (self.offload.saving if self.offload is not None else {}):
            held[b] = held.get(b, 0) + 1
        self.kv.check_integrity(held)
        self.runner.batch.check_integrity(self.kv)
