"""The Gradio app, driven over HTTP with gradio_client against a real engine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import gradio_client
import pytest
import tomllib

from engine import SamplingParams
from playground.app import DEFAULT_SYSTEM_PROMPT, build_app, launch
from playground.handlers import Limits

SYSTEM = DEFAULT_SYSTEM_PROMPT
MAX_CHARS = 300


def greedy(max_tokens: int, logprobs: int = 3) -> tuple:
    """The sampling controls' values, in the /chat endpoint's order."""
    return (0.0, 1.0, 0, max_tokens, 0, logprobs)   # temperature, top-p, top-k, max tokens, seed, logprobs


def reply_text(chat: list[dict]) -> str:
    """Text of the last assistant message of a Chatbot value."""
    content = [m for m in chat if m["role"] == "assistant"][-1]["content"]
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


class Events:
    """Records the engine's events (public subscribe API) during a test."""

    def __init__(self, llm):
        self.items = []
        self._unsubscribe = llm.subscribe(self.items.append)

    def finished(self, prefix: str = "") -> dict[str, str]:
        return {e.data["request_id"]: e.data["finish_reason"] for e in list(self.items)
                if e.kind == "request_finished" and e.data["request_id"].startswith(prefix)}

    def max_batch(self) -> int:
        return max((e.data["batch_size"] for e in list(self.items) if e.kind == "step"), default=0)

    def close(self):
        self._unsubscribe()


@pytest.fixture(scope="module")
def app(smollm2_llm):
    demo = build_app(smollm2_llm, limits=Limits(max_input_chars=MAX_CHARS, max_tokens=64))
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    yield demo, url
    demo.close()
    demo.playground_monitor.close()


@pytest.fixture
def client(app):
    return gradio_client.Client(app[1], verbose=False)


@pytest.fixture
def events(smollm2_llm):
    ev = Events(smollm2_llm)
    yield ev
    ev.close()


