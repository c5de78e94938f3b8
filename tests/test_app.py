"""The Gradio app, driven over HTTP with gradio_client against a real engine."""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import gradio as gr
import gradio_client
import pytest
import tomllib

from engine import SamplingParams
from playground.app import DEFAULT_SYSTEM_PROMPT, build_app, launch
from playground.handlers import Limits
from playground.live_panels import PANEL_IDS, wrap
from playground.tabs import on_loop_stream

SYSTEM = DEFAULT_SYSTEM_PROMPT
MAX_CHARS = 300


def greedy(max_tokens: int, logprobs: int = 3) -> tuple:
    """The sampling controls' values, in the /chat endpoint's order."""
    return (0.0, 1.0, 0, max_tokens, 0, logprobs)   # temperature, top-p, top-k, max tokens, seed, logprobs


def content(message: dict) -> str:
    c = message["content"]
    return c if isinstance(c, str) else "".join(part.get("text", "") for part in c)


def reply_text(chat: list[dict]) -> str:
    """Text of the last assistant message of a Chatbot value, without its stats line."""
    return content([m for m in chat if m["role"] == "assistant"][-1]).split('\n\n<div class="pg-meta"')[0]


def chat_through_app(engine, smollm2_llm, question: str = "What is the capital of France?"):
    """The app built on ``engine`` (any engine client: in-process, its own process, a server) answers one
    greedy chat over its HTTP API, as a visitor's page would. Returns the /chat outputs, the monitor's
    snapshot just after, and the reply the in-process engine gives to the same conversation."""
    demo = build_app(engine)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    try:
        outputs = gradio_client.Client(url, verbose=False).predict(question, SYSTEM, *greedy(12), api_name="/chat")
        snap = demo.playground_monitor.refresh()
    finally:
        demo.close()
        demo.playground_monitor.close()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    (expected,) = smollm2_llm.chat(messages, SamplingParams(max_tokens=12, temperature=0))
    return outputs, snap, expected.outputs[0].text


def reply_meta(chat: list[dict]) -> str:
    """The stats / branch line under the last reply."""
    text = content([m for m in chat if m["role"] == "assistant"][-1])
    return text[text.index('<div class="pg-meta"'):]


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
    demo = build_app(smollm2_llm, limits=Limits(max_input_chars=MAX_CHARS, max_tokens=64), allow_engine_admin=True)
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


def run_unqueued(client, fn_index: int, timeout: float = 30.0) -> list:
    """One event that skips the queue (the page's load events), as the page sends it: a POST to
    ``/run/predict`` in the client's session (gradio_client would join the queue instead)."""
    import httpx

    inputs = client.config["dependencies"][fn_index]["inputs"]
    body = {"data": [None] * len(inputs), "fn_index": fn_index, "session_hash": client.session_hash, "event_data": None,
            "trigger_id": None}
    response = httpx.post(f"{client.src.rstrip('/')}/gradio_api/run/predict", json=body, timeout=timeout)
    response.raise_for_status()
    return response.json()["data"]


