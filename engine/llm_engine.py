"""The synchronous engine: add requests, call ``step()``, get deltas back.

One ``step()`` = schedule → one packed forward → sample → append tokens,
detokenize, check stop conditions → retire finished requests → publish events.
Not thread-safe by itself; ``engine.llm.LLM`` drives it from one thread.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import numbers
import os
import time
from collections.abc import Sequence

import numpy as np
import paddle

from .compile_progress import compile_progress
from .config import EngineConfig
from .device import resolve_attention_backend, resolve_device, warm_up
from .kv_cache_manager import KVCacheManager
from .loader import load_checkpoint
from .model_impl import build_model, resolve_model_impl
from .model_runner import ModelRunner, kv_block_bytes
from .outputs import StreamDelta
from .prefill_estimate import PrefillEstimate, PrefillRate, estimate_prefill
from .provenance import ProvenanceRecorder
from .request import Request
from .sampler import LogitsAdjust, Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .logs import undo_paddle_root_logging
from .snapshot import BlockInfos, EngineEvent, StepInfo, take_snapshot

undo_paddle_root_logging()  # Paddle's import (by the modules above or earlier) set up the root logger
logger = logging.getLogger("engine")


def _total_memory_bytes(device: str) -> int:
    """What a fractional ``kv_cache_memory`` is a fraction of: the GPU's total memory, or on CPU
    the machine's total physical RAM (``os.sysconf``; a container's memory limit is not consulted)."""
    if device == "gpu":
        return paddle.device.cuda.get_device_properties().total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.attention_backend, kernels_backend = resolve_attention_backend(config.attention_backend, self.device)
        paddle.set_device(self.device)
        self.dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if self.device == "gpu" else "float32")
        checkpoint = load_checkpoint(config.model)
        self.model_impl = resolve_model_impl(config.model_impl, checkpoint.architecture)
        self.architecture = checkpoint.architecture
        self.model_name = config.model
        self.tokenizer = checkpoint.tokenizer
        self.tensor_parallel = None
        if config.tensor_parallel_size > 1:  # this process is rank 0; the others start and load their shards
            from .parallel import TensorParallel

            self.tensor_parallel = TensorParallel.start(config, checkpoint, self.model_impl, self.dtype, self.device)
            model = self.tensor_parallel.model  # rank 0's shard: kv_layout() is a rank's share of the KV heads
        else:
            model = build_model(self.model_impl, checkpoint, self.dtype, self.device, config.quantization)
        logger.info("model_impl=%s serves %s", self.model_impl, checkpoint.architecture)

        num_layers, num_kv_heads, head_dim = model.kv_layout()
        per_block = kv_block_bytes(config.block_size, num_layers, num_kv_heads, head_dim, self.dtype)
        positions = checkpoint.config.get("max_position_embeddings")
        wanted_len = config.max_model_len
        if wanted_len and positions and wanted_len > positions:
            logger.warning("max_model_len=%d is more than the model's %d positions; serving %d", wanted_len,
                           positions, positions)
            wanted_len = positions
        need = -(-wanted_len // config.block_size) if wanted_len else 2
        weight_bytes = paddle.device.cuda.memory_allocated() if self.device == "gpu" else 0
        kv_bytes = config.kv_cache_bytes(self.device, _total_memory_bytes(self.device), weight_bytes,
                                         min_bytes=need * per_block)
        num_blocks = kv_bytes // per_block
        if num_blocks < need:
            if self.tensor_parallel is not None:
                self.tensor_parallel.close()
            what = (f"one sequence of max_model_len={wanted_len} tokens" if wanted_len else "the engine")
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory!r} gives {kv_bytes:,} bytes = {num_blocks} KV blocks of "
                f"{config.block_size} tokens ({per_block:,} bytes each); {what} needs {need} blocks: set "
                f"kv_cache_memory to at least {need * per_block:,} bytes" +
                (" or lower max_model_len" if config.max_model_len else ""))
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        rope = getattr(model, "rope", None)    # tables for the positions served, before the runner views them
        if hasattr(rope, "resize"):
            rope.resize(min(wanted_len or num_blocks * config.block_size, num_blocks * config.block_size))
        with compile_progress() as progress:    # the first run after an install compiles the kernels here
            if self.tensor_parallel is not None:  # every rank allocates its cache (same blocks), warms up together
                self.runner = self.tensor_parallel.make_runner(num_blocks, config.block_size, kernels_backend,
                                                               config.cpu_decode)
            else:
                progress.stage("runner")
                self.runner = ModelRunner(model, num_blocks, config.block_size, self.dtype,  # owns the KV tensors
                                          kernels_backend, config.cpu_decode, self.device)
                warm_up(self.runner, self.device, stage=progress.stage)  # a broken device/backend fails here
            progress.stage("sampler")
            self.sampler = Sampler(lambda t: self.tokenizer.decode([t], skip_special_tokens=False))
            self.sampler.warm_up()
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.kv_cache_ratio)
        model_limit = checkpoint.config.get("max_position_embeddings") or num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or model_limit, model_limit, num_blocks * config.block_size)
        self.vocab_size = checkpoint.config["vocab_size"]
        self.num_layers = num_layers
        self.num_heads = int(checkpoint.config.get("num_attention_heads") or 0)

        self.requests: dict[str, Request] = {}
        self._rngs: dict[str, np.random.Generator] = {}
        self._detok: dict[str, object] = {}
        self._sent: dict[str, int] = {}  # characters of output_text already handed out in deltas
        self._adjust: dict[str, LogitsAdjust] = {}  # only requests with penalties or min_tokens
        self._stops: dict[str, _StopMatcher] = {}   # only requests with stop strings
        self._lenses: dict[str, object] = {}         # lens requests -> their record (None: not yet)
        self._lens_kind: dict[str, str] = {}         # lens requests -> "attention" | "logits"
        self._events: list[EngineEvent] = []
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self.step_count = 0
        self.last_step: StepInfo | None = None
        self._block_infos = BlockInfos()   # snapshots share the BlockInfo of unchanged blocks
        self._provenance = ProvenanceRecorder(config.block_size)
        self.prefill_rate = PrefillRate()   # tokens/s of recent steps with prefill (estimate_prefill)

    # -- requests -------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    *, lens: str | None = None) -> str:
        """Validate everything first, then queue: a bad request raises and leaves no trace. ``lens``: when the
        prompt's last token is computed, record its ``"attention"`` (``engine.lens``) or the ``"logits"`` row
        it samples from (``engine.sampler_pipeline``); `take_lens` hands the record over."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams; got {type(params).__name__}")
        # Frozen and checked again here: a field changed after construction (in place, too) cannot
        # reach the engine unchecked, nor change a request once it is queued.
        params = dataclasses.replace(params)
        if isinstance(prompt_token_ids, (str, bytes)) or not (
                isinstance(prompt_token_ids, Sequence) or (isinstance(prompt_token_ids, np.ndarray)
                                                            and prompt_token_ids.ndim == 1)):
            raise ValueError("prompt_token_ids must be a list of token ids (an ordered sequence); got "
                             f"{type(prompt_token_ids).__name__}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt is empty; give at least one token")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size}); got {bad[0]!r}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} (prompt + at least one "
                f"generated token must fit)"
            )
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string or None; got {request_id!r}")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:      # automatic ids skip ids a caller chose
                request_id = f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if lens and self.tensor_parallel is not None:
            raise ValueError("the attention lens reads one process's KV cache; it is not available with "
                             f"tensor_parallel_size={self.config.tensor_parallel_size}")
        if lens and params.prompt_logprobs is not None:
            raise ValueError("an attention-lens request takes no prompt_logprobs (they would bypass the prefix cache)")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**63))
        rng = np.random.default_rng(seed)
        detok = self.tokenizer.stream_decoder(params.skip_special_tokens)
        eos = frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        req = Request(request_id, [int(t) for t in ids], params, eos_token_ids=eos)
        adjust = None
        if params.adjusts_logits:
            ending = set(eos) | set(params.stop_token_ids)
            if params.min_tokens and len({t for t in ending if t < self.vocab_size}) >= self.vocab_size:
                raise ValueError(f"min_tokens={params.min_tokens} with stop_token_ids and EOS covering every one "
                                 f"of the {self.vocab_size} token ids leaves no token to pick")
            adjust = LogitsAdjust(params, req.prompt_token_ids, req.output_token_ids, ending)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token has nothing before it (a 1-token prompt: all)
        self.requests[request_id] = req
        self._rngs[request_id], self._detok[request_id], self._sent[request_id] = rng, detok, 0
        if adjust is not None:
            self._adjust[request_id] = adjust
        if params.stop_strings:
            self._stops[request_id] = _StopMatcher(params.stop_strings)
        if lens:
            self._lenses[request_id] = None
            self._lens_kind[request_id] = lens
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
        """One scheduled forward pass. A failure in the model step fails that step's requests; a
        failure while sampling or post-processing one request fails that request only."""
        t0 = time.perf_counter()
        self.kv_cache_manager.log.step = self.step_count + 1
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
        self._provenance.record_step(self.step_count + 1, batch)
        try:
            watched = self._lenses.keys() & {s.request.request_id for s in batch.scheduled} if self._lenses else ()
            attention = {rid for rid in watched if self._lens_kind[rid] == "attention"}
            logits = self.runner.execute(batch, attention) if attention else self.runner.execute(batch)
            if watched and self.runner.last_probe is not None:
                self._keep_lens(batch, self.runner.last_probe)
        except Exception as exc:  # one bad batch must not take the engine down
            logger.exception("model step failed")
            # Blocks published to the prefix cache this step never got their K/V: withdraw them.
            stored = self.kv_cache_manager.drain_events().stored
            self._publish_block_events(stored)
            self.kv_cache_manager.uncache([block_id for block_id, _ in stored])
            error = f"model step failed: {type(exc).__name__}: {exc}"
            return [self._finish(s.request, "error", error=error) for s in batch.scheduled]
        self._publish_block_events()

        deltas = []
        for rid, (first, rows) in logits.prompt_rows.items():
            req = self.requests[rid]
            try:
                targets = req.prompt_token_ids[first + 1: first + 1 + len(rows)]
                if first == 0:
                    req.prompt_logprobs = [None]
                k = req.sampling_params.prompt_logprobs
                req.prompt_logprobs.extend(self.sampler.prompt_logprobs(rows, targets, k))
            except Exception as exc:
                deltas.append(self._fail(req, "computing prompt logprobs", exc))
        decodes = {s.request.request_id for s in batch.scheduled if s.is_decode}
        for rid, row in zip(logits.sample_request_ids, logits.sample_rows):
            if rid in watched and self._lens_kind[rid] == "logits":
                self._lenses[rid] = {"logits": np.array(row, np.float32)}
            req = self.requests.get(rid)
            if req is None:  # failed above
                continue
            try:
                token, lp = self.sampler.sample(row, req.sampling_params, self._rngs[rid], self._adjust.get(rid))
                ProvenanceRecorder.record_token(req, self.step_count + 1, len(batch.scheduled), rid in decodes)
                deltas.append(self._append(req, token, lp))
            except Exception as exc:
                deltas.append(self._fail(req, "sampling", exc))
        self.step_count += 1
        self.last_step = StepInfo(
            step=self.step_count,
            batch_size=len(batch.scheduled),
            num_tokens=batch.num_tokens,
            prefill={s.request.request_id: s.num_new_tokens for s in batch.scheduled if not s.is_decode},
            decode=tuple(s.request.request_id for s in batch.scheduled if s.is_decode),
            duration_s=time.perf_counter() - t0,
        )
        if self.last_step.prefill:
            self.prefill_rate.record(self.last_step.num_tokens, self.last_step.duration_s)
        self._emit("step", batch_size=self.last_step.batch_size, num_tokens=self.last_step.num_tokens,
                   prefill=dict(self.last_step.prefill), decode=list(self.last_step.decode),
                   duration_s=self.last_step.duration_s)
        return deltas

    def _keep_lens(self, batch, probe) -> None:
        for s in batch.scheduled:
            rid = s.request.request_id
            if rid in probe.rows:
                _, table, ctx = probe.rows[rid]
                bs = self.config.block_size
                self._lenses[rid] = {"weights": probe.result(rid), "windows": tuple(probe.windows),
                                     "block_ids": tuple(table[p // bs] for p in range(ctx)),
                                     "num_cached_tokens": max(s.request.num_cached_tokens, 0)}

    def take_lens(self, request_id: str) -> dict | None:
        """The attention recorded for a ``lens`` request (weights, windows, block ids, cached tokens); forgets it."""
        self._lens_kind.pop(request_id, None)
        return self._lenses.pop(request_id, None)

    def _fail(self, req: Request, what: str, exc: Exception) -> StreamDelta:
        logger.exception("request %s failed while %s", req.request_id, what)
        return self._finish(req, "error", error=f"{what} failed: {type(exc).__name__}: {exc}")

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
        early = req.num_output_tokens <= p.min_tokens  # as vLLM: no stop token (they are masked until
        matcher = self._stops.get(req.request_id)     # then) and no stop string completed before that
        if early:
            if matcher is not None:
                matcher.feed(req.output_text, text_before, report=False)
        elif token in req.eos_token_ids or token in p.stop_token_ids:
            reason, req.stop_reason = "stop", token
        elif matcher is not None:
            found = matcher.feed(req.output_text, text_before, by_end=p.include_stop_str_in_output)
            if found is not None:
                at, stop = found
                req.output_text = req.output_text[:at + len(stop) if p.include_stop_str_in_output else at]
                reason, req.stop_reason = "stop", stop
        if reason is None and (req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        # Text that could still grow into a stop string is held back until it cannot (unless the
        # stop string is to be kept in the output anyway).
        held = 0 if reason is not None or p.include_stop_str_in_output or matcher is None else matcher.held
        delta = StreamDelta(
            request_id=req.request_id, text=self._take_text(req, len(req.output_text) - held), token_ids=[token],
            logprobs=[logprobs] if logprobs is not None else [],
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_token_ids=req.prompt_token_ids, metrics=req.metrics,
        )
        if reason is not None:
            final = self._finish(req, reason)
            delta.finished, delta.finish_reason, delta.prompt_logprobs = True, final.finish_reason, final.prompt_logprobs
            delta.provenance = final.provenance
        return delta

    def _take_text(self, req: Request, end: int) -> str:
        """The output text not yet handed out, up to ``end``."""
        sent = self._sent.get(req.request_id, 0)
        end = max(end, sent)
        self._sent[req.request_id] = end
        return req.output_text[sent:end]

    def fail_all(self, error: str) -> list[StreamDelta]:
        """Finish every live request with ``finish_reason="error"`` (blocks are released)."""
        return [self._finish(r, "error", error=error) for r in list(self.requests.values())]

    def _finish(self, req: Request, reason: str, error: str | None = None) -> StreamDelta:
        self.scheduler.finish(req, reason)
        req.error = error
        req.metrics.finished_time = time.time()
        text = self._take_text(req, len(req.output_text))  # flush any held-back text
        self.requests.pop(req.request_id, None)
        self._rngs.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        self._sent.pop(req.request_id, None)
        self._adjust.pop(req.request_id, None)
        self._stops.pop(req.request_id, None)
        if req.request_id in self._lenses and self._lenses[req.request_id] is None:
            del self._lenses[req.request_id]   # ended before its attention was recorded
            self._lens_kind.pop(req.request_id, None)
        self._publish_block_events()
        self._emit("request_finished", request_id=req.request_id, finish_reason=reason,
                   num_output_tokens=req.num_output_tokens, error=error)
        return StreamDelta(
            request_id=req.request_id, text=text, token_ids=[], finished=True, finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_token_ids=req.prompt_token_ids, metrics=req.metrics, error=error,
            prompt_logprobs=list(req.prompt_logprobs) if req.sampling_params.prompt_logprobs is not None else None,
            provenance=req.provenance,
        )

    # -- observability ----------------------------------------------------------
    def snapshot(self):
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        return take_snapshot(step=self.step_count, model=self.model_name, model_impl=self.model_impl,
                             device=self.device, attention_backend=self.attention_backend,
                             kv_cache_manager=self.kv_cache_manager, requests=live, last_step=self.last_step,
                             decode_path=self.runner.decode_path, prefill_path=self.runner.prefill_path,
                             block_infos=self._block_infos,
                             tensor_parallel=self.runner.info() if self.tensor_parallel is not None else None)

    def estimate_prefill(self, token_ids) -> PrefillEstimate:
        """What prefilling ``token_ids`` would cost now (``engine.prefill_estimate``): nothing is allocated."""
        if isinstance(token_ids, (str, bytes)) or not (isinstance(token_ids, Sequence) or (
                isinstance(token_ids, np.ndarray) and token_ids.ndim == 1)):
            raise ValueError(f"token_ids must be a list of token ids; got {type(token_ids).__name__}")
        ids = list(token_ids)
        if not ids:
            raise ValueError("token_ids is empty; give at least one token")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token_ids must be integers in [0, {self.vocab_size}); got {bad[0]!r}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{len(ids)} tokens; max_model_len is {self.max_model_len} (a prompt must leave room "
                             "for one generated token)")
        return estimate_prefill(self.kv_cache_manager, [int(t) for t in ids], self.prefill_rate,
                                self.config.max_num_batched_tokens)

    def kv_events(self, since: int = 0) -> dict:
        """The KV event log after ``since`` (``engine.kv_events``) and the engine's counters."""
        out = self.kv_cache_manager.log.since(since)
        out["counters"] = {"preemptions": self.scheduler.num_preemptions,
                           "evictions": self.kv_cache_manager.pool.num_evictions,
                           "num_blocks": self.kv_cache_manager.num_blocks,
                           "block_size": self.kv_cache_manager.block_size, "step": self.step_count}
        return out

    def drain_events(self) -> list[EngineEvent]:
        """Events since the last drain, in order. The engine never calls listeners itself:
        ``engine.llm.LLM`` delivers them after releasing its lock."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> int:
        n = self.kv_cache_manager.reset_prefix_cache()
        self._publish_block_events()
        return n

    def _publish_block_events(self, stored=()) -> None:
        events = self.kv_cache_manager.drain_events()
        stored = list(stored) + events.stored
        if stored:
            self._emit("blocks_stored", block_ids=[b for b, _ in stored], block_hashes=[h.hex() for _, h in stored])
        if events.removed:
            self._emit("blocks_removed", block_ids=list(events.removed))

    def _emit(self, kind: str, **data) -> None:
        self._events.append(EngineEvent(kind, self.step_count, data))


class _StopMatcher:
    """One request's stop strings, matched as its text grows at a cost of O(new text) per step.

    One Knuth-Morris-Pratt automaton per stop string: its state is the length of the longest
    prefix of that stop string the text ends with, so a step reads only its new characters (a
    stop string whose first character is not among them and whose state is 0 is skipped in C), and
    the text to hold back (the longest end of the text that could still grow into a stop string)
    is the largest state. The old rescans cost (text length)^2 per stop string per token."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.tables = [_failure(s) for s in stops]
        self.states = [0] * len(stops)

    @property
    def held(self) -> int:
        return max(self.states)

    def feed(self, text: str, start: int, report: bool = True, by_end: bool = False) -> tuple[int, str] | None:
        """Read ``text[start:]``. With ``report``: of the stop strings completed in it, the one
        that starts first (then ends first) as ``(index in text, stop string)``, so the text cut
        before it holds no stop string; ``by_end``: the one that ends first (then starts first), so
        the text cut after it holds none but at its end. Else None."""
        new = text[start:]
        best = None
        for i, stop in enumerate(self.stops):
            k = self.states[i]
            if not k and stop[0] not in new:
                continue
            fail, n = self.tables[i], len(stop)
            for j in range(start, len(text)):
                c = text[j]
                while k and stop[k] != c:
                    k = fail[k - 1]
                if stop[k] == c:
                    k += 1
                if k == n:
                    if report:
                        found = (j, j + 1 - n) if by_end else (j + 1 - n, j)
                        best = found + (stop,) if best is None or found < best[:2] else best
                        break
                    k = fail[k - 1]
            self.states[i] = k
        if best is None:
            return None
        return (best[1] if by_end else best[0]), best[2]


@functools.lru_cache(maxsize=512)
def _failure(stop: str) -> tuple[int, ...]:
    """KMP's failure function: for each prefix of ``stop``, the length of its longest proper border."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)