def wait_idle(llm, timeout=20.0):
    """Wait until the engine has no live request; return the final snapshot dict."""
    deadline = time.monotonic() + timeout
    snap = llm.snapshot().to_dict()
    while snap["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
        snap = llm.snapshot().to_dict()
    return snap


def test_chat_streams_a_reply(client, smollm2_llm):
    job = client.submit("What is the capital of France?", SYSTEM, *greedy(16), api_name="/chat")
    updates = list(job)
    chat, msg, logprobs_html, prefix_html = job.result()
    texts = [reply_text(u[0]) for u in updates]
    assert len(updates) >= 4, "the reply should arrive token by token"
    assert texts[1].endswith("▌") and len(texts[1]) < len(texts[-2])   # growing, with a cursor
    assert "Paris" in reply_text(chat) and not reply_text(chat).endswith("▌")
    assert msg == ""
    # The logprob view holds one span per generated token, each with top-3 alternatives.
    n_tokens = len(re.findall(r'class="lp-tok[^"]*" data-index=', logprobs_html))
    assert 1 <= n_tokens <= 16
    assert logprobs_html.count('class="lp-alt"') + logprobs_html.count('class="lp-chosen"') >= 3 * n_tokens
    assert "prompt tokens" in prefix_html
    assert not wait_idle(smollm2_llm)["requests"]


def test_two_clients_each_get_their_own_answer_batched(app, smollm2_llm, events):
    questions = ["What is the capital of France?", "Name a fruit that is yellow."]
    expected = [
        out.outputs[0].text
        for out in smollm2_llm.chat(
            [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions],
            SamplingParams(temperature=0.0, max_tokens=24))
    ]
    events.items.clear()
    clients = [gradio_client.Client(app[1], verbose=False) for _ in questions]
    jobs = [c.submit(q, SYSTEM, *greedy(24), api_name="/chat") for c, q in zip(clients, questions)]
    answers = [reply_text(job.result()[0]) for job in jobs]
    assert answers == expected                    # greedy: the same text as alone, no cross-talk
    assert answers[0] != answers[1] and all(answers)
    assert events.max_batch() >= 2, "the two chats should share engine steps"
    reasons = events.finished("chat-")
    assert len(reasons) == 2 and set(reasons.values()) <= {"length", "stop"}


def test_cancel_aborts_and_frees_blocks(client, smollm2_llm, events):
    job = client.submit("Write a long story about a dragon and a knight.", SYSTEM, 0.7, 0.9, 0, 64, 1, 0,
                        api_name="/chat")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    running = [r for r in smollm2_llm.snapshot().to_dict()["requests"] if r["request_id"].startswith("chat-")]
    assert running and running[0]["block_table"], "the request should hold KV blocks while streaming"
    rid = running[0]["request_id"]
    job.cancel()
    snap = wait_idle(smollm2_llm)
    assert not snap["requests"]
    assert not [b for b in snap["blocks"] if rid in b["owners"] or b["ref_cnt"] > 0]
    assert events.finished()[rid] == "abort"


def test_stop_endpoint_aborts_this_tabs_request(client, smollm2_llm, events):
    job = client.submit("Count from one to one hundred in words.", SYSTEM, *greedy(64, 0), api_name="/chat")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    client.predict(api_name="/stop")
    wait_idle(smollm2_llm)
    assert list(events.finished("chat-").values()) == ["abort"]


def test_message_too_long_is_refused_with_a_clear_message(client):
    with pytest.raises(Exception, match=f"limit is {MAX_CHARS}"):
        client.predict("x" * (MAX_CHARS + 1), SYSTEM, *greedy(4), api_name="/chat")


def test_branch_forces_an_alternative_and_hits_the_prefix_cache(client, smollm2_llm):
    chat, _, logprobs_html, _ = client.predict("What is the capital of France?", SYSTEM, *greedy(12),
                                               api_name="/chat")
    original = reply_text(chat)
    # Token 2's alternatives, as the hover table lists them (the chosen one is marked lp-chosen).
    spans = logprobs_html.split('class="lp-tok')[1:]
    alternative = int(re.search(r'class="lp-alt" data-token-id="(\d+)"', spans[2]).group(1))
    chat, _, branched_html, prefix_html = client.predict(2, alternative, *greedy(12), api_name="/branch")
    branched = reply_text(chat)
    tokenizer = smollm2_llm.get_tokenizer()
    kept = re.findall(r'data-index="[01]" data-token-id="(\d+)"', logprobs_html)
    assert branched.startswith(tokenizer.decode([int(t) for t in kept] + [alternative]))
    assert branched != original
    assert 'class="lp-tok lp-forced" data-index="2"' in branched_html
    # The branch re-reads the conversation prompt from the prefix cache.
    cached = int(re.search(r'class="cached-tokens">(\d+)<', prefix_html).group(1))
    assert cached >= 16
    assert len(chat) == 2                     # the branch replaced the reply, it did not add one


def test_engine_error_shows_in_that_chat_and_the_app_keeps_serving(client, smollm2_llm):
    client.predict("Say hi.", SYSTEM, *greedy(4), api_name="/chat")
    chat, *_ = client.predict(0, 10**9, *greedy(4), api_name="/branch")   # token id out of the vocabulary
    assert "Engine error" in reply_text(chat) and "prompt_token_ids" in reply_text(chat)
    chat, *_ = client.predict("What is the capital of France?", SYSTEM, *greedy(12), api_name="/chat")
    assert "Paris" in reply_text(chat)
    assert not wait_idle(smollm2_llm)["requests"]


def test_batch_demo_batches_and_shares_the_system_prompt(client, app, smollm2_llm, events):
    smollm2_llm.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
                     SamplingParams(max_tokens=1))     # the system prompt is now in the prefix cache
    events.items.clear()
    monitor = app[0].playground_monitor
    shared = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            shared.append(max((b["ref_cnt"] for b in monitor.refresh()["blocks"]), default=0))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        html = client.predict(3, SYSTEM, *greedy(16, 0), api_name="/batch_demo")
    finally:
        stop.set()
        watcher.join()
    rows = re.findall(r'<tr class="batch-row" data-request="([^"]+)" data-state="([^"]+)">', html)
    assert len(rows) == 3 and all(state == "done" for _, state in rows)
    cached = [int(c) for c in re.findall(r"<td>(\d+)/\d+</td>", html)]
    assert len(cached) == 3 and min(cached) >= 16
    assert events.max_batch() >= 2
    assert max(shared) >= 2, "the requests should share their system-prompt blocks"


