"""One ``ChatSession`` per browser tab, whatever Gradio's ``gr.State`` hands an event.

Gradio may give the events of one tab two different ``gr.State`` values
around page load (seen: a refresh tick held another session than the chat it
should draw, so the block map called the tab's own chat "chat 1"). ``Tabs``
keeps the first ``ChatSession`` seen for each session hash, and ``wrap`` turns
a handler into one whose ``ChatSession`` argument is always that one. A
closed tab (``demo.unload``) is forgotten; at most ``capacity`` tabs are kept.

``on_loop_stream`` hands a streaming handler's updates to Gradio's event loop
from a thread of its own, instead of one worker-thread round trip per update.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import gradio as gr

from .chat import ChatSession

__all__ = ["Tabs", "refusals_logged"]

logger = logging.getLogger("playground")


class Tabs:
    """The ``ChatSession`` of every open tab, by Gradio session hash."""

    def __init__(self, on_close: Callable[[ChatSession], None] | None = None, capacity: int = 1000):
        self.on_close, self.capacity = on_close, capacity
        self._sessions: OrderedDict[str, ChatSession] = OrderedDict()
        self._lock = threading.Lock()

    def session(self, request: Any, session: ChatSession) -> ChatSession:
        """The tab's ``ChatSession``: the first one seen for its session hash."""
        key = getattr(request, "session_hash", None)
        if key is None:
            return session
        with self._lock:
            tab = self._sessions.setdefault(key, session)
            self._sessions.move_to_end(key)
            while len(self._sessions) > self.capacity:
                self._sessions.popitem(last=False)
        return tab

    def forget(self, request: gr.Request) -> None:
        """A tab closed: drop its session (``on_close`` stops its reply)."""
        with self._lock:
            session = self._sessions.pop(getattr(request, "session_hash", None), None)
        if session is not None and self.on_close is not None:
            self.on_close(session)

    def __len__(self) -> int:
        return len(self._sessions)

    def wrap(self, fn: Callable, *, event_data: bool = False, on_loop: bool = False) -> Callable:
        """``fn`` as a Gradio handler whose ``ChatSession`` argument is the tab's own.

        The wrapper's signature asks Gradio for the request (and the event data);
        it is not ``functools.wraps``-ed, since Gradio reads the signature.
        ``on_loop``: an ``async`` handler, which Gradio runs on its event loop
        instead of handing it to a worker thread (for quick, frequent events,
        such as the timers' ticks, where the hand-off costs more than the call).
        A streaming (generator) handler is handed to the loop through ``on_loop_stream``.
        """
        def resolve(request, args):
            return [self.session(request, a) if isinstance(a, ChatSession) else a for a in args]

        fn = refusals_logged(fn)

        if on_loop:
            async def handler(request: gr.Request, *args):
                return fn(*resolve(request, args))
        elif inspect.isgeneratorfunction(fn) and event_data:
            async def handler(request: gr.Request, evt: gr.EventData, *args):
                async for values in on_loop_stream(fn(*resolve(request, args), evt)):
                    yield values
        elif inspect.isgeneratorfunction(fn):
            async def handler(request: gr.Request, *args):
                async for values in on_loop_stream(fn(*resolve(request, args))):
                    yield values
        elif event_data:
            def handler(request: gr.Request, evt: gr.EventData, *args):
                return fn(*resolve(request, args), evt)
        else:
            def handler(request: gr.Request, *args):
                return fn(*resolve(request, args))
        handler.__name__ = handler.__qualname__ = fn.__name__
        handler.__doc__ = fn.__doc__
        return handler


def refusals_logged(fn: Callable) -> Callable:
    """``fn`` whose refusals (``gr.Error``: a message for the visitor) are one line in the log, not the
    traceback Gradio prints for every error unless the error says otherwise (``print_exception``)."""
    def quiet(exc: gr.Error) -> gr.Error:
        exc.print_exception = False
        logger.info("refused (%s): %s", fn.__name__, exc.message)
        return exc

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def stream(*args):
            try:
                yield from fn(*args)
            except gr.Error as exc:
                raise quiet(exc) from None
        return stream

    @functools.wraps(fn)
    def plain(*args):
        try:
            return fn(*args)
        except gr.Error as exc:
            raise quiet(exc) from None
    return plain


async def on_loop_stream(updates: Iterator) -> AsyncIterator:
    """A streaming handler's updates, for Gradio to take on its event loop.

    Gradio runs a plain generator one item at a time in a worker thread (``anyio.to_thread``: a
    hand-off to the worker and back for every streamed update, on the cores the engine decodes
    with). Here the generator runs on a thread of its own, start to end, and each update is handed
    to the loop once. When the event ends early (Stop, a closed tab) the generator is closed at its
    next update, in its own thread, as Gradio would close it: its ``finally`` blocks run there.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    ended = threading.Event()

    def put(item: tuple) -> None:
        with contextlib.suppress(RuntimeError):     # the loop is closed: nobody is listening
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def run() -> None:
        try:
            for values in updates:
                put(("update", values))
                if ended.is_set():
                    break
        except BaseException as exc:  # noqa: BLE001  (raised again on the loop, as Gradio would see it)
            put(("error", exc))
        else:
            put(("end", None))
        finally:
            updates.close()

    threading.Thread(target=run, name="chat-updates", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        ended.set()