def wait_idle(llm, timeout=20.0):
    """Wait until the engine has no live request; return the final snapshot dict."""
    deadline = time.monotonic() + timeout
    snap = llm.snapshot().to_dict()
    while snap["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
        snap = llm.snapshot().to_dict()
    return snap


def test_chat_streams_a_reply(client, paced_engine):
    job = client.submit("What is the capital of France?", SYSTEM, *greedy(16), api_name="/chat")
    updates = list(job)
    chat, msg, logprobs_html, prefix_html, *_ = job.result()
    texts = [reply_text(u[0]) for u in updates]
    assert len(updates) >= 4, "the reply should arrive token by token"
    assert texts[0] == "▌" and 'class="pg-state">queued' in reply_meta(updates[0][0])   # shown at once
    growing = [t for t in texts if t.endswith("▌") and len(t) > 1]
    assert growing and len(growing[0]) < len(texts[-1]) + 1                  # growing, with a cursor
    assert "Paris" in reply_text(chat) and not reply_text(chat).endswith("▌")
    # Bug 2: the message box is emptied once, when the message is taken; later updates leave it alone
    # (every streamed update used to write "" there, wiping what the visitor was typing).
    assert updates[0][1] == ""
    assert all(u[1] == {"__type__": "update"} for u in updates[1:]) and msg == {"__type__": "update"}
    meta = reply_meta(chat)                      # per-reply stats: tokens, TTFT, tok/s, cached, finish
    assert re.search(r"<span class=\"pg-count\">\d+ tokens</span>", meta) and "TTFT" in meta and "tok/s" in meta
    assert "prompt tokens cached" in meta and "pg-finish-" in meta and "context" in meta
    # The logprob view holds one span per generated token, each with top-3 alternatives.
    n_tokens = len(re.findall(r'class="lp-tok[^"]*" data-index=', logprobs_html))
    assert 1 <= n_tokens <= 16
    assert logprobs_html.count('class="lp-alt"') + logprobs_html.count('class="lp-chosen"') >= 3 * n_tokens
    assert "prompt tokens" in prefix_html
    assert not wait_idle(paced_engine)["requests"]


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


def test_cancel_aborts_and_frees_blocks(client, paced_engine, events):
    job = client.submit("Write a long story about a dragon and a knight.", SYSTEM, 0.7, 0.9, 0, 64, 1, 0,
                        api_name="/chat")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    running = [r for r in paced_engine.snapshot().to_dict()["requests"] if r["request_id"].startswith("chat-")]
    assert running and running[0]["block_table"], "the request should hold KV blocks while streaming"
    rid = running[0]["request_id"]
    job.cancel()
    snap = wait_idle(paced_engine)
    assert not snap["requests"]
    assert not [b for b in snap["blocks"] if rid in b["owners"] or b["ref_cnt"] > 0]
    assert events.finished()[rid] == "abort"


def test_stop_endpoint_aborts_this_tabs_request(client, paced_engine, events):
    job = client.submit("Count from one to one hundred in words.", SYSTEM, *greedy(64, 0), api_name="/chat")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    client.predict(api_name="/stop")
    wait_idle(paced_engine)
    assert list(events.finished("chat-").values()) == ["abort"]


def test_message_too_long_is_refused_with_a_clear_message(client):
    with pytest.raises(Exception, match=f"limit is {MAX_CHARS}"):
        client.predict("x" * (MAX_CHARS + 1), SYSTEM, *greedy(4), api_name="/chat")


def test_branch_forces_an_alternative_and_hits_the_prefix_cache(client, smollm2_llm):
    chat, _, logprobs_html, *_ = client.predict("What is the capital of France?", SYSTEM, *greedy(12),
                                                api_name="/chat")
    original = reply_text(chat)
    # Token 2's alternatives, as the hover table lists them (the chosen one is marked lp-chosen).
    spans = logprobs_html.split('class="lp-tok')[1:]
    alternative = int(re.search(r'class="lp-alt" data-token-id="(\d+)"', spans[2]).group(1))
    chat, _, branched_html, prefix_html, *_ = client.predict(2, alternative, *greedy(12), api_name="/branch")
    branched = reply_text(chat)
    tokenizer = smollm2_llm.get_tokenizer()
    kept = re.findall(r'data-index="[01]" data-token-id="(\d+)"', logprobs_html)
    assert branched.startswith(tokenizer.decode([int(t) for t in kept] + [alternative]))
    assert branched != original
    assert 'class="lp-tok lp-forced" data-index="2"' in branched_html
    # The branch re-reads the conversation prompt from the prefix cache.
    cached = int(re.search(r'class="cached-tokens">(\d+)<', prefix_html).group(1))
    assert cached >= 16
    assert len(chat) == 2                     # the branch is shown in the reply's place ...
    assert '<span class="pg-pos">2/2</span>' in reply_meta(chat)   # ... and the original is kept: ‹ 2/2 ›
    compare = client.predict(api_name="/compare")                  # side by side, parting at token 2
    assert 'data-split="2"' in compare and compare.count('class="compare-col"') == 2
    # Clicking a token there does nothing, so its strips do not say "click to branch".
    assert "to branch" not in compare.replace("branch from the logprob view above", "")
    assert "branch from the logprob view above" in compare


def shown_tokens(logprobs_html: str) -> list[tuple[str, str]]:
    """(classes, visible text) of every token of a logprob view, in order."""
    return re.findall(r'<span class="(lp-tok[^"]*)"[^>]*>([^<]*)<span class="lp-tip">', logprobs_html)


def test_the_end_of_turn_token_is_an_end_marker_not_text(client, smollm2_llm):
    """The sampled stop token ("<|im_end|>") showed as text at the end of the reply's tokens; it is
    the reply's end: a marker with its probability and alternatives (a branch from it goes on)."""
    chat, _, logprobs_html, *_ = client.predict("Say hello.", SYSTEM, *greedy(48), api_name="/chat")
    assert "pg-finish-stop" in reply_meta(chat)                # the model ended its turn itself
    tokens = shown_tokens(logprobs_html)
    assert all("im_end" not in text for _, text in tokens)
    classes, text = tokens[-1]
    assert "lp-end" in classes.split() and text == "end"
    assert sum("lp-end" in c.split() for c, _ in tokens) == 1
    last = logprobs_html.split('class="lp-tok lp-end"')[1]
    assert "ended the reply: &lt;|im_end|&gt;" in last and re.search(r'data-prob="0\.\d+"', last)
    # A reply cut by max tokens has no end marker.
    _, _, cut_html, *_ = client.predict("Count to fifty.", SYSTEM, *greedy(3), api_name="/chat")
    assert not any("lp-end" in c.split() for c, _ in shown_tokens(cut_html))


BAD_VALUES = [   # (endpoint, arguments, words the error must contain): issue 13, defect 9
    ("/chat", (None, SYSTEM, *greedy(4)), None),                       # empty: nothing happens
    ("/chat", (12, SYSTEM, *greedy(4)), "message must be text"),
    ("/chat", ("Hi", ["x"], *greedy(4)), "system prompt must be text"),
    ("/chat", ("Hi", SYSTEM, "hot", 1.0, 0, 4, 0, 0), "temperature must be a number"),
    ("/chat", ("Hi", SYSTEM, 5.0, 1.0, 0, 4, 0, 0), "temperature must be between 0 and 2"),
    ("/chat", ("Hi", SYSTEM, 0.5, None, 0, 4, 0, 0), "top-p is missing"),
    ("/chat", ("Hi", SYSTEM, 0.5, 0.0, 0, 4, 0, 0), "top-p must be in (0.0, 1.0]"),   # the engine's own check
    ("/chat", ("Hi", SYSTEM, 0.5, 1.0, -3, 4, 0, 0), "top-k must be between"),
    ("/chat", ("Hi", SYSTEM, 0.5, 1.0, 0, 10**6, 0, 0), "max tokens must be between 1 and 64"),
    ("/chat", ("Hi", SYSTEM, 0.5, 1.0, 0, 2.5, 0, 0), "max tokens must be a whole number"),
    ("/chat", ("Hi", SYSTEM, 0.5, 1.0, 0, 4, {"a": 1}, 0), "seed must be a number"),
    ("/chat", ("Hi", SYSTEM, 0.5, 1.0, 0, 4, 0, 99), "logprobs must be between 0 and 20"),
    ("/branch", (-7, 5, *greedy(4)), "branch token # must be between 0"),
    ("/branch", (10**12, 5, *greedy(4)), "branch token # must be between 0"),
    ("/branch", (None, 5, *greedy(4)), "Click a token of the reply in the logprob view first"),
    ("/branch", (0, 10**9, *greedy(4)), "alternative token id must be between 0"),
    ("/branch", (0, None, *greedy(4)), "choose an alternative"),
    ("/branch", (0, [1, 2], *greedy(4)), "alternative must be a token id or text"),
    ("/batch_demo", ("many", SYSTEM, *greedy(4)), "requests must be a number"),
    ("/batch_demo", (10**6, SYSTEM, *greedy(4)), "requests must be between 1 and 8"),
    ("/batch_demo", (2, SYSTEM, "x", 1.0, 0, 4, 0, 0), "temperature must be a number"),
]


def test_bad_values_get_readable_errors_and_the_app_keeps_serving(client, smollm2_llm):
    client.predict("Say hi.", SYSTEM, *greedy(4), api_name="/chat")      # something to branch from
    for endpoint, args, words in BAD_VALUES:
        if words is None:
            client.predict(*args, api_name=endpoint)
            continue
        with pytest.raises(Exception) as info:
            client.predict(*args, api_name=endpoint)
        assert words in str(info.value), f"{endpoint}{args!r}: {info.value}"
        assert "upstream Gradio app has raised an exception" not in str(info.value)
    chat, *_ = client.predict("What is the capital of France?", SYSTEM, *greedy(12), api_name="/chat")
    assert "Paris" in reply_text(chat)
    assert not wait_idle(smollm2_llm)["requests"]


def test_a_custom_alternative_is_forced_as_text(client, smollm2_llm):
    """Bug 5: typing "Paris" into the alternative box crashed the chat (int('Paris'))."""
    client.predict("What is the capital of France?", SYSTEM, *greedy(8), api_name="/chat")
    chat, _, html, *_ = client.predict(0, "Bonjour! Paris", *greedy(6), api_name="/branch")
    assert reply_text(chat).startswith("Bonjour! Paris")
    forced = re.findall(r'class="lp-tok lp-forced" data-index="(\d+)"', html)
    assert len(forced) >= 2 and forced[0] == "0"          # several tokens forced, from token 0
    assert not wait_idle(smollm2_llm)["requests"]


def test_branch_is_bound_to_the_reply_shown(client, paced_engine):
    """Bug 1: a branch choice must not leak into a newer reply; branching while a reply streams is refused."""
    first = client.submit("Say hello in French.", SYSTEM, *greedy(8), api_name="/chat")
    first.result()
    taken = first.outputs()[0]                                    # a new reply empties the branch controls
    assert taken[4] is None and taken[5]["value"] is None and taken[5]["choices"] == []
    job = client.submit("Count from one to fifty.", SYSTEM, *greedy(48, 0), api_name="/chat")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(Exception, match="still being generated"):
        client.predict(1, 5, *greedy(4), api_name="/branch")
    chat = job.result()[0]
    assert len([m for m in chat if m["role"] == "assistant"]) == 2   # the streaming reply was not replaced
    cleared = client.predict(api_name="/clear")
    assert cleared[0] == [] and cleared[4] is None                # Clear empties the controls too
    assert not wait_idle(paced_engine)["requests"]


def test_stop_marks_the_reply_stopped_without_a_cursor(client, paced_engine):
    """Bug 3: Stop left the ▌ cursor forever and no "(stopped)" marker."""
    job = client.submit("Count from one to one hundred in words.", SYSTEM, *greedy(64, 0), api_name="/chat")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    chat = client.predict(api_name="/stop")[0]
    assert reply_text(chat).endswith("*(stopped)*") and "▌" not in reply_text(chat)
    assert 'class="pg-finish pg-finish-abort"' in reply_meta(chat)
    assert "⏹" not in content(chat[-1])                    # no glyph that needs an emoji font
    wait_idle(paced_engine)


def test_replies_cut_by_max_tokens_say_length(client):
    chat = client.predict("Tell me a long story about a dragon.", SYSTEM, *greedy(5, 0), api_name="/chat")[0]
    assert 'pg-finish-length' in reply_meta(chat) and "max tokens" in reply_meta(chat)


def test_regenerate_and_branches_form_a_tree_with_turn_labels(client, smollm2_llm):
    """Regenerate keeps the earlier reply (‹ 1/2 ›); turn labels count turns, and the prefix panel
    shows the branch on screen: after regenerating turn 2, the next turn follows 1, 2b, 3."""
    client.predict("Hi!", SYSTEM, *greedy(4, 0), api_name="/chat")
    client.predict("Name a colour.", SYSTEM, *greedy(4, 0), api_name="/chat")
    chat, _, _, prefix_html, *_ = client.predict(SYSTEM, 0.9, 1.0, 0, 4, 7, 0, api_name="/regenerate")
    assert len(chat) == 4 and '<span class="pg-pos">2/2</span>' in reply_meta(chat)
    chat, _, _, prefix_html, *_ = client.predict("And a fruit?", SYSTEM, *greedy(4, 0), api_name="/chat")
    labels = re.findall(r"<title>turn (\w+):", prefix_html)
    assert labels == ["1", "2b", "3"]
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
def test_backend_consistency_on_the_conversation(client):
    with pytest.raises(Exception, match="Chat first"):
        client.predict(SYSTEM, api_name="/align")
    client.predict("What is the capital of France?", SYSTEM, *greedy(8), api_name="/chat")
    html = client.predict(SYSTEM, api_name="/align")
    assert "<b>native</b> vs <b>paddleformers</b>" in html and "consistency" in html
    row = re.search(r'<tr class="align-row" data-identical="(true|false)"><td>(\d+)</td><td>([\d.]+)%</td>', html)
    positions, agreement = int(row.group(2)), float(row.group(3))
    assert positions > 30                      # the whole chat prompt, teacher-forced, plus the reply
    assert agreement >= 90.0                   # two implementations of one checkpoint


def test_engine_wide_actions_need_allow_engine_admin(smollm2_llm):
    demo = build_app(smollm2_llm)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    try:
        client = gradio_client.Client(url, verbose=False)
        for endpoint, args in (("/reset_prefix_cache", ()), ("/align", (SYSTEM,))):
            with pytest.raises(Exception, match="--allow-engine-admin"):
                client.predict(*args, api_name=endpoint)
        assert demo.analytics_enabled is False
    finally:
        demo.close()
        demo.playground_monitor.close()


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


def test_completion_mode_continues_raw_text(client, smollm2_llm):
    """Bug 8: a base model needs raw text continuation; the /chat endpoint takes the mode last."""
    text = "The capital of France is"
    chat, *_ = client.predict(text, SYSTEM, *greedy(4, 0), mode="completion", api_name="/chat")
    expected = smollm2_llm.generate(text, SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].text
    # One document: the text given, then its continuation (not a bubble of its own).
    assert [m["role"] for m in chat] == ["assistant"]
    document = html.unescape(re.sub(r"<[^>]+>", "", reply_text(chat).replace("<br>", "\n")))
    assert document == text + expected
    n_prompt = len(smollm2_llm.get_tokenizer().encode(text))       # no chat template around it
    assert re.search(rf"\d+/{n_prompt} prompt tokens cached", reply_meta(chat))
    with pytest.raises(Exception, match="mode must be one of chat, completion"):
        client.predict(text, SYSTEM, *greedy(4, 0), mode="poetry", api_name="/chat")


def test_models_without_a_chat_template_start_in_completion_mode(smollm2_llm):
    from engine.tokenizer import Tokenizer
    from playground.handlers import default_mode

    chat = smollm2_llm.get_tokenizer()
    base = Tokenizer(chat.backend, bos_token_id=chat.bos_token_id, chat_template=None, name="base")
    assert default_mode(chat) == "chat" and default_mode(base) == "completion"


def test_logprob_view_shows_probability_logprob_or_rank(client):
    client.predict("Say hi.", SYSTEM, *greedy(4), api_name="/chat")
    assert re.search(r"<td>#1</td>", client.predict("rank", api_name="/logprob_metric"))
    assert re.search(r"<td>-\d+\.\d{3}</td>", client.predict("logprob", api_name="/logprob_metric"))
    with pytest.raises(Exception, match="one of probability, logprob, rank"):
        client.predict("entropy", api_name="/logprob_metric")
    assert "%</td>" in client.predict("probability", api_name="/logprob_metric")


def test_a_tab_keeps_its_first_session():
    """Gradio handed one tab's refresh a second State value at page load; every event gets the first."""
    from types import SimpleNamespace

    from playground.chat import ChatSession
    from playground.tabs import Tabs

    closed = []
    tabs = Tabs(on_close=closed.append, capacity=2)
    first, second = ChatSession(), ChatSession()
    tab = SimpleNamespace(session_hash="abc")
    assert tabs.session(tab, first) is first and tabs.session(tab, second) is first
    seen = []
    handler = tabs.wrap(lambda x, session: seen.append((x, session)))
    handler(tab, 1, second)
    assert seen == [(1, first)]
    tabs.forget(tab)
    assert closed == [first] and len(tabs) == 0
    for key in "xyz":                                  # at most `capacity` tabs are remembered
        tabs.session(SimpleNamespace(session_hash=key), ChatSession())
    assert len(tabs) == 2


def test_messages_sent_while_a_reply_streams_are_queued_in_order(client, paced_engine):
    """Bug 2: a message submitted mid-stream was lost; now it waits for the reply, and so does a second one
    (it was refused), each answered in the order sent."""
    first = client.submit("Count from one to thirty in words.", SYSTEM, *greedy(40, 0), api_name="/chat")
    deadline = time.monotonic() + 60
    while len(first.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    second = client.submit("Thanks!", SYSTEM, *greedy(4, 0), api_name="/chat")
    deadline = time.monotonic() + 30
    while not second.outputs() and time.monotonic() < deadline:
        time.sleep(0.02)
    third = client.submit("And another?", SYSTEM, *greedy(4, 0), api_name="/chat")
    chat = third.result(timeout=180)[0]
    users = [content(m) for m in chat if m["role"] == "user"]
    assert users[-3:] == ["Count from one to thirty in words.", "Thanks!", "And another?"]
    assert len([m for m in chat if m["role"] == "assistant"]) == len(users)   # all answered, in order
    assert "pg-finish-" in reply_meta(chat) and first.result()[0] and second.result()[0]
    assert not wait_idle(paced_engine)["requests"]


def test_the_prompt_view_shows_what_surprised_the_model(client, smollm2_llm):
    with pytest.raises(Exception, match="Send a message first"):
        client.predict(api_name="/prompt_view")
    client.predict("The capital of Italy is banana. Is that right?", SYSTEM, *greedy(4), api_name="/chat")
    html = client.predict(api_name="/prompt_view")
    # Every prompt token is shown; the first has nothing before it, the rest carry their top-5.
    prompt = smollm2_llm.get_tokenizer().apply_chat_template(
        [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "The capital of Italy is banana. Is that right?"}], add_generation_prompt=True)
    n = len(smollm2_llm.get_tokenizer().encode(prompt, add_special_tokens=False))
    assert len(re.findall(r'class="lp-tok[^"]*" data-index=', html)) == n
    assert f"{n} prompt tokens" in html
    assert re.search(r'data-index="0"[^>]*>&lt;\|im_start\|&gt;<', html)    # the first token, spelled out
    worst = re.findall(r'class="pv-worst" data-index="\d+">([^<]*)</span> ([\d.]+)', html)
    assert worst[0][0] == " banana" and float(worst[0][1]) > 10     # the odd word, by far
    assert not wait_idle(smollm2_llm)["requests"]


def test_the_block_map_is_polled_from_its_own_route_not_a_gradio_event(app):
    """Each open tab refreshes the map several times a second, on the cores the engine decodes
    with. It was a Gradio timer (an event through Gradio's request machinery per tab and tick);
    now the page's load event draws the map once with the tab's token, and the page's script
    polls the map's own route: 204 while nothing changed, the new map (without the panels'
    style, already on the page) when the engine moved on, 404 for a token it never gave out."""
    import httpx

    demo, url = app
    client = gradio_client.Client(url, verbose=False)
    config = client.config
    kv_map = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "kv-map")
    drawing = [(i, d) for i, d in enumerate(config["dependencies"]) if kv_map in d["outputs"]]
    assert [t[1] for _, d in drawing for t in d["targets"]] == ["load"]        # no timer draws it
    wait_idle(demo.playground_monitor.llm)
    time.sleep(0.5)                                         # the monitor's last snapshot of the idle engine
    panel = run_unqueued(client, drawing[0][0])[0]
    tab, every, key = re.search(r'class="kv-live" data-tab="([^"]+)" data-every="([^"]+)" data-key="([^"]+)"',
                                panel).groups()
    assert float(every) == 0.2 and 'class="pg-panel kv-map"' in panel

    def poll(since: str, token: str = tab) -> httpx.Response:
        return httpx.get(f"{url}playground/map", params={"tab": token, "since": since}, timeout=30)

    unchanged = poll(key)
    assert unchanged.status_code == 204 and unchanged.headers["X-Map-Key"] == key and not unchanged.content
    again = poll("")
    assert again.status_code == 200 and again.headers["X-Map-Key"] == key
    assert again.text.startswith('<div class="pg-panel kv-map"') and "<style>" not in again.text
    assert poll(key, token="not-a-tab").status_code == 404
    client.predict("Hi!", SYSTEM, *greedy(4), api_name="/chat")
    deadline, after = time.monotonic() + 10, poll(key)
    while after.status_code == 204 and time.monotonic() < deadline:            # the monitor's next snapshot
        time.sleep(0.05)
        after = poll(key)
    step = re.compile(r'class="pg-panel kv-map" data-step="(\d+)"')
    assert after.status_code == 200 and after.headers["X-Map-Key"] != key
    assert int(step.search(after.text).group(1)) > int(step.search(panel).group(1))  # the engine moved on


