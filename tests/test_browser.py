"""The playground in a real browser: Playwright driving Debian's chromium."""

from __future__ import annotations

import os
import time

import pytest
from conftest import unavailable
from playwright.sync_api import expect, sync_playwright

from playground.app import build_app, launch

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.browser
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def app_url(smollm2_llm):
    demo = build_app(smollm2_llm, refresh_every=0.5)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    yield url
    demo.close()
    demo.playground_monitor.close()


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        unavailable(f"no {CHROMIUM}: install Debian's chromium (apt-get install -y chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, app_url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app_url)
    page.wait_for_selector("#kv-map .kv-cell")
    yield page
    if not page.is_closed():
        page.close()


def send(page, text: str) -> None:
    page.fill("#msg textarea", text)
    page.press("#msg textarea", "Enter")


def wait_engine_idle(llm, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    snap = llm.snapshot().to_dict()
    while snap["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
        snap = llm.snapshot().to_dict()
    return snap


def test_chat_reply_block_map_and_screenshot(page, smollm2_llm, tmp_path):
    step_before = int(page.get_attribute("#kv-map .kv-map", "data-step"))
    send(page, "Write a short poem about the sea.")
    # While the reply streams, the block map shows blocks owned by this chat, labelled in the legend.
    page.wait_for_selector('#kv-map .kv-cell.kv-used[data-owners^="chat-"]', timeout=30_000)
    expect(page.locator('#kv-map .kv-legend-item[data-kind="owner"]').first).to_contain_text("this chat")
    # The reply streams to its end (no cursor) and the logprob view shows its tokens.
    reply = page.locator('#chat [data-testid="bot"]').last
    expect(reply).not_to_contain_text("▌", timeout=120_000)
    assert len(reply.inner_text().strip()) > 10
    n_tokens = page.locator("#logprobs .lp-tok").count()
    assert n_tokens > 5
    # Afterwards the blocks are released to the prefix cache and the map moved on.
    expect(page.locator('#kv-map .kv-cell[data-owners^="chat-"]')).to_have_count(0, timeout=10_000)
    assert int(page.get_attribute("#kv-map .kv-map", "data-step")) > step_before
    # Hovering a token shows its alternatives and the entropy.
    token = page.locator("#logprobs .lp-tok").nth(1)
    token.hover()
    tip = token.locator(".lp-tip")
    expect(tip).to_be_visible()
    expect(tip).to_contain_text("%")
    expect(tip).to_contain_text("entropy")
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    assert (tmp_path / "playground.png").stat().st_size > 50_000


def test_click_a_token_and_branch(page, smollm2_llm):
    send(page, "What is the capital of France?")
    page.wait_for_selector('#chat [data-testid="bot"]', timeout=30_000)
    expect(page.locator('#chat [data-testid="bot"]').last).not_to_contain_text("▌", timeout=120_000)
    page.locator('#logprobs .lp-tok[data-index="1"]').click()
    # The click selects the token and offers its alternatives.
    expect(page.locator('#logprobs .lp-tok.lp-selected[data-index="1"]')).to_have_count(1, timeout=10_000)
    expect(page.locator("#branch")).to_be_enabled()
    page.click("#branch")
    expect(page.locator('#logprobs .lp-tok.lp-forced[data-index="1"]')).to_have_count(1, timeout=60_000)
    expect(page.locator('#chat [data-testid="bot"]')).to_have_count(1)
    expect(page.locator('#chat [data-testid="bot"]').last).not_to_contain_text("▌", timeout=60_000)
    # The branch's prompt (conversation + kept tokens) came from the prefix cache.
    cached = int(page.inner_text("#prefix-panel .cached-tokens"))
    assert cached >= 16


def test_closing_the_tab_mid_stream_aborts_its_request(page, smollm2_llm):
    finished = []
    unsubscribe = smollm2_llm.subscribe(
        lambda e: finished.append(e.data) if e.kind == "request_finished" else None)
    try:
        send(page, "Count from one to two hundred in words, one number per line.")
        page.wait_for_selector('#chat [data-testid="bot"]', timeout=30_000)
        deadline = time.monotonic() + 30
        while not smollm2_llm.snapshot().requests and time.monotonic() < deadline:
            time.sleep(0.05)
        rid = smollm2_llm.snapshot().requests[0].request_id
        page.close()
        snap = wait_engine_idle(smollm2_llm)
    finally:
        unsubscribe()
    assert not snap["requests"]
    assert not [b for b in snap["blocks"] if b["ref_cnt"] > 0]
    reasons = {d["request_id"]: d["finish_reason"] for d in finished}
    assert reasons[rid] == "abort"
