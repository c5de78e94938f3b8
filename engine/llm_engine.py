"""The synchronous engine: add requests, call ``step()``, get deltas back.

One ``step()`` = schedule → one packed forward → sample → append tokens,
detokenize, check stop conditions → retire finished requests → publish events.
Not thread-safe by itself; ``engine.llm.LLM`` drives it from one thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import numpy as np
import paddle

from .config import EngineConfig
from .kv_cache_manager import KVCacheManager
from .loader import load_checkpoint
from .model_impl import build_model, resolve_model_impl
from .model_runner import ModelRunner, num_kv_blocks
from .outputs import StreamDelta
from .request import Request, RequestStatus
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .snapshot import EngineEvent, StepInfo, take_snapshot

logger = logging.getLogger("engine")


def resolve_device(device: str) -> str:
    has_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if device == "gpu" and not has_gpu:
        raise ValueError("device='gpu' needs Paddle compiled with CUDA and a visible GPU; use device='cpu' or 'auto'")
    return "gpu" if device == "gpu" or (device == "auto" and has_gpu) else "cpu"


def _available_bytes(device: str) -> int:
    if device == "gpu":
        return paddle.device.cuda.get_device_properties().total_memory
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        paddle.set_device(self.device)
        self.dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if self.device == "gpu" else "float32")
        checkpoint = load_checkpoint(config.model)
        self.model_impl = resolve_model_impl(config.model_impl, checkpoint.architecture)
        self.architecture = checkpoint.architecture
        self.model_name = config.model
        self.tokenizer = checkpoint.tokenizer
        model = build_model(self.model_impl, checkpoint, self.dtype, self.device, config.quantization)
        logger.info("model_impl=%s serves %s", self.model_impl, checkpoint.architecture)

        num_layers, num_kv_heads, head_dim = model.kv_layout()
        kv_bytes = config.kv_cache_bytes(_available_bytes(self.device))
        num_blocks = num_kv_blocks(kv_bytes, config.block_size, num_layers, num_kv_heads, head_dim, self.dtype)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} holds {num_blocks} blocks; need at least 2")
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.dtype)  # owns the KV tensors
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(lambda t: self.tokenizer.decode([t], skip_special_tokens=False))
        model_limit = checkpoint.config.get("max_position_embeddings") or num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or model_limit, model_limit, num_blocks * config.block_size)
        self.vocab_size = checkpoint.config["vocab_size"]

        self.requests: dict[str, Request] = {}
        self._rngs: dict[str, np.random.Generator] = {}
        self._detok: dict[str, object] = {}
        self._listeners: list = []
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self.step_count = 0
        self.last_step: StepInfo | None = None

    # -- requests -------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams; got {type(params).__name__}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt is empty; give at least one token")
        if not all(isinstance(t, (int, np.integer)) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size}); got out-of-range ids")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} (prompt + at least one "
                f"generated token must fit)"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        req = Request(request_id, [int(t) for t in ids], params, eos_token_ids=eos)
        self.requests[request_id] = req
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**63))
        self._rngs[request_id] = np.random.default_rng(seed)
        self._detok[request_id] = self.tokenizer.stream_decoder(params.skip_special_tokens)
        self.scheduler.add_request(req)
        self._emit("request_added", request_id=request_id, num_prompt_tokens=len(ids))
        return request_id

    def abort(self, request_id: str) -> StreamDelta | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()  # the step's one record; it advanced num_computed_tokens
        for req in batch.preempted:
            self._emit("request_preempted", request_id=req.request_id)
        cached = {s.request.request_id: s.num_computed_tokens for s in batch.scheduled}
        for req in batch.started:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.time()
            self._emit("request_started", request_id=req.request_id, num_cached_tokens=cached[req.request_id])
        if batch.is_empty:
            return []
        try:
            logits = self.runner.execute(batch)
        except Exception as exc:  # one bad batch must not take the engine down
            logger.exception("model step failed")
            return [self._finish(s.request, "error", error=f"{type(exc).__name__}: {exc}") for s in batch.scheduled]
        self._publish_block_events()

        for rid, (first, rows) in logits.prompt_rows.items():
            req = self.requests[rid]
            targets = req.prompt_token_ids[first + 1: first + 1 + len(rows)]
            if first == 0:
                req.prompt_logprobs = [None]
            req.prompt_logprobs.extend(self.sampler.prompt_logprobs(rows, targets, req.sampling_params.prompt_logprobs))

        reqs = [self.requests[rid] for rid in logits.sample_request_ids]
        tokens, lps = self.sampler(logits.sample_rows, [r.sampling_params for r in reqs],
                                   [self._rngs[r.request_id] for r in reqs])
        deltas = [self._append(req, tok, lp) for req, tok, lp in zip(reqs, tokens, lps)]
        self.step_count += 1
        self.last_step = StepInfo(
            step=self.step_count,
            batch_size=len(batch.scheduled),
            num_tokens=batch.num_tokens,
            prefill={s.request.request_id: s.num_new_tokens for s in batch.scheduled if not s.is_decode},
            decode=tuple(s.request.request_id for s in batch.scheduled if s.is_decode),
            duration_s=time.perf_counter() - t0,
        )
        self._emit("step", batch_size=self.last_step.batch_size, num_tokens=self.last_step.num_tokens,
                   prefill=dict(self.last_step.prefill), decode=list(self.last_step.decode),
                   duration_s=self.last_step.duration_s)
        return deltas

    def _append(self, req: Request, token: int, logprobs) -> StreamDelta:
        now = time.time()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.append_token(token, logprobs)
        piece = self._detok[req.request_id].step(token) or ""
        p = req.sampling_params
        text_before = len(req.output_text)
        req.output_text += piece
        reason = None
        if token in req.eos_token_ids or token in p.stop_token_ids:
            reason, req.stop_reason = "stop", token
        elif p.stop_strings:
            piece, stop = self._apply_stop_strings(req, text_before)
            if stop is not None:
                reason, req.stop_reason = "stop", stop
        if reason is None and (req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        delta = StreamDelta(
            request_id=req.request_id, text=piece, token_ids=[token],
            logprobs=[logprobs] if logprobs is not None else [],
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_token_ids=req.prompt_token_ids, metrics=req.metrics,
        )
        if reason is not None:
            final = self._finish(req, reason)
            delta.finished, delta.finish_reason = True, final.finish_reason
        return delta

    @staticmethod
    def _apply_stop_strings(req: Request, text_before: int) -> tuple[str, str | None]:
        """Cut the output at the earliest stop string that the new text completed."""
        stops = req.sampling_params.stop_strings
        start = max(0, text_before - max(map(len, stops)) + 1)
        found = [(at, stop) for stop in stops if (at := req.output_text.find(stop, start)) >= 0]
        if not found:
            return req.output_text[text_before:], None
        at, stop = min(found)
        req.output_text = req.output_text[:at]
        return req.output_text[text_before:], stop

    def fail_all(self, error: str) -> list[StreamDelta]:
        """Finish every live request with ``finish_reason="error"`` (blocks are released)."""
        return [self._finish(r, "error", error=error) for r in list(self.requests.values())]

    def _finish(self, req: Request, reason: str, error: str | None = None) -> StreamDelta:
        self.scheduler.finish(req, reason)
        req.metrics.finished_time = time.time()
        self.requests.pop(req.request_id, None)
        self._rngs.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        self._publish_block_events()
        self._emit("request_finished", request_id=req.request_id, finish_reason=reason,
                   num_output_tokens=req.num_output_tokens, error=error)
        return StreamDelta(
            request_id=req.request_id, text="", token_ids=[], finished=True, finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_token_ids=req.prompt_token_ids, metrics=req.metrics, error=error,
        )

    # -- observability ----------------------------------------------------------
    def snapshot(self):
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        return take_snapshot(step=self.step_count, model=self.model_name, model_impl=self.model_impl,
                             device=self.device, kv_cache_manager=self.kv_cache_manager, requests=live, last_step=self.last_step)

    def subscribe(self, callback):
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    def reset_prefix_cache(self) -> int:
        n = self.kv_cache_manager.reset_prefix_cache()
        self._publish_block_events()
        return n

    def _publish_block_events(self) -> None:
        events = self.kv_cache_manager.drain_events()
        if events.stored:
            self._emit("blocks_stored", block_ids=[b for b, _ in events.stored],
                       block_hashes=[h.hex() for _, h in events.stored])
        if events.removed:
            self._emit("blocks_removed", block_ids=list(events.removed))

    def _emit(self, kind: str, **data) -> None:
        if not self._listeners:
            return
        event = EngineEvent(kind, self.step_count, data)
        for callback in list(self._listeners):
            try:
                callback(event)
            except Exception:  # a broken view must not break serving
                logger.exception("event listener failed")