def test_the_panels_are_polled_from_their_own_route_not_a_gradio_timer(app):
    """The prefix-cache, engine, timeline and inspector panels refreshed once a second per tab
    through a Gradio timer (``/run/predict``: ~4 ms of the server per tab and tick). Now the page
    has no timer: its load event draws them once, each inside the wrapper the page's script fills
    from the panels' route (the tab's map token), which answers their contents as JSON and moves
    on with the engine; 404 for a token the map never gave out."""
    import httpx

    demo, url = app
    client = gradio_client.Client(url, verbose=False)
    config = client.config
    assert not [d for d in config["dependencies"] if any(t[1] == "tick" for t in d["targets"])]
    ids = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    loads = [(i, d) for i, d in enumerate(config["dependencies"])
             if [t[1] for t in d["targets"]] == ["load"] and d.get("backend_fn", True)]   # not the page's own js
    drawn = {}
    for i, d in loads:
        drawn.update(zip((ids[o] for o in d["outputs"]), run_unqueued(client, i)))
    tab = re.search(r'data-tab="([^"]+)"', drawn["kv-map"]).group(1)
    html_panels = [p for p in PANEL_IDS if p != "timeline"]          # the timeline is a gr.Plot
    for elem_id in html_panels:
        assert drawn[elem_id].startswith(f'<div class="live-panel" data-panel="{elem_id}">')
    assert isinstance(drawn["timeline"], dict) and drawn["timeline"].get("type") == "plotly"

    def poll(token: str = tab) -> httpx.Response:
        return httpx.get(f"{url}playground/panels", params={"tab": token}, timeout=30)

    before = poll()
    assert before.status_code == 200 and before.headers["Cache-Control"] == "no-store"
    panels = before.json()
    assert list(panels) == [*PANEL_IDS, "stop"] and panels["stop"] == {"disabled": True}   # nothing to stop yet
    assert all(isinstance(panels[p], str) and panels[p] for p in html_panels)
    assert set(panels["timeline"]) == {"plotly"} and panels["timeline"]["plotly"]["data"]
    assert drawn["engine-panel"] == wrap("engine-panel", panels["engine-panel"])
    assert poll("not-a-tab").status_code == 404
    client.predict("Hi!", SYSTEM, *greedy(4), api_name="/chat")
    deadline, after = time.monotonic() + 10, poll().json()
    while after["engine-panel"] == panels["engine-panel"] and time.monotonic() < deadline:
        time.sleep(0.1)                                     # the monitor's next snapshot
        after = poll().json()
    assert after["engine-panel"] != panels["engine-panel"]                      # the engine moved on


