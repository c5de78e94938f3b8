"""Many visitors at once through gradio_client, one of them hostile: the others' replies are unaffected.

Each well-behaved session asks its own question greedily for a few tokens; the
expected replies come from ``llm.chat`` on the same engine beforehand (greedy
output does not depend on batch composition). Meanwhile a hostile session
sends wrong-typed and out-of-range values, a message over the limit, a
subnormal temperature, starts streams and stops or cancels them.
"""

from __future__ import annotations

import threading
import time

import gradio_client
import pytest

from engine import SamplingParams
from playground.app import DEFAULT_SYSTEM_PROMPT as SYSTEM
from playground.app import build_app, launch
from playground.batch_demo import QUESTIONS
from playground.handlers import Limits

N_SESSIONS = 16
MAX_TOKENS = 6


def reply_text(chat: list[dict]) -> str:
    c = [m for m in chat if m["role"] == "assistant"][-1]["content"]
    c = c if isinstance(c, str) else "".join(p.get("text", "") for p in c)
    return c.split('\n\n<div class="pg-meta"')[0]


@pytest.fixture(scope="module")
def url(smollm2_llm):
    demo = build_app(smollm2_llm, limits=Limits(max_input_chars=200, max_tokens=32), concurrency=N_SESSIONS + 2)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    yield url
    demo.close()
    demo.playground_monitor.close()


def hostile(url: str, stop: threading.Event, log: list) -> None:
    client = gradio_client.Client(url, verbose=False)
    bad = [
        ("/chat", ("x" * 201, SYSTEM, 0.0, 1.0, 0, 4, 0, 0)),
        ("/chat", ("hi", SYSTEM, "hot", 1.0, 0, 4, 0, 0)),
        ("/chat", ("hi", SYSTEM, 0.5, 1.0, 0, 10**9, 0, 0)),
        ("/chat", ({"role": "system"}, SYSTEM, 0.5, 1.0, 0, 4, 0, 0)),
        ("/branch", (10**12, "x", 0.0, 1.0, 0, 4, 0, 0)),
        ("/branch", (0, -5, 0.0, 1.0, 0, 4, 0, 0)),
        ("/batch_demo", (-3, SYSTEM, 0.0, 1.0, 0, 4, 0, 0)),
    ]
    while not stop.is_set():
        for endpoint, args in bad:
            try:
                client.predict(*args, api_name=endpoint)
                log.append(f"{endpoint} accepted {args[:2]!r}")
            except Exception as exc:   # the expected outcome: a readable refusal
                if "upstream Gradio app" in str(exc):
                    log.append(f"{endpoint}: generic error")
        # A subnormal temperature (NaN probabilities if divided by), streamed then abandoned.
        job = client.submit("Tell me a long story.", SYSTEM, 5e-324, 1.0, 0, 32, 0, 5, api_name="/chat")
        time.sleep(0.3)
        job.cancel()
        job = client.submit("Count to one hundred.", SYSTEM, 1.5, 0.5, 3, 32, 0, 0, api_name="/chat")
        time.sleep(0.3)
        client.predict(api_name="/stop")


def test_sixteen_sessions_and_a_hostile_one(url, smollm2_llm):
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(N_SESSIONS)]
    expected = [o.outputs[0].text for o in smollm2_llm.chat(
        [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]
    clients = [gradio_client.Client(url, verbose=False) for _ in range(N_SESSIONS)]
    stop, log = threading.Event(), []
    attacker = threading.Thread(target=hostile, args=(url, stop, log), daemon=True)
    attacker.start()
    t0 = time.monotonic()
    try:
        time.sleep(0.5)
        jobs = [c.submit(q, SYSTEM, 0.0, 1.0, 0, MAX_TOKENS, 0, 2, api_name="/chat")
                for c, q in zip(clients, questions)]
        answers = [reply_text(job.result(timeout=120)[0]) for job in jobs]
    finally:
        stop.set()
        attacker.join(timeout=60)
    assert time.monotonic() - t0 < 90
    assert answers == expected
    assert not log, log                                  # every hostile value was refused readably
    deadline = time.monotonic() + 30
    while smollm2_llm.snapshot().requests and time.monotonic() < deadline:
        time.sleep(0.05)
    snap = smollm2_llm.snapshot()
    assert not snap.requests and not [b for b in snap.blocks if b.ref_cnt > 0]   # nothing leaked
