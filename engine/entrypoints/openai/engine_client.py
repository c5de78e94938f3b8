"""``AsyncEngine``: the engine's request stream as an ``async`` iterator, for an asyncio server.

It wraps ``LLM.submit(on_delta=...)``: the engine thread hands each ``StreamDelta`` to the
server's event loop with ``call_soon_threadsafe`` (no thread per request); the submission and
an abort take the engine lock, so they run on a worker thread and never stall the loop for a
step. Leaving ``generate`` early (the client went away, the handler was cancelled) aborts the
request, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from ...llm import EngineDeadError
from ...outputs import StreamDelta
from ...sampling_params import SamplingParams


class AsyncEngine:
    """``observe(delta)``, when given, sees every delta of every request on the engine's thread as
    it is produced (the server's metrics: tokens counted per step, as vLLM does, and requests whose
    client went away counted too); it must be quick."""

    def __init__(self, llm, observe=None):
        self.llm, self.observe = llm, observe

    async def submit(self, prompt, params: SamplingParams, request_id: str | None, into: asyncio.Queue, key) -> str:
        """Queue one request (``prompt`` in any form ``LLM`` takes); its deltas arrive in ``into`` as
        ``(key, delta)``, an engine that died under it as ``(key, EngineDeadError)``. A bad request
        raises ``ValueError`` here."""
        loop = asyncio.get_running_loop()

        observe = self.observe

        def on_delta(delta) -> None:
            if observe is not None and not isinstance(delta, BaseException):
                observe(delta)
            try:
                loop.call_soon_threadsafe(into.put_nowait, (key, delta))
            except RuntimeError:        # the loop is closed: the server is gone, nobody reads this
                pass

        return await asyncio.to_thread(self.llm.submit, prompt, params, request_id, on_delta=on_delta)

    async def abort(self, request_id: str) -> None:
        await asyncio.to_thread(self.llm.abort, request_id)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None) -> AsyncIterator[StreamDelta]:
        """One request's deltas, the last one ``finished``; aborted if the caller stops early."""
        into: asyncio.Queue = asyncio.Queue()
        rid = await self.submit(prompt, params, request_id, into, None)
        finished = False
        try:
            while not finished:
                _, delta = await into.get()
                if isinstance(delta, EngineDeadError):
                    finished = True
                    raise delta
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                await asyncio.shield(self.abort(rid))