def test_the_map_route_asks_for_the_same_login_as_gradio(smollm2_llm):
    """Launched with ``auth=``, Gradio answers its own routes only after ``POST /login`` (its
    access-token cookie); the map's and the panels' routes (not Gradio's) must ask for the same
    login: a tab token alone, seen by anyone who shares the link, must not show them."""
    import httpx

    demo = build_app(smollm2_llm)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True, auth=[("ada", "lovelace")])
    try:
        user, stranger = httpx.Client(base_url=url, timeout=30), httpx.Client(base_url=url, timeout=30)
        assert stranger.get("gradio_api/info").status_code == 401               # Gradio's own routes
        assert stranger.post("login", data={"username": "ada", "password": "wrong"}).status_code == 400
        assert user.post("login", data={"username": "ada", "password": "lovelace"}).status_code == 200
        config = user.get("config").json()
        kv_map = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "kv-map")
        load = next(i for i, d in enumerate(config["dependencies"]) if kv_map in d["outputs"])
        panel = user.post("gradio_api/run/predict", json={"data": [None], "fn_index": load, "session_hash": "ada1",
                                                          "event_data": None, "trigger_id": None}).json()["data"][0]
        tab = re.search(r'data-tab="([^"]+)"', panel).group(1)
        params = {"tab": tab, "since": ""}
        assert user.get("playground/map", params=params).status_code == 200
        refused = stranger.get("playground/map", params=params)
        assert refused.status_code == 401 and "kv-map" not in refused.text
        forger = httpx.Client(base_url=url, timeout=30, cookies={"access-token-unsecure-x": "forged"})
        assert forger.get("playground/map", params=params).status_code == 401
        assert user.get("playground/panels", params={"tab": tab}).status_code == 200       # the other panels' route
        refused = stranger.get("playground/panels", params={"tab": tab})
        assert refused.status_code == 401 and "engine-panel" not in refused.text
        assert forger.get("playground/panels", params={"tab": tab}).status_code == 401
    finally:
        demo.close()
        demo.playground_monitor.close()


