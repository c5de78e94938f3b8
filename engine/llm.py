"""``LLM``: the offline API (``generate``, ``chat``) plus thread-safe token streaming.

One background thread drives the engine while any request is unfinished and
exits when the engine is idle (so an idle ``LLM`` holds no thread). Every
caller — a batch ``generate``, many concurrent ``stream``s from a web server —
submits requests to the same engine and gets its own tokens back through a
queue; concurrent requests are batched together by the scheduler.

The engine lock is held only while the engine works (a step, an add, an
abort, a snapshot). Everything the engine produced under it — events for
``subscribe`` callbacks and deltas for waiting callers — goes into one ordered
outbox that is delivered after the lock is released, so a callback may call
``abort``/``snapshot`` (an abort takes effect between steps), and a step's
events reach callbacks before its tokens reach callers. A callback must not
wait for generation (``generate``/``chat``/``stream``): that raises
``RuntimeError``. If the engine thread ever dies (even on ``SystemExit``),
every waiting caller gets ``EngineDeadError`` and so does every later call;
make a new ``LLM``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from typing import Iterator

from tqdm.auto import tqdm

from .config import EngineConfig
from .lens import AttentionLens, check_lens_request
from .delivery import FairLock, Outbox
from .llm_engine import LLMEngine
from .outputs import RequestOutput, StreamDelta
from .sampling_params import SamplingParams

logger = logging.getLogger("engine")
_LENS_IDS = itertools.count()


class EngineDeadError(RuntimeError):
    """The engine thread stopped; this ``LLM`` cannot serve any more requests."""


class _Died:
    """Queue marker: the engine thread stopped before this request finished."""

    def __init__(self, reason: str):
        self.reason = reason

    def error(self) -> EngineDeadError:
        return EngineDeadError(f"{self.reason}; the request was not finished")


class _Sink:
    """Stands where a request's queue would (``LLM.submit``): hands each delta to a callback. Its
    first failure (any ``BaseException``: the callback is user code) is logged with the traceback,
    later ones at debug level (as for listeners); it never reaches the thread delivering."""

    def __init__(self, on_delta):
        self.on_delta = on_delta
        self._failed = False

    def put(self, item) -> None:
        try:
            self.on_delta(item.error() if isinstance(item, _Died) else item)
        except BaseException:  # noqa: BLE001  (a failing receiver -- KeyboardInterrupt, SystemExit
            # included -- must not stop the engine thread: its failure stays with its request)
            if self._failed:
                logger.debug("on_delta callback %r failed again", self.on_delta, exc_info=True)
            else:
                self._failed = True
                logger.exception("on_delta callback %r failed (its later failures are logged at debug "
                                 "level)", self.on_delta)


class LLM:
    """``LLM(model=..., model_impl=..., dtype=..., block_size=..., kv_cache_memory=...,
    enable_prefix_caching=..., max_num_seqs=..., max_num_batched_tokens=..., max_model_len=..., device=...,
    quantization=..., attention_backend=..., seed=...)``; see ``EngineConfig``."""

    def __init__(self, model: str | None = None, **engine_args):
        if model is not None:
            engine_args["model"] = model
        unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {sorted(unknown)}; accepted: "
                             f"{', '.join(EngineConfig.__dataclass_fields__)}")
        self.config = EngineConfig(**engine_args)
        self.engine = LLMEngine(self.config)
        self._lock = FairLock()
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._thread: threading.Thread | None = None
        self._dead: str | None = None              # why the engine thread stopped, once it has
        self._outbox = Outbox()                    # events and deltas, delivered outside the lock
        self._pause_owner: int | None = None       # the thread inside ``with paused()``, if any
        # Stop the engine thread before interpreter shutdown freezes it mid-step.
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    # -- properties ---------------------------------------------------------------
    @property
    def model_impl(self) -> str:
        return self.engine.model_impl

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        """The longest sequence served (prompt + output): the setting, bounded by the model and the cache."""
        return self.engine.max_model_len

    def get_tokenizer(self):
        return self.engine.tokenizer

    def __repr__(self) -> str:
        snap = self.snapshot()
        return (f"LLM(model={snap.model!r}, model_impl={snap.model_impl!r}, device={snap.device!r}, "
                f"{snap.num_blocks} KV blocks x {snap.block_size} tokens)")

    def _repr_html_(self) -> str:
        """Model, backend and KV cache at a glance (Jupyter's rich display)."""
        from playground.reprs import llm_html

        return llm_html(self.snapshot().to_dict(), max_model_len=self.max_model_len)

    # -- offline API ----------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Text prompts, ``{"prompt_token_ids": [...]}`` or ``{"prompt": str}``; one or a list."""
        self._check_can_wait("generate")
        if not isinstance(prompts, (list, tuple)):
            prompts = [prompts]
        return self._run_batch([self._encode(p) for p in prompts], sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}``) or a list of them."""
        self._check_can_wait("chat")
        return self._run_batch([self._encode(c) for c in _conversations(messages)], sampling_params, use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """Yield ``StreamDelta``s as tokens arrive; closing the generator early aborts the request.

        The request is checked and submitted when iteration starts."""
        self._check_can_wait("stream")
        text, ids = self._encode(prompt)
        rid, q, _ = self._submit(ids, sampling_params or SamplingParams(), request_id)
        finished = False
        try:
            while not finished:
                delta = self._next(q)
                finished = delta.finished
                yield delta
        finally:
            if not finished and self._dead is None:
                self.abort(rid)

    def submit(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None, *,
               on_delta) -> str:
        """Submit one request whose deltas go to ``on_delta`` instead of a stream; returns its id.

        ``on_delta(delta)`` is called for each ``StreamDelta`` in order, the last one ``finished``,
        outside the engine lock on the thread delivering the step (usually the engine's), so it
        must be quick and must not wait for generation; if the engine thread dies first it gets
        an ``EngineDeadError`` instead. For a server that forwards tokens without a thread per
        request (``LLMProcess``'s engine process). Bad requests raise here, as in ``stream``."""
        if not callable(on_delta):
            raise ValueError(f"on_delta must be callable; got {type(on_delta).__name__}")
        self._check_alive()
        _, ids = self._encode(prompt)
        rid, _, _ = self._submit_all([(ids, sampling_params or SamplingParams(), request_id)], sink=_Sink(on_delta))[0]
        return rid

    def abort(self, request_id: str) -> bool:
        """Finish a request with ``finish_reason="abort"`` (between steps). False if it is not live."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string; got {_describe(request_id)}")
        with self._lock:
            delta = self.engine.abort(request_id)
            if delta is not None:
                self._post([delta])
        self._deliver()
        return delta is not None

    def shutdown(self) -> None:
        """Abort every unfinished request and wait for the engine thread to exit; with tensor parallelism,
        stop the other ranks too (their ports are released; this LLM serves no more steps)."""
        with self._lock:
            deltas = [self.engine.abort(rid) for rid in list(self.engine.requests)]
            self._post([d for d in deltas if d is not None])
            thread = self._thread
        self._deliver()
        if thread is not None and thread is not threading.current_thread() and not self._outbox.delivering:
            thread.join()
        if getattr(self.engine, "tensor_parallel", None) is not None:
            self.engine.tensor_parallel.close()

    # -- observability ---------------------------------------------------------------
    def attention_lens(self, token_ids: list[int], position: int, layer: int | None = None,
                       head: int | None = None) -> AttentionLens:
        """Where the token at ``position`` attends: ``token_ids[:position + 1]`` runs as one request through
        the scheduler and the KV cache (the prefix cache serves the blocks it holds), and the softmax of
        that position's query over positions ``0..position`` is recorded on every layer and query head
        (``engine.lens``). ``layer`` / ``head`` pick what the lens shows (None: the mean)."""
        self._check_can_wait("attention_lens")
        engine = self.engine
        ids = check_lens_request(token_ids, position, layer, head, vocab_size=engine.vocab_size,
                                 max_model_len=engine.max_model_len, num_layers=engine.num_layers,
                                 num_heads=engine.num_heads)
        start = time.perf_counter()
        rid, record = self._record(ids[:position + 1], "attention")
        tok = engine.tokenizer
        return AttentionLens(token_ids=tuple(ids[:position + 1]), position=position, weights=record["weights"],
                             block_ids=record["block_ids"], block_size=engine.config.block_size,
                             num_cached_tokens=record["num_cached_tokens"], sliding_windows=record["windows"],
                             request_id=rid, tokens=tuple(tok.decode([t], skip_special_tokens=False)
                                                          for t in ids[:position + 1]),
                             layer=layer, head=head, seconds=time.perf_counter() - start)

    def sampler_pipeline(self, token_ids: list[int], position: int, sampling_params: SamplingParams,
                         num_prompt_tokens: int | None = None):
        """The sampler's stages for the token at ``position`` (``engine.sampler_pipeline``): the logits
        after ``token_ids[:position]`` (one request through the scheduler and the prefix cache), then
        penalties (the prompt is ``token_ids[:num_prompt_tokens]``, default ``position``; the rest the
        output so far), temperature, top-k, min-p, top-p under ``sampling_params``, and where
        ``token_ids[position]`` fell at each."""
        from .sampler import LogitsAdjust
        from .sampler_pipeline import pipeline

        self._check_can_wait("sampler_pipeline")
        engine = self.engine
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams; got {type(sampling_params).__name__}")
        ids = check_lens_request(token_ids, position, None, None, vocab_size=engine.vocab_size,
                                 max_model_len=engine.max_model_len, num_layers=1, num_heads=1)
        if position < 1:
            raise ValueError("position must be >= 1: the token at position 0 has no logits before it")
        prompt_len = position if num_prompt_tokens is None else num_prompt_tokens
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or not 1 <= prompt_len <= position:
            raise ValueError(f"num_prompt_tokens must be an integer in [1, {position}]; got {num_prompt_tokens!r}")
        _, record = self._record(ids[:position], "logits")
        adjust = None
        if sampling_params.adjusts_logits:
            eos = frozenset() if sampling_params.ignore_eos else engine.tokenizer.eos_token_ids
            adjust = LogitsAdjust(sampling_params, ids[:prompt_len], ids[prompt_len:position],
                                  set(eos) | set(sampling_params.stop_token_ids))
        pipe = pipeline(record["logits"], sampling_params, adjust, token=ids[position])
        tok = engine.tokenizer                  # the texts of the ids a view draws (SamplerPipeline.top)
        pipe.texts.update((t, tok.decode([t], skip_special_tokens=False)) for t in pipe.top())
        return pipe

    def _record(self, ids: list[int], kind: str):
        """Run ``ids`` as one greedy one-token request that records ``kind`` (``LLMEngine.add_request``'s
        ``lens``) when its last token is computed; returns its id and the record."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        rid, q, _ = self._submit_all([(ids, params, f"lens-{next(_LENS_IDS)}")], lens=kind)[0]
        try:
            while not (delta := self._next(q)).finished:
                pass
        finally:
            with self._lock:
                record = self.engine.take_lens(rid)
        if record is None:
            raise RuntimeError(f"the {kind} request ended ({delta.finish_reason}) before its {kind} were "
                               f"recorded{': ' + delta.error if delta.error else ''}")
        return rid, record

    def estimate_prefill(self, token_ids: list[int]):
        """What sending ``token_ids`` as a prompt would cost now, read from the prefix cache without
        touching it (``engine.prefill_estimate.PrefillEstimate``): tokens cached and to compute, blocks
        shared and new, the expected prefill time at the rate this engine measured."""
        with self._lock:
            return self.engine.estimate_prefill(token_ids)

    def kv_events(self, since: int = 0) -> dict:
        """The KV cache's events after seq ``since`` (allocate, free, evict, preempt, recompute, each with
        its cause: ``engine.kv_events``), ``next`` to ask for next, and the engine's counters."""
        with self._lock:
            return self.engine.kv_events(since)

    def snapshot(self):
        with self._lock:
            return self.engine.snapshot()

    def subscribe(self, callback):
        """Call ``callback(EngineEvent)`` for every engine event, in order, outside the engine lock
        (usually from the engine thread). Returns a function that unsubscribes it. A callback that
        raises an ``Exception`` is skipped and logged (traceback once); it may call ``abort``/``snapshot`` but not
        wait for generation."""
        if not callable(callback):
            raise ValueError(f"subscribe() needs a callable; got {type(callback).__name__}")
        with self._lock:
            self._outbox.listeners.append(callback)

        def unsubscribe():
            with self._lock:
                self._outbox.remove_listener(callback)

        return unsubscribe

    @contextlib.contextmanager
    def paused(self):
        """Hold the engine between two steps while the ``with`` body runs: steps, submissions, aborts
        and snapshots from other threads wait, so requests submitted meanwhile start in one step.
        On the thread that holds it, ``submit``/``abort``/``snapshot`` work, but waiting for tokens
        (``generate``/``chat``/``stream``) raises ``RuntimeError``: no step can run until the
        ``with`` block ends."""
        with self._lock:
            outer, self._pause_owner = self._pause_owner, threading.get_ident()
            try:
                yield
            finally:
                self._pause_owner = outer

    def reset_prefix_cache(self) -> int:
        with self._lock:
            n = self.engine.reset_prefix_cache()
            self._post([])
        self._deliver()
        return n

    # -- internals ---------------------------------------------------------------------
    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        tok = self.engine.tokenizer
        _check_text(prompt)
        if isinstance(prompt, str):
            return prompt, tok.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], tok.encode(prompt["prompt"], add_special_tokens=True)
        if _is_conversation(prompt):
            text = tok.apply_chat_template(prompt, add_generation_prompt=True)
            return text, tok.encode(text, add_special_tokens=False)
        raise ValueError("a prompt must be a string, {'prompt_token_ids': [...]}, {'prompt': str} or a list of "
                         f"chat messages {{'role': str, 'content': str}}; got {_describe(prompt)}")

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"{self._dead}; this LLM cannot serve requests any more, create a new one")

    def _check_can_wait(self, name: str) -> None:
        self._check_alive()
        self._check_not_paused_here(name)
        if self._outbox.delivering:
            raise RuntimeError(
                f"LLM.{name}() was called from a subscribe() callback: callbacks run between engine steps, so "
                "waiting there for tokens would deadlock. Hand the work to another thread; a callback may "
                "call abort() and snapshot().")

    def _check_not_paused_here(self, name: str) -> None:
        if self._pause_owner == threading.get_ident():
            raise RuntimeError(
                f"LLM.{name}() was called inside `with llm.paused():` on the same thread: the engine cannot "
                "step until that block ends, so waiting for tokens there would deadlock every caller. Wait "
                "after the block, or submit with submit(..., on_delta=...) / from another thread.")

    def _submit(self, ids: list[int], params: SamplingParams, request_id: str | None):
        return self._submit_all([(ids, params, request_id)])[0]

    def _submit_all(self, items, sink=None, lens: str | None = None):
        """Queue requests together (one batch lands in one step); if one is refused, none stays queued.
        Their deltas go to a queue each, or to ``sink``. ``lens``: what to record (``LLMEngine.add_request``)."""
        with self._lock:
            self._check_alive()
            added = []
            try:
                for ids, params, request_id in items:
                    added.append(self.engine.add_request(ids, params, request_id, lens=lens))
            except BaseException:
                for rid in added:
                    self.engine.abort(rid)
                self.engine.drain_events()
                raise
            out = []
            for rid in added:
                q = sink or queue.SimpleQueue()
                self._queues[rid] = q
                out.append((rid, q, self.engine.requests[rid]))
            self._post([])
            thread = None
            if self._thread is None:
                thread = self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        try:
            self._deliver()  # this submission's events first, on the caller's thread
        except BaseException:  # a callback raised here: nobody will wait for these requests
            with self._lock:
                self._post([d for d in (self.engine.abort(rid) for rid, *_ in out) if d is not None])
            raise
        finally:
            if thread is not None:
                thread.start()
        return out

    def _next(self, q: queue.SimpleQueue) -> StreamDelta:
        """The request's next delta; raises ``EngineDeadError`` instead of waiting on a dead engine."""
        idle = 0
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                self._check_not_paused_here("stream")  # a stream opened before the block, read inside it
                item = None
            try:
                item = item if item is not None else q.get(timeout=1.0)
            except queue.Empty:
                self._check_alive()
                thread = self._thread  # a live request always has an engine thread (maybe about to start)
                gone = thread is None or (thread.ident is not None and not thread.is_alive())
                idle = idle + 1 if gone else 0
                if idle >= 2:
                    raise EngineDeadError("the engine thread is gone and this request never finished")
                continue
            if isinstance(item, _Died):
                raise item.error()
            return item

    def _run_batch(self, encoded: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool):
        if isinstance(sampling_params, list) and len(sampling_params) != len(encoded):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(encoded)} prompts")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(encoded)
        bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise ValueError(f"sampling params must be a SamplingParams; got {type(bad).__name__}")
        submitted = self._submit_all([(ids, p, None) for (_, ids), p in zip(encoded, params)])
        try:
            outputs = []
            for (rid, q, req), (text, _) in tqdm(list(zip(submitted, encoded)), disable=not use_tqdm,
                                                 desc="requests"):
                while not self._next(q).finished:
                    pass
                outputs.append(RequestOutput.from_request(req, text))
        except BaseException:
            if self._dead is None:
                for rid, *_ in submitted:
                    self.abort(rid)
            raise
        return outputs

    def _post(self, deltas: list[StreamDelta]) -> None:
        """Under the lock: queue the engine's events and these deltas for delivery, in order."""
        self._outbox.put_events(self.engine.drain_events())
        for d in deltas:
            q = self._queues.pop(d.request_id, None) if d.finished else self._queues.get(d.request_id)
            if q is not None:
                self._outbox.put_delta(q, d)

    def _deliver(self) -> None:
        self._outbox.deliver()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self.engine.has_unfinished():
                        self._thread = None
                        self._post([])
                        break
                    try:
                        deltas = self.engine.step()
                    except Exception as exc:  # a bug outside the guarded parts of a step: fail its requests
                        logger.exception("engine step failed")
                        deltas = self.engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                    self._post(deltas)
                self._deliver()
            self._deliver()
        except BaseException as exc:  # noqa: BLE001  (SystemExit from a callback too: nobody may hang)
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """The engine thread is ending on an exception: fail every live request, wake every caller."""
        reason = f"the engine thread stopped: {type(exc).__name__}: {exc}"
        logger.error("%s", reason, exc_info=exc)
        with self._lock:
            self._dead = reason
            if self._thread is threading.current_thread():
                self._thread = None
            pending = self._outbox.take_deltas()  # callbacks are skipped: one of them may be the cause
            live = list(self._queues.values())
            self._queues.clear()
            try:
                self.engine.fail_all(reason)
                self.engine.drain_events()
            finally:
                for q, delta in pending:
                    q.put(delta)
                for q in live:
                    q.put(_Died(reason))


