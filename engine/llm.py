"""``LLM``: the offline API (``generate``, ``chat``) plus thread-safe token streaming.

One background thread drives the engine while any request is unfinished and
exits when the engine is idle (so an idle ``LLM`` holds no thread). Every
caller — a batch ``generate``, many concurrent ``stream``s from a web server —
submits requests to the same engine and gets its own tokens back through a
queue; concurrent requests are batched together by the scheduler.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import weakref
from typing import Iterable, Iterator

from tqdm.auto import tqdm

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput, StreamDelta
from .sampling_params import SamplingParams

logger = logging.getLogger("engine")



class FairLock:
    """A re-entrant lock granted in arrival order.

    The engine thread re-takes the lock for every step; with a plain lock it
    would win every race and starve callers waiting to submit, abort or take
    a snapshot. Tickets make each waiter get its turn at the next step boundary.
    """

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._tickets = itertools.count()
        self._serving = 0
        self._owner: int | None = None
        self._depth = 0

    def __enter__(self):
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            ticket = next(self._tickets)
            while ticket != self._serving:
                self._cond.wait()
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc):
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._cond.notify_all()


class LLM:
    """``LLM(model=..., model_impl=..., dtype=..., block_size=..., kv_cache_memory=...,
    enable_prefix_caching=..., max_num_seqs=..., max_num_batched_tokens=..., max_model_len=..., device=...)``"""

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
        # Stop the engine thread before interpreter shutdown freezes it mid-step.
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    # -- properties ---------------------------------------------------------------
    @property
    def model_impl(self) -> str:
        return self.engine.model_impl

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- offline API ----------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Text prompts, ``{"prompt_token_ids": [...]}`` or ``{"prompt": str}``; one or a list."""
        if not isinstance(prompts, (list, tuple)):
            prompts = [prompts]
        return self._run_batch([self._encode(p) for p in prompts], sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}``) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run_batch([self._encode(c) for c in conversations], sampling_params, use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """Yield ``StreamDelta``s as tokens arrive; closing the generator early aborts the request."""
        text, ids = self._encode(prompt)
        rid, q = self._submit(ids, sampling_params or SamplingParams(), request_id)
        finished = False
        try:
            while not finished:
                delta = q.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            delta = self.engine.abort(request_id)
            if delta is None:
                return False
            q = self._queues.pop(request_id, None)
            if q is not None:
                q.put(delta)
            return True

    def shutdown(self) -> None:
        """Abort every unfinished request and wait for the engine thread to exit."""
        with self._lock:
            for rid in list(self.engine.requests):
                self.abort(rid)
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- observability ---------------------------------------------------------------
    def snapshot(self):
        with self._lock:
            return self.engine.snapshot()

    def subscribe(self, callback):
        """Call ``callback(EngineEvent)`` for every engine event (from the engine thread)."""
        with self._lock:
            return self.engine.subscribe(callback)

    def reset_prefix_cache(self) -> int:
        with self._lock:
            return self.engine.reset_prefix_cache()

    # -- internals ---------------------------------------------------------------------
    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        tok = self.engine.tokenizer
        if isinstance(prompt, str):
            return prompt, tok.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], tok.encode(prompt["prompt"], add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
            text = tok.apply_chat_template(prompt, add_generation_prompt=True)
            return text, tok.encode(text, add_special_tokens=False)
        raise ValueError("a prompt must be a string, {'prompt_token_ids': [...]}, {'prompt': str} or a list of "
                         f"chat messages {{'role', 'content'}}; got {type(prompt).__name__}")

    def _submit(self, ids: list[int], params: SamplingParams, request_id: str | None):
        with self._lock:
            rid = self.engine.add_request(ids, params, request_id)
            q: queue.SimpleQueue = queue.SimpleQueue()
            self._queues[rid] = q
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
                self._thread.start()
        return rid, q

    def _run_batch(self, encoded: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool):
        if isinstance(sampling_params, list) and len(sampling_params) != len(encoded):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(encoded)} prompts")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(encoded)
        submitted = []
        try:
            for (text, ids), p in zip(encoded, params):
                rid, q = self._submit(ids, p, None)
                submitted.append((rid, text, q, self.engine.requests[rid]))
        except Exception:
            for rid, *_ in submitted:
                self.abort(rid)
            raise
        outputs = []
        for rid, text, q, req in tqdm(submitted, disable=not use_tqdm, desc="requests"):
            while not q.get().finished:
                pass
            outputs.append(RequestOutput.from_request(req, text))
        return outputs

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self.engine.has_unfinished():
                    self._thread = None
                    return
                try:
                    deltas = self.engine.step()
                except Exception as exc:  # a bug in a step: fail its requests, keep serving
                    logger.exception("engine step failed")
                    deltas = self.engine.fail_all(f"{type(exc).__name__}: {exc}")
                for d in deltas:
                    q = self._queues.get(d.request_id)
                    if q is not None:
                        q.put(d)
                    if d.finished:
                        self._queues.pop(d.request_id, None)


def _shutdown_if_alive(ref) -> None:
    llm = ref()
    if llm is not None:
        llm.shutdown()