def test_gradios_queue_does_not_wake_the_server_every_millisecond(app):
    """Gradio 6's queue (gradio/queueing.py, ``Queue.__init__``: ``sleep_when_free = 0.001``,
    ``progress_update_sleep_when_free = 0.01`` off Windows) looks for work ~1,100 times a second,
    idle or not, on the cores the engine decodes with; the app slows those loops down (the chats
    through the queue in this module still run)."""
    demo, _ = app
    assert demo._queue.sleep_when_free >= 0.02
    assert demo._queue.progress_update_sleep_when_free >= 0.25


@contextlib.contextmanager
def handlers_on(engine):
    """The app's ``Handlers`` on ``engine``, with an engine monitor of their own (closed after)."""
    from playground.handlers import Handlers
    from playground.monitor import EngineMonitor

    monitor = EngineMonitor(engine, interval=0.1)
    try:
        yield Handlers(engine, monitor, Limits())
    finally:
        monitor.close()


def streamed_updates(engine, message: str, max_tokens: int) -> list:
    """Every update one chat's ``Handlers.send`` yields, on its own monitor."""
    from playground.chat import ChatSession

    with handlers_on(engine) as h:
        return list(h.send(message, ChatSession(), SYSTEM, *greedy(max_tokens), "chat"))


def test_the_prefix_panel_follows_the_engine_while_a_reply_streams(paced_engine):
    """Gradio's page re-applies every output of a streamed update (the stream's own value, not the
    panels' timer's newer one), so the prefix panel's engine-wide stats sent once at the start
    stayed there for the whole reply (KV usage 0.0 % beside a map of used blocks). Streamed
    updates now redraw it about once a second: the KV usage it shows grows with the reply."""
    updates = streamed_updates(paced_engine, "Tell me a long story about a dragon.", 48)
    usage = [re.search(r'data-stat="KV usage"><td>KV usage</td><td><b>([\d.]+)%', u[3]).group(1)
             for u in updates[1:-1] if isinstance(u[3], str) and 'class="cached-tokens"' in u[3]]
    assert len(set(usage)) >= 2, usage