def _check_text(prompt) -> None:
    """A ValueError for text that cannot be encoded as UTF-8 (a lone surrogate, as ``json.loads`` of
    ``"\\udcff"`` makes), which the tokenizer would refuse with a bare ``TypeError``."""
    if isinstance(prompt, str):
        texts = [("prompt", prompt)]
    elif isinstance(prompt, dict):
        texts = [("prompt", prompt.get("prompt"))]
    elif isinstance(prompt, (list, tuple)):
        texts = [(f"message {i} {key}", m.get(key)) for i, m in enumerate(prompt) if isinstance(m, dict)
                 for key in ("role", "content")]
    else:
        return
    for what, text in texts:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"{what} is not valid Unicode text: {text[exc.start:exc.end]!r} at index "
                                 f"{exc.start} is a lone surrogate; send UTF-8 text") from None


def _is_conversation(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)


def _conversations(messages) -> list:
    """One conversation or a list of them; anything else is a ValueError."""
    if _is_conversation(messages):
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and messages and all(_is_conversation(c) for c in messages):
        return [list(c) for c in messages]
    raise ValueError("messages must be one conversation (a non-empty list of {'role': str, 'content': str} "
                     f"dicts) or a list of them; got {_describe(messages)}")


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _shutdown_if_alive(ref) -> None:
    llm = ref()
    if llm is not None:
        llm.shutdown()
