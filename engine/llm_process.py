"""``LLMProcess``: an ``LLM`` in a process of its own, with the same surface.

A web app that runs the engine in its own process shares one interpreter lock
and the same cores between the engine loop and the server's work (HTTP,
Gradio's event handling, rendering): every time a server thread holds the
lock, the engine waits, and each of those waits stops a whole decode step.
vLLM splits its API server from the engine core for the same reason. Here the
child process holds the ``LLM``; the parent holds this client, which offers
``generate``, ``chat``, ``stream``, ``abort``, ``snapshot``, ``subscribe``,
``reset_prefix_cache``, ``get_tokenizer``, ``config``, ``model_name`` and
``model_impl`` with ``LLM``'s behaviour: closing a stream early aborts its
request, the engine's own exceptions (``ValueError`` for a bad request,
``EngineDeadError``) are raised here, events reach ``subscribe`` callbacks in
order and before the step's tokens reach their streams.

The two processes talk over one ``multiprocessing`` pipe (pickled tuples):
``(op, call_id, pickled arguments)`` from the client -- the arguments pickled
apart, so one the engine process cannot unpickle (an object of a class defined
in the caller's ``__main__``) fails that call with a ``ValueError`` and nothing
else; ``("result" | "error", call_id, value)``, ``("delta", call_id,
StreamDelta)``, ``("event", None, EngineEvent)``, ``("heartbeat", None, None)``
back. If the child dies, or sends nothing (not even its heartbeat, once a
second) for ``heartbeat_timeout`` seconds -- frozen (``SIGSTOP``) or stuck --
it is killed, every waiting caller gets ``EngineDeadError``, and so does every
later call. Blocks of a snapshot equal to the previous snapshot's keep
that snapshot's ``BlockInfo`` objects, as ``LLM.snapshot`` does, so views can
find the changed blocks by identity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .config import EngineConfig
from .llm import EngineDeadError, _Died
from .outputs import RequestOutput, StreamDelta
from .process_exit import exit_without_teardown
from .sampling_params import SamplingParams
from .snapshot import keep_unchanged_blocks

logger = logging.getLogger("engine")

_CALLS = ("generate", "chat", "abort", "snapshot", "reset_prefix_cache", "attention_lens",
          "sampler_pipeline", "estimate_prefill", "kv_events")   # run in the child, answer once
HEARTBEAT_INTERVAL = 1.0   # seconds between the engine process's signs of life


class LLMProcess:
    """``LLMProcess(model=..., **engine_args)``: ``LLM(**engine_args)`` started in a child process;
    returns once the model is loaded there (its load error, if any, is raised here). A child that
    sends nothing for ``heartbeat_timeout`` seconds once loaded is taken for dead and killed."""

    def __init__(self, model: str | None = None, *, start_timeout: float = 600.0, heartbeat_timeout: float = 30.0,
                 **engine_args):
        if isinstance(heartbeat_timeout, bool) or not isinstance(heartbeat_timeout, (int, float)) or not (
                2 * HEARTBEAT_INTERVAL <= heartbeat_timeout < float("inf")):
            raise ValueError(f"heartbeat_timeout must be a number of seconds >= {2 * HEARTBEAT_INTERVAL}; "
                             f"got {heartbeat_timeout!r}")
        self._heartbeat_timeout = float(heartbeat_timeout)
        if model is not None:
            engine_args["model"] = model
        spawn = mp.get_context("spawn")
        parent, child = spawn.Pipe()
        self._conn, self._send_lock = parent, threading.Lock()
        self._process = spawn.Process(target=_serve, args=(child, engine_args), name="engine-core", daemon=True)
        self._process.start()
        child.close()
        self._ids = itertools.count(1)
        self._waiting: dict[int, queue.SimpleQueue] = {}   # call id -> where its answers go
        self._listeners: list[Callable] = []
        self._streams: set[int] = set()                   # call ids of open streams
        self._events: queue.SimpleQueue = queue.SimpleQueue()   # events and stream messages, in order
        self._dead: str | None = None
        self._last_snapshot = None
        self._paused_by: dict[int, list[int]] = {}        # thread id -> call ids of its ``with paused()``
        if not parent.poll(start_timeout):
            self._process.kill()
            raise TimeoutError(f"the engine process did not load the model in {start_timeout:.0f} s")
        try:
            kind, _, value = parent.recv()
        except EOFError:
            self._process.join(5)
            raise EngineDeadError(f"the engine process exited with code {self._process.exitcode} "
                                  "while loading the model") from None
        if kind == "error":
            self._process.join(5)
            raise value
        self.config: EngineConfig = value["config"]
        self.model_name: str = value["model_name"]
        self.model_impl: str = value["model_impl"]
        self._tokenizer = value["tokenizer"]
        self.max_model_len: int = value["max_model_len"]
        self._receiver = threading.Thread(target=self._receive, name="engine-client-recv", daemon=True)
        self._dispatcher = threading.Thread(target=self._dispatch, name="engine-client-events", daemon=True)
        self._receiver.start()
        self._dispatcher.start()

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    # -- LLM's surface ---------------------------------------------------------------------------
    def get_tokenizer(self):
        return self._tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """As ``LLM.generate`` (a progress bar, if asked for, is drawn by the engine process)."""
        return self._call("generate", prompts, sampling_params, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        return self._call("chat", messages, sampling_params, use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """As ``LLM.stream``: submitted when iteration starts; closing it early aborts the request."""
        self._check_can_wait("stream")
        cid, answers = self._open(stream=True)
        finished = False
        try:
            self._send(("stream", cid, prompt, sampling_params, request_id))
            prompt_token_ids = None
            while not finished:
                try:
                    kind, value = answers.get_nowait()
                except queue.Empty:
                    self._check_not_paused_here("stream")   # opened before the block, read inside it
                    kind, value = answers.get()
                if kind == "error":
                    raise value
                if value.prompt_token_ids is None:     # sent with the first delta only
                    value.prompt_token_ids = prompt_token_ids
                prompt_token_ids = value.prompt_token_ids
                finished = value.finished
                yield value
        finally:
            self._waiting.pop(cid, None)
            self._streams.discard(cid)
            if not finished and self._dead is None:
                with contextlib.suppress(EngineDeadError):   # gone meanwhile: nothing left to abort
                    self._send(("close", cid))

    def abort(self, request_id: str) -> bool:
        return self._call("abort", request_id)

    def sampler_pipeline(self, token_ids: list[int], position: int, sampling_params: SamplingParams,
                         num_prompt_tokens: int | None = None):
        """As ``LLM.sampler_pipeline`` (computed in the engine process)."""
        self._check_can_wait("sampler_pipeline")
        return self._call("sampler_pipeline", list(token_ids) if isinstance(token_ids, (list, tuple)) else token_ids,
                          position, sampling_params, num_prompt_tokens)

    def attention_lens(self, token_ids: list[int], position: int, layer: int | None = None,
                       head: int | None = None):
        """As ``LLM.attention_lens`` (computed in the engine process; the ``AttentionLens`` pickles back)."""
        self._check_can_wait("attention_lens")
        return self._call("attention_lens", list(token_ids) if isinstance(token_ids, (list, tuple)) else token_ids,
                          position, layer, head)

    def estimate_prefill(self, token_ids: list[int]):
        """As ``LLM.estimate_prefill`` (read in the engine process; the ``PrefillEstimate`` pickles back)."""
        return self._call("estimate_prefill", list(token_ids) if isinstance(token_ids, (list, tuple)) else token_ids)

    def kv_events(self, since: int = 0) -> dict:
        """As ``LLM.kv_events`` (plain dicts from the engine process)."""
        return self._call("kv_events", since)

    def snapshot(self):
        self._last_snapshot = keep_unchanged_blocks(self._call("snapshot"), self._last_snapshot)
        return self._last_snapshot

    def subscribe(self, callback):
        """As ``LLM.subscribe``: ``callback(EngineEvent)`` for every event, in order, on this client's
        event thread (a callback may call ``abort``/``snapshot``, not wait for generation)."""
        if not callable(callback):
            raise ValueError(f"subscribe() needs a callable; got {type(callback).__name__}")
        self._listeners = [*self._listeners, callback]

        def unsubscribe():
            self._listeners = [f for f in self._listeners if f is not callback]

        return unsubscribe

    def reset_prefix_cache(self) -> int:
        return self._call("reset_prefix_cache")

    @contextlib.contextmanager
    def paused(self):
        """As ``LLM.paused``: the engine holds between two steps while the ``with`` body runs. On the
        thread that holds it, ``stream`` submits, ``abort``/``snapshot`` answer (the engine process
        runs them on the thread that holds its pause), and waiting for tokens raises RuntimeError."""
        cid, answers = self._open()
        me = threading.get_ident()
        try:
            self._send(("pause", cid))
            kind, value = answers.get()     # held
            if kind == "error":
                raise value
            self._paused_by.setdefault(me, []).append(cid)
            try:
                yield
            finally:
                self._paused_by[me].pop()
                if not self._paused_by[me]:
                    del self._paused_by[me]
        finally:
            self._waiting.pop(cid, None)
            if self._dead is None:
                with contextlib.suppress(EngineDeadError):
                    self._send(("resume", cid))

    def shutdown(self) -> None:
        """Abort every request, stop the engine process and wait for it to exit."""
        if self._process.is_alive():
            try:
                self._send(("shutdown", 0))
            except (OSError, EngineDeadError):
                pass
            self._process.join(30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        self._fail_all("the engine process was shut down")

    # -- client internals -------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"{self._dead}; this LLMProcess cannot serve requests any more, create a new one")

    def _check_not_paused_here(self, name: str) -> None:
        if threading.get_ident() in self._paused_by:
            raise RuntimeError(
                f"LLMProcess.{name}() was called inside `with llm.paused():` on the same thread: the engine "
                "cannot step until that block ends, so waiting for tokens there would deadlock every caller. "
                "Wait after the block, or from another thread.")

    def _check_can_wait(self, name: str) -> None:
        self._check_alive()
        self._check_not_paused_here(name)
        if threading.current_thread() is self._dispatcher:
            raise RuntimeError(f"LLMProcess.{name}() was called from a subscribe() callback: waiting there "
                               "would stop every later event; hand the work to another thread")

    def _open(self, stream: bool = False) -> tuple[int, queue.SimpleQueue]:
        cid, answers = next(self._ids), queue.SimpleQueue()
        self._waiting[cid] = answers
        if stream:
            self._streams.add(cid)
        if self._dead is not None:          # died between the check and now: nobody would answer
            self._waiting.pop(cid, None)
            self._streams.discard(cid)
            self._check_alive()
        return cid, answers

    def _call(self, op: str, *args) -> Any:
        if op in ("generate", "chat"):
            self._check_can_wait(op)
        else:
            self._check_alive()
        cid, answers = self._open()
        try:
            self._send((op, cid, *args))
            kind, value = answers.get()
        finally:
            self._waiting.pop(cid, None)
        if kind == "error":
            raise value
        return value

    def _send(self, message: tuple) -> None:
        """Send ``(op, cid, *args)`` as ``(op, cid, pickled args, pause)``: an argument that does not
        pickle here is this caller's ``ValueError``, and the engine process unpickles the arguments
        apart from the message, so it can answer that call with the error if they do not unpickle
        there. A call from a thread inside ``paused()`` names that pause (its call id): the engine
        process runs it on the thread that holds the pause."""
        op, cid, *args = message
        pauses = self._paused_by.get(threading.get_ident())
        try:
            payload = pickle.dumps(tuple(args)) if args else None
        except Exception as exc:  # noqa: BLE001  (pickling runs the arguments' own code)
            raise ValueError(f"the arguments of {op}() cannot be sent to the engine process: "
                             f"{type(exc).__name__}: {exc}") from None
        try:
            with self._send_lock:
                self._conn.send((op, cid, payload, pauses[-1] if pauses else None))
        except (OSError, ValueError) as exc:    # the pipe is closed: the child is gone
            self._fail_all(f"the engine process is gone ({type(exc).__name__}: {exc})")
            raise EngineDeadError(self._dead) from None

    def _receive(self) -> None:
        """Route every message from the child: answers to calls straight to their caller (so a
        callback may call ``snapshot``), events and stream messages to the event thread in order."""
        try:
            while True:
                if not self._conn.poll(self._heartbeat_timeout):
                    self._stopped_answering()
                    return
                kind, cid, value = message = self._conn.recv()
                if kind == "heartbeat":
                    continue
                if kind == "event" or cid in self._streams:
                    self._events.put(message)
                    continue
                answers = self._waiting.get(cid)
                if answers is not None:
                    answers.put((kind, value))
        except (EOFError, OSError):
            code = self._process.exitcode
            self._fail_all("the engine process exited" + ("" if code is None else f" with code {code}"))

    def _stopped_answering(self) -> None:
        """No message, not even a heartbeat, for ``heartbeat_timeout`` s: the engine process is frozen
        (``SIGSTOP``) or stuck. It is killed (a stopped process too), and every caller fails now."""
        reason = (f"the engine process stopped answering (nothing for {self._heartbeat_timeout:g} s: frozen or "
                  f"stuck) and was killed")
        logger.error("%s (pid %s)", reason, self._process.pid)
        with contextlib.suppress(OSError):
            self._process.kill()
        self._fail_all(reason)

    def _dispatch(self) -> None:
        """Call the callbacks for each event, and pass each stream message on after the events that
        came before it: a step's events reach callbacks before its tokens reach their streams."""
        while True:
            message = self._events.get()
            if message is None:
                return
            kind, cid, value = message
            if kind != "event":
                answers = self._waiting.get(cid)
                if answers is not None:
                    answers.put((kind, value))
                continue
            for callback in self._listeners:
                try:
                    callback(value)
                except BaseException:  # noqa: BLE001  (skipped and logged, KeyboardInterrupt too: this
                    # thread hands every stream its tokens, so a callback must not end it)
                    logger.exception("subscribe() callback %r failed", callback)

    def _fail_all(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            self._events.put(None)
        for answers in list(self._waiting.values()):
            answers.put(("error", _Died(reason).error()))


# -- the child process ----------------------------------------------------------------------------
@dataclass
class _Stream:
    """A stream in the engine process: its request id, submitted yet, closed by the client."""

    request_id: str
    submitted: bool = False
    closed: bool = False


def _serve(conn, engine_args: dict) -> None:
    """Load the ``LLM`` and answer the client until it asks to stop or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches the whole process group: the parent stops us
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))   # not Paddle's handler, which prints a C++ "fatal error"
    from .llm import LLM

    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        if message[0] == "error":
            message = (message[0], message[1], _portable(message[2]))
        try:
            with send_lock:
                conn.send(message)
        except (OSError, ValueError):   # the parent is gone; the receive loop below ends too
            pass
        except Exception as exc:        # noqa: BLE001  (a value that does not pickle: say so instead)
            with send_lock:
                conn.send(("error", message[1], RuntimeError(f"{type(exc).__name__}: {exc}")))

    try:
        llm = LLM(**engine_args)
    except BaseException as exc:  # noqa: BLE001
        send(("error", 0, exc))
        return
    send(("ready", 0, {"config": llm.config, "model_name": llm.model_name, "model_impl": llm.model_impl,
                       "tokenizer": llm.get_tokenizer(), "max_model_len": llm.max_model_len}))
    llm.subscribe(lambda event: send(("event", None, event)))
    stopping = threading.Event()

    def heartbeat() -> None:
        while not stopping.wait(HEARTBEAT_INTERVAL):
            send(("heartbeat", None, None))

    threading.Thread(target=heartbeat, name="engine-core-heartbeat", daemon=True).start()
    lock = threading.Lock()
    live: dict[int, _Stream] = {}       # streams not yet finished, by call id

    def call(op: str, cid: int, args: tuple) -> None:
        try:
            send(("result", cid, getattr(llm, op)(*args)))
        except BaseException as exc:  # noqa: BLE001
            send(("error", cid, exc))

    def forward(cid: int):
        """The stream's deltas straight onto the pipe, from the engine's thread: no thread per stream.
        The prompt's token ids travel with the first delta only (the client puts them back)."""
        first = [True]

        def on_delta(item) -> None:
            if isinstance(item, EngineDeadError) or item.finished:
                with lock:
                    live.pop(cid, None)
            if isinstance(item, EngineDeadError):
                send(("error", cid, item))
            else:
                send(("delta", cid, item if first[0] else dataclasses.replace(item, prompt_token_ids=None)))
                first[0] = False
        return on_delta

    def submit(cid: int, prompt, params, stream: _Stream) -> None:
        try:
            llm.submit(prompt, params, stream.request_id, on_delta=forward(cid))
        except BaseException as exc:  # noqa: BLE001
            with lock:
                live.pop(cid, None)     # before the client hears of it: its close then aborts nothing
            send(("error", cid, exc))
            return
        with lock:
            stream.submitted = True
            closed = stream.closed
        if closed:                      # closed while being submitted
            llm.abort(stream.request_id)

    def close(cid: int) -> None:
        with lock:
            stream = live.pop(cid, None)
            if stream is not None:
                stream.closed = True
        if stream is not None and stream.submitted:
            llm.abort(stream.request_id)

    held: dict[int, queue.SimpleQueue] = {}    # pause call id -> work for the thread holding it (None: resume)

    def pause(cid: int) -> None:
        """Hold the engine, and run the calls the client makes from inside its ``with paused()`` here,
        on the thread that holds the (re-entrant) lock, until it resumes."""
        work = held[cid]
        try:
            with llm.paused():
                send(("result", cid, None))
                for target, targs in iter(work.get, None):
                    target(*targs)
        finally:
            held.pop(cid, None)

    def handle(op, cid, payload, in_pause) -> bool:
        """Start the work of one message; False for ``shutdown``."""
        try:
            args = pickle.loads(payload) if payload is not None else ()
        except Exception as exc:  # noqa: BLE001  (any class the caller had and this process has not)
            send(("error", cid, ValueError(
                f"the engine process cannot read the arguments of {op}(): {type(exc).__name__}: {exc}; pass "
                "built-in types and engine classes (an object of a class defined in the caller's __main__, "
                "e.g. a notebook, does not exist in the engine process)")))
            return True
        if op == "shutdown":
            return False
        if op == "resume":
            if cid in held:
                held[cid].put(None)
            return True
        if op == "close":   # the client closed a stream before its end: abort it
            target, targs = close, (cid,)
        elif op == "stream":
            prompt, params, request_id = args
            stream = _Stream(f"req-{uuid.uuid4().hex}" if request_id is None else request_id)
            with lock:
                live[cid] = stream
            target, targs = submit, (cid, prompt, params, stream)
        elif op == "pause":
            held[cid] = queue.SimpleQueue()
            target, targs = pause, (cid,)
        elif op in _CALLS:
            target, targs = call, (op, cid, tuple(args))
        else:
            send(("error", cid, ValueError(f"unknown operation {op!r}; accepted: stream, close, pause, resume, "
                                           f"shutdown, {', '.join(_CALLS)}")))
            return True
        if in_pause in held:    # from the client's thread inside that pause: run it where the pause is held
            held[in_pause].put((target, targs))
        else:
            threading.Thread(target=target, args=targs, name=f"engine-core-{op}-{cid}", daemon=True).start()
        return True

    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                raise
            except Exception:  # noqa: BLE001  (a message that does not unpickle: it names no call to fail)
                logger.exception("engine process: a message from the client could not be read")
                continue
            try:
                op, cid, payload, in_pause = message
                if not handle(op, cid, payload, in_pause):
                    break
            except Exception as exc:  # noqa: BLE001  (one bad message fails its call, not the engine)
                logger.exception("engine process: message %.80r failed", message)
                cid = message[1] if isinstance(message, tuple) and len(message) > 1 else None
                send(("error", cid, RuntimeError(f"the engine process could not handle this call: "
                                                 f"{type(exc).__name__}: {exc}")))
    except (EOFError, OSError):
        pass
    finally:
        stopping.set()
        for work in list(held.values()):   # a pause the client can no longer end
            work.put(None)
        llm.shutdown()
    exit_without_teardown(0)    # the client waits for this process to end: seconds sooner


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (so the client can raise it), else a ``RuntimeError`` that says
    what it was: an exception whose class or arguments do not unpickle must not stop the client."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")