def test_cli_defaults_are_safe():
    from playground.__main__ import parse_args

    args = parse_args([])
    assert args.host == "127.0.0.1" and args.port == 7860 and args.share is False
    assert args.model == "smollm2-135m-instruct" and args.enable_prefix_caching is True
    args = parse_args(["--model-impl", "native", "--block-size", "32", "--kv-cache-memory", "0.1",
                       "--max-num-seqs", "4", "--max-model-len", "1024", "--no-prefix-caching",
                       "--share", "--host", "0.0.0.0", "--port", "8000"])
    assert (args.model_impl, args.block_size, args.kv_cache_memory, args.max_num_seqs, args.max_model_len) == (
        "native", 32, 0.1, 4, 1024)
    assert args.enable_prefix_caching is False and args.share is True and args.host == "0.0.0.0"


def test_space_serves_only_models_from_its_fixed_list():
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "app.py"], cwd=root, capture_output=True, text=True,
                            env={**os.environ, "PLAYGROUND_MODEL": "/etc/passwd"}, timeout=120)
    assert result.returncode != 0 and "PLAYGROUND_MODEL must be one of" in result.stderr


def test_space_requirements_match_the_runtime_dependencies():
    root = Path(__file__).resolve().parents[1]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = [ln.strip() for ln in (root / "requirements.txt").read_text().splitlines()]
    assert sorted(ln for ln in lines if ln and not ln.startswith("#")) == sorted(declared)
    readme = (root / "README.md").read_text()
    front = readme.split("---")[1] if readme.startswith("---") else ""
    assert "sdk: gradio" in front and "app_file: app.py" in front


@pytest.mark.slow
def test_accuracy_alignment_on_the_conversation(client):
    with pytest.raises(Exception, match="Chat first"):
        client.predict(SYSTEM, api_name="/align")
    client.predict("What is the capital of France?", SYSTEM, *greedy(8), api_name="/chat")
    html = client.predict(SYSTEM, api_name="/align")
    assert "<b>native</b> vs <b>paddleformers</b>" in html
    row = re.search(r'<tr class="align-row" data-identical="(true|false)"><td>(\d+)</td><td>([\d.]+)%</td>', html)
    positions, agreement = int(row.group(2)), float(row.group(3))
    assert positions > 30                      # the whole chat prompt, teacher-forced, plus the reply
    assert agreement >= 90.0                   # two implementations of one checkpoint


def test_full_queue_refuses_with_a_clear_message(smollm2_llm):
    demo = build_app(smollm2_llm, queue_size=1, concurrency=1)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    try:
        clients = [gradio_client.Client(url, verbose=False) for _ in range(3)]
        first = clients[0].submit("Count to fifty.", SYSTEM, *greedy(64, 0), api_name="/chat")
        deadline = time.monotonic() + 60
        while not first.outputs() and time.monotonic() < deadline:   # running: holds the only slot
            time.sleep(0.02)
        second = clients[1].submit("Hi", SYSTEM, *greedy(4, 0), api_name="/chat")   # waits in the queue
        time.sleep(0.5)
        with pytest.raises(Exception, match="[Qq]ueue is full"):
            clients[2].predict("Hi", SYSTEM, *greedy(4, 0), api_name="/chat")
        first.cancel()
        assert reply_text(second.result(timeout=120)[0])       # the queued one is served afterwards
    finally:
        demo.close()
        demo.playground_monitor.close()
    assert not wait_idle(smollm2_llm)["requests"]
