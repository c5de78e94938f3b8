"""The batch demo: N concurrent requests sharing one system prompt.

Each request runs ``chat.stream_reply`` in its own thread, exactly like N
browser tabs chatting at once: the engine batches them in the same steps and
the prefix cache shares their common system-prompt blocks (the block map
shows shared cells, the step chart shows batch size N).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from .chat import Reply, stream_reply

__all__ = ["QUESTIONS", "run_batch"]

QUESTIONS = (
    "Name three colours.",
    "What is the capital of France?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "Name a planet in our solar system.",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
    "What is two plus three?",
    "Name a fruit that is yellow.",
    "What colour is the sky on a clear day?",
    "Name an animal that can fly.",
    "What is the opposite of cold?",
    "Name a musical instrument.",
    "What do cows drink?",
    "Name a shape with three sides.",
    "What season comes after winter?",
)


def _row(question: str, reply: Reply) -> dict:
    return {
        "request_id": reply.request_id, "question": question, "text": reply.text,
        "num_prompt_tokens": reply.num_prompt_tokens, "num_cached_tokens": reply.num_cached_tokens,
        "finished": reply.finished, "error": reply.error,
    }


def run_batch(
    llm: Any,
    system_prompt: str,
    params: Any,
    request_ids: list[str],
    *,
    poll_s: float = 0.25,
) -> Iterator[list[dict]]:
    """Start one request per id (cycling through ``QUESTIONS``) and yield
    their rows every ``poll_s`` until all are finished.

    Closing the generator early (Stop, a closed tab) stops every thread,
    which aborts its request.
    """
    stop = threading.Event()
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(len(request_ids))]
    replies = [Reply(request_id=rid) for rid in request_ids]

    def worker(question: str, reply: Reply) -> None:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": question}]
        gen = stream_reply(llm, messages, params, reply)
        try:
            for _ in gen:
                if stop.is_set():
                    break
        finally:
            gen.close()

    threads = [threading.Thread(target=worker, args=(q, r), daemon=True, name=f"batch-{r.request_id}")
               for q, r in zip(questions, replies)]
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            yield [_row(q, r) for q, r in zip(questions, replies)]
            time.sleep(poll_s)
        yield [_row(q, r) for q, r in zip(questions, replies)]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