def test_replies_streaming_at_once_share_one_budget_of_updates(paced_engine):
    """Every streamed update is a step of a Gradio event on the cores the engine decodes with.
    Each reply sent 5 a second however many streamed, so four tabs made the server send 20 a
    second; now the replies streaming at once share 12 a second (a lone reply keeps 5)."""
    from playground.chat import ChatSession
    from playground.handlers import CHAT_UPDATES_PER_S_ALL

    gaps: list[list[float]] = [[] for _ in range(4)]

    def chat(h, i: int) -> None:
        last = None
        for _ in h.send(f"Count from one to {20 + i}.", ChatSession(), SYSTEM, *greedy(24), "chat"):
            now = time.monotonic()
            if last is not None:
                gaps[i].append(now - last)
            last = now

    with handlers_on(paced_engine) as h:
        threads = [threading.Thread(target=chat, args=(h, i)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert h.update_period() == pytest.approx(0.2)                  # none streaming: a lone reply's pace
    streamed = [g[1:-1] for g in gaps]                               # between the first and the last update
    assert all(len(g) >= 3 for g in streamed)
    median = sorted(x for g in streamed for x in g)[sum(len(g) for g in streamed) // 2]
    assert median >= 0.9 * 4 / CHAT_UPDATES_PER_S_ALL               # about 3 a second each, not 5


def test_a_replys_last_update_goes_out_when_it_ends_not_a_period_later(paced_engine, monkeypatch):
    """Between two updates a reply's stream waited out the whole update period (up to 0.67 s with
    eight replies streaming), even when the reply ended meanwhile: its final state reached the page
    that much late. The wait now ends with the reply."""
    from playground.chat import ChatSession
    from playground.handlers import Handlers

    monkeypatch.setattr(Handlers, "update_period", lambda self: 3.0)
    finished = []
    unsubscribe = paced_engine.subscribe(
        lambda e: e.kind == "request_finished" and finished.append(time.monotonic()))
    try:
        with handlers_on(paced_engine) as h:
            updates = [(time.monotonic(), u) for u in h.send("Say hi.", ChatSession(), SYSTEM, *greedy(4), "chat")]
    finally:
        unsubscribe()
    assert finished and len(updates) >= 2
    assert updates[-1][0] - finished[-1] < 1.0, updates[-1][0] - finished[-1]   # was ~2.5 s (3 s - the reply)


def test_streamed_updates_skip_only_the_message_box(paced_engine):
    """Each gr.skip() in a streamed update made Gradio build a new component on the server (several
    updates a second for every streaming tab); unchanged outputs are sent again instead (Gradio diffs a stream's values, so they cost nothing on the wire). Only the
    message box is skipped: the visitor may be typing there."""
    updates = streamed_updates(paced_engine, "Count from one to ten.", 12)
    skip = {"__type__": "update"}
    streamed = updates[1:-1]
    assert len(streamed) >= 3
    assert all([i for i, v in enumerate(u) if v == skip] == [1] for u in streamed)
    assert all(isinstance(u[2], str) and isinstance(u[3], str) for u in streamed)   # logprobs, prefix panel


def test_the_panels_are_drawn_again_only_when_something_changed(smollm2_llm):
    """Every open tab asks for its panels once a second. Unchanged panels are the same drawing
    again (the tab's cached one), not drawn anew; the timeline, the same for every tab, is drawn at
    most once a second for all of them; and the page's load event gets the same panels, each in
    the wrapper the page's script fills, never ``gr.skip()`` (Gradio 6.31 answers a skip by
    building a new component and its config, ``Blocks.postprocess_data``)."""
    from playground.chat import ChatSession

    with handlers_on(smollm2_llm) as h:
        tabs = [ChatSession(), ChatSession()]
        first = [h.panels(tab) for tab in tabs]
        again = [h.panels(tab) for tab in tabs]
        assert all(isinstance(v, str) and v for out in first + again for k, v in out.items() if k != "timeline")
        for name in ("prefix-panel", "engine-panel", "block-inspector"):
            assert again[0][name] is first[0][name]                            # nothing changed: the same drawing
        figures = [out["timeline"]["plotly"] for out in first + again]         # Plotly's JSON: data and layout
        assert all(set(f) >= {"data", "layout"} for f in figures)
        if figures[2] is figures[3]:                                           # the same second
            assert figures[2] is figures[1] or figures[2] is figures[0]
        loaded = h.refresh_panels(tabs[0])
        panels = h.panels(tabs[0])
        assert loaded[:2] + loaded[3:] == tuple(wrap(k, v) for k, v in panels.items() if k != "timeline")
        assert json.loads(loaded[2]["plot"]) == panels["timeline"]["plotly"]    # gr.Plot's value: the same figure
        list(h.send("Hi", tabs[0], SYSTEM, *greedy(4), "chat"))
        after = h.panels(tabs[0])
        assert after["prefix-panel"] != first[0]["prefix-panel"]             # this turn now shows


def test_the_block_inspector_follows_the_engine_after_the_click(paced_engine):
    """Found in Chromium: a block clicked while a reply used it still said "used", owned by "this
    chat", after the reply had ended, beside a map that showed it cached: the inspector was drawn
    once, at the click. The panels' timer now redraws it from the latest snapshot."""
    from playground.chat import ChatSession

    with handlers_on(paced_engine) as h:
        tab = ChatSession()
        chat = threading.Thread(target=lambda: list(h.send("Tell me a story.", tab, SYSTEM, *greedy(24), "chat")))
        chat.start()
        try:
            deadline, used = time.monotonic() + 60, []
            while not used and time.monotonic() < deadline:
                time.sleep(0.05)
                used = [b["block_id"] for b in h.monitor.refresh()["blocks"] if b["ref_cnt"] and b.get("hashed")]
            assert used, "the reply never held a full block"
            clicked = h.inspect_block(tab, gr_event({"block": used[0]}))
            assert re.search(r"<td>state</td><td><b>used</b>", clicked), clicked
            chat.join(120)
            h.monitor.wait_idle()
            inspector = h.refresh_panels(tab)[3]
            assert f'data-block="{used[0]}"' in inspector
            assert re.search(r"<td>state</td><td><b>cached, reusable</b>", inspector), inspector
        finally:
            h.stop(tab)
            chat.join(60)


def gr_event(data: dict):
    """A ``gr.EventData`` as Gradio builds it for a custom ``trigger('click', data)``."""
    import gradio as gr

    return gr.EventData(None, data)


def test_a_map_poll_that_finds_no_change_draws_nothing():
    """Every open tab polls the map's route five times a second, on the cores the engine decodes
    with. The route drew the tab's map (legend, colours, the page's HTML) for every poll and only
    then compared keys, so a 204 cost a drawing; now it compares the map's key first."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from playground.chat import ChatSession
    from playground.live_map import LiveMap

    drawn, version = [], {"v": 1}

    def draw(session, css):
        drawn.append(css)
        return f'<div class="pg-panel kv-map">v{version["v"]}</div>', str(version["v"])

    live = LiveMap(draw, 0.2, key=lambda session: str(version["v"]))
    app = Starlette(routes=[live.route()])
    app.auth = app.auth_dependency = None            # as Gradio's App without a login (gradio/routes.py)
    app.tokens = {}
    tab = ChatSession()
    live.html(tab)                                   # the page's load event: one drawing
    client = TestClient(app)
    for _ in range(5):
        assert client.get("/playground/map", params={"tab": tab.map_token, "since": "1"}).status_code == 204
    assert drawn == [True]
    version["v"] = 2
    changed = client.get("/playground/map", params={"tab": tab.map_token, "since": "1"})
    assert changed.status_code == 200 and changed.headers["X-Map-Key"] == "2" and "v2" in changed.text
    assert drawn == [True, False]


def test_chat_updates_and_panels_reach_the_page_without_a_thread_per_output(app, client, monkeypatch):
    """Gradio 6.31 postprocesses each output of each update in a worker thread of its own
    (``Blocks.postprocess_data``: ``anyio.to_thread.run_sync(block.postprocess, ...)``): six
    hand-offs per streamed chat update and four per drawing of the panels, on the cores the engine
    decodes with. The chat events and the panels' load event send values the page takes as they are
    (``postprocess=False``; the Chatbot's value is serialized in the handler's own thread)."""
    import anyio.to_thread

    demo, url = app
    hand_offs = []
    run_sync = anyio.to_thread.run_sync

    async def counting(fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "postprocess":
            hand_offs.append(type(getattr(fn, "__self__", None)).__name__)
        elif getattr(fn, "__name__", "") == "run_sync_iterator_async":   # one step of a plain generator
            hand_offs.append("next(stream)")
        return await run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    job = client.submit("Count from one to ten.", SYSTEM, *greedy(16), api_name="/chat")
    updates = list(job)
    chat, *_ = job.result()
    assert len(updates) >= 2 and reply_text(chat)                     # it streamed, and the page got the reply
    # Nor a hand-off per update to take the next one from the handler: Gradio 6.31 runs a plain
    # generator's every step in a worker thread (``utils.SyncToAsyncIterator.__anext__``:
    # ``run_sync(run_sync_iterator_async, ...)``); the stream comes from a thread of its own
    # (``tabs.on_loop_stream``).
    assert "next(stream)" not in hand_offs
    deps = client.config["dependencies"]
    panels_load = next(i for i, d in enumerate(deps) if len(d["outputs"]) == 4 and [t[1] for t in d["targets"]] == ["load"])
    panels = run_unqueued(client, panels_load, timeout=60)
    assert len(panels) == 4 and all(isinstance(p, str) and p for i, p in enumerate(panels) if i != 2)
    assert json.loads(panels[2]["plot"])["data"]                       # the timeline: gr.Plot's Plotly figure
    assert hand_offs == []


def test_a_stream_on_the_loop_keeps_order_errors_and_closes_its_generator():
    """``on_loop_stream``: the updates in order; an error of the handler raised where Gradio
    iterates; a stream left early (Stop, a closed tab) closes the generator in its own thread,
    so its ``finally`` (abort the request, free the tab's slot) runs."""
    closed = threading.Event()

    def updates(n, fail=False):
        try:
            for i in range(n):
                yield i
            if fail:
                raise gr.Error("refused")
        finally:
            closed.set()

    async def take(stream, limit=None):
        got = []
        async for value in stream:
            got.append(value)
            if limit is not None and len(got) == limit:
                await stream.aclose()
                break
        return got

    assert asyncio.run(take(on_loop_stream(updates(5)))) == [0, 1, 2, 3, 4] and closed.wait(5)
    closed.clear()
    with pytest.raises(gr.Error, match="refused"):
        asyncio.run(take(on_loop_stream(updates(2, fail=True))))
    assert closed.wait(5)
    closed.clear()
    assert asyncio.run(take(on_loop_stream(updates(10**9)), limit=3)) == [0, 1, 2]
    assert closed.wait(5)
