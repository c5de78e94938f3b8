"""The playground in a real browser: Playwright driving Debian's chromium."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
from conftest import unavailable
from playwright.sync_api import expect, sync_playwright

from playground.app import build_app, launch

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.browser
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def app_url(smollm2_llm):
    with serving(smollm2_llm) as url:
        yield url


@contextlib.contextmanager
def serving(llm, **build_kwargs):
    """The playground on ``llm`` served in this process (its URL); closed, with its monitor, after."""
    demo = build_app(llm, refresh_every=0.5, **build_kwargs)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    try:
        yield url
    finally:
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
    wait_restored(page)
    yield page
    if not page.is_closed():
        page.close()


def wait_restored(page) -> None:
    """The page's load events have run (the conversations list is filled): what a visitor sees as ready."""
    expect(page.locator("#conv-list label")).not_to_have_count(0, timeout=30_000)


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


def test_chat_reply_block_map_and_screenshot(page, paced_engine, tmp_path):
    step_before = int(page.get_attribute("#kv-map .kv-map", "data-step"))
    send(page, "Write a short poem about the sea.")
    # While the reply streams, the block map shows blocks owned by this chat, labelled in the legend.
    page.wait_for_selector('#kv-map .kv-cell.kv-used[data-owners^="chat-"]', timeout=30_000)
    expect(page.locator('#kv-map .kv-legend-item[data-kind="owner"]').first).to_contain_text("this chat")
    # The reply streams to its end (no cursor) and the logprob view shows its tokens.
    reply = page.locator('#chat [data-testid="bot"]').last
    expect(reply.locator(".pg-finish")).to_have_count(1, timeout=120_000)
    expect(reply).not_to_contain_text("▌")
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
    bot = page.locator('#chat [data-testid="bot"]')
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=120_000)
    original = bot.last.locator("p").first.inner_text()
    page.locator('#logprobs .lp-tok[data-index="1"]').click()
    # The click selects the token and offers its alternatives.
    expect(page.locator('#logprobs .lp-tok.lp-selected[data-index="1"]')).to_have_count(1, timeout=10_000)
    expect(page.locator("#branch")).to_be_enabled()
    page.click("#branch")
    expect(page.locator('#logprobs .lp-tok.lp-forced[data-index="1"]')).to_have_count(1, timeout=60_000)
    expect(bot).to_have_count(1)
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=60_000)
    # The branch's prompt (conversation + kept tokens) came from the prefix cache.
    cached = int(page.inner_text("#prefix-panel .cached-tokens"))
    assert cached >= 16
    # The original is kept: ‹ 2/2 › under the reply moves between the two branches.
    expect(bot.last.locator(".pg-pos")).to_have_text("2/2")
    branched = bot.last.locator("p").first.inner_text()
    assert branched != original
    bot.last.locator(".pg-nav.pg-prev").click()
    expect(bot.last.locator(".pg-pos")).to_have_text("1/2", timeout=10_000)
    expect(bot.last.locator("p").first).to_have_text(original)
    expect(page.locator("#logprobs .lp-tok.lp-forced")).to_have_count(0, timeout=10_000)  # its own logprobs
    bot.last.locator(".pg-nav.pg-next").click()
    expect(bot.last.locator(".pg-pos")).to_have_text("2/2", timeout=10_000)
    expect(bot.last.locator("p").first).to_have_text(branched)
    # The compare view puts both branches' logprob strips side by side, parting at the branch token.
    page.locator("#compare-box").get_by_text("Compare branches").click()
    page.click("#compare")
    expect(page.locator("#compare-view .compare-split")).to_have_attribute("data-split", "1", timeout=10_000)
    expect(page.locator("#compare-view .compare-col")).to_have_count(2)


def test_stop_marks_the_reply_and_removes_the_cursor(page, paced_engine):
    greedy_long_replies(page)
    send(page, "Count from one to two hundred in words, one number per line.")
    bot = page.locator('#chat [data-testid="bot"]').last
    expect(bot.locator(".pg-state")).to_have_text("decoding", timeout=60_000)
    page.click("#stop")
    expect(bot).to_contain_text("(stopped)", timeout=10_000)
    expect(bot).not_to_contain_text("▌")
    expect(bot.locator(".pg-finish-abort")).to_have_count(1)
    page.wait_for_timeout(1500)                 # no late streamed update brings the cursor back
    expect(bot).not_to_contain_text("▌")
    assert page.inner_text("#stop").strip() == "Stop"
    wait_engine_idle(paced_engine)


def set_number(page, label: str, value: str) -> None:
    """Type ``value`` into the sampling control ``label``, opening the controls if they are shut."""
    box = page.get_by_label(f"number input for {label}")
    if not box.is_visible():
        page.get_by_text("Mode, system prompt and sampling").click()
    # On a loaded machine the accordion's controls can still be mounting when the first fill
    # lands, and a remounted input shows its initial value again: fill until the value holds.
    for _ in range(3):
        box.fill(value)
        box.press("Tab")
        page.wait_for_timeout(300)
        if box.input_value() == value:
            break
    expect(box).to_have_value(value)


def greedy_long_replies(page) -> None:
    """Greedy sampling and room for long replies (the page's defaults sample at temperature 0.7)."""
    for label, value in (("temperature", "0"), ("max tokens", "200")):
        set_number(page, label, value)


def test_typing_during_a_reply_is_kept_and_the_message_is_queued(page, paced_engine):
    greedy_long_replies(page)
    send(page, "Count from one to forty in words, one number per line.")
    bot = page.locator('#chat [data-testid="bot"]')
    expect(bot.last.locator(".pg-state")).to_have_text("decoding", timeout=60_000)
    page.fill("#msg textarea", "And now in French?")
    page.wait_for_timeout(1500)                  # several streamed updates arrive meanwhile
    assert page.input_value("#msg textarea") == "And now in French?"
    page.press("#msg textarea", "Enter")
    # The message shows at once and is answered after the first reply.
    expect(page.locator('#chat [data-testid="user"]')).to_have_count(2, timeout=5_000)
    expect(bot).to_have_count(2, timeout=120_000)
    expect(bot.nth(1).locator(".pg-finish")).to_have_count(1, timeout=120_000)
    expect(bot.nth(0).locator(".pg-finish")).to_have_count(1)
    assert page.input_value("#msg textarea") == ""


def test_stop_with_a_queued_follow_up_withdraws_it_and_nothing_is_left_running(page, paced_engine):
    """Stop while a follow-up waits: the reply stops, the follow-up is taken back into the message box
    (it used to run unseen and stay "queued" forever, then enter later prompts), and a later message
    is answered normally."""
    started = []
    unsubscribe = paced_engine.subscribe(lambda e: started.append(e.data) if e.kind == "request_added" else None)
    try:
        greedy_long_replies(page)
        send(page, "Count from one to two hundred in words, one number per line.")
        bot = page.locator('#chat [data-testid="bot"]')
        expect(bot.last.locator(".pg-state")).to_have_text("decoding", timeout=60_000)
        send(page, "And now in French?")
        expect(page.locator('#chat [data-testid="user"]')).to_have_count(2, timeout=5_000)
        page.click("#stop")
        expect(bot.last).to_contain_text("(stopped)", timeout=10_000)
        expect(page.locator('#chat [data-testid="user"]')).to_have_count(1, timeout=10_000)
        expect(page.locator("#msg textarea")).to_have_value("And now in French?")
        page.wait_for_timeout(2000)         # the withdrawn message must not start meanwhile
        assert len(started) == 1 and not paced_engine.snapshot().requests, started
        assert "queued" not in page.inner_text("#chat")
        send(page, "Say hi.")
        expect(bot).to_have_count(2, timeout=60_000)
        expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=120_000)
        assert "And now in French" not in page.inner_text("#chat")
    finally:
        unsubscribe()
    wait_engine_idle(paced_engine)


def test_closing_the_tab_mid_stream_aborts_its_request(page, paced_engine):
    finished = []
    unsubscribe = paced_engine.subscribe(
        lambda e: finished.append(e.data) if e.kind == "request_finished" else None)
    try:
        send(page, "Count from one to two hundred in words, one number per line.")
        page.wait_for_selector('#chat [data-testid="bot"]', timeout=30_000)
        deadline = time.monotonic() + 30
        while not paced_engine.snapshot().requests and time.monotonic() < deadline:
            time.sleep(0.05)
        rid = paced_engine.snapshot().requests[0].request_id
        page.close()
        snap = wait_engine_idle(paced_engine)
    finally:
        unsubscribe()
    assert not snap["requests"]
    assert not [b for b in snap["blocks"] if b["ref_cnt"] > 0]
    reasons = {d["request_id"]: d["finish_reason"] for d in finished}
    assert reasons[rid] == "abort"


def test_block_inspector_and_legend_highlight(page, paced_engine):
    send(page, "Write a short poem about the sea.")
    cell = page.locator('#kv-map .kv-cell.kv-used[data-owners^="chat-"]').first
    cell.wait_for(timeout=30_000)
    # Hovering this chat's legend entry outlines exactly its blocks.
    legend = page.locator('#kv-map .kv-legend-item[data-kind="owner"]', has_text="this chat")
    legend.hover()
    n_owned = int(legend.inner_text().rsplit("(", 1)[1].rstrip(")"))
    page.wait_for_function("document.querySelectorAll('#kv-map .kv-grid.kv-dim .kv-cell.kv-hl').length > 0",
                           timeout=5_000)
    highlighted = page.locator("#kv-map .kv-grid.kv-dim .kv-cell.kv-hl").count()
    assert highlighted >= 1 and abs(highlighted - n_owned) <= 1      # the map may move on by a block
    # Clicking a block of this chat shows its state, owner and the text of its tokens.
    page.locator('#kv-map .kv-cell.kv-used[data-owners^="chat-"]').first.click()
    inspector = page.locator("#block-inspector .block-inspector")
    expect(inspector).to_contain_text("this chat", timeout=10_000)
    expect(inspector.locator('tr[data-field="state"]')).to_contain_text("used")
    assert len(inspector.locator(".block-text").inner_text()) > 5
    expect(page.locator('#chat [data-testid="bot"]').last.locator(".pg-finish")).to_have_count(1, timeout=120_000)
    wait_engine_idle(paced_engine)
    # A finished chat's full blocks stay in the prefix cache: reusable, no owner.
    page.locator("#kv-map .kv-cell.kv-cached").first.click()
    expect(inspector).to_contain_text("cached, reusable", timeout=10_000)


def test_the_panels_follow_the_engine_from_their_route(page, paced_engine):
    """No Gradio timer on the page: its script asks the panels' route once a second and fills
    each panel's wrapper, so the engine panel and the timeline (on the Engine tab, opened after
    the chat) show the chat's steps, and Gradio's own routes see no refresh traffic."""
    polls, gradio_calls = [], []
    page.on("request", lambda r: polls.append(r.url) if "/playground/panels" in r.url else
            gradio_calls.append(r.url) if "/run/predict" in r.url or "/queue/join" in r.url else None)
    page.wait_for_selector("#kv-map .kv-live[data-tab]")       # the page's load events have drawn it
    page.wait_for_timeout(1000)                                 # (Playwright delivers events while it waits)
    polls.clear(), gradio_calls.clear()
    page.click("button[role=tab]:has-text('Engine')")
    engine = page.locator("#engine-panel .live-panel")
    before = engine.inner_html()
    deadline = time.monotonic() + 10                            # once a second, after each answer
    while len(polls) < 2 and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    assert len(polls) >= 2 and not gradio_calls                 # polled; nothing through Gradio meanwhile
    send(page, "Write a short poem about the sea.")
    expect(page.locator('#chat [data-testid="bot"]').last.locator(".pg-finish")).to_have_count(1, timeout=120_000)
    page.wait_for_function(
        "before => document.querySelector('#engine-panel .live-panel').innerHTML !== before", arg=before,
        timeout=10_000)
    expect(page.locator("#timeline .cartesianlayer .subplot")).to_have_count(6)   # its six charts, refreshed


def test_on_a_phone_a_sticky_mini_map_follows_the_chat(browser, app_url, paced_engine, tmp_path):
    """On a narrow screen the columns stack and the block map is far below the chat: a mini-map
    stays at the top of the screen while the chat scrolls, mirrors the map, and a tap on it
    scrolls to the full map. Wide screens do not show it."""
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    phone = context.new_page()
    try:
        phone.goto(app_url)
        phone.wait_for_selector("#kv-map .kv-cell")
        wait_restored(phone)
        send(phone, "Describe Rome in three short paragraphs.")
        phone.wait_for_selector('#kv-map .kv-cell.kv-used[data-owners^="chat-"]', timeout=60_000)
        phone.locator("#stop").scroll_into_view_if_needed()          # down the chat, past the header
        mini = phone.locator("#kv-mini")
        expect(mini.locator('.kv-cell.kv-used[data-owners^="chat-"]').first).to_be_visible(timeout=10_000)
        box = mini.bounding_box()
        assert box["y"] >= -1 and box["y"] + box["height"] <= 844 * 0.2, box   # on screen, and small
        assert mini.locator(".kv-cell").count() == phone.locator("#kv-map .kv-cell").count()
        phone.screenshot(path=str(tmp_path / "phone.png"))
        mini.tap()
        phone.wait_for_function("Math.abs(document.querySelector('#kv-map').getBoundingClientRect().top) < 250",
                                timeout=10_000)
        phone.click("#stop")
    finally:
        context.close()
    wide = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        wide.goto(app_url)
        wide.wait_for_selector("#kv-map .kv-cell")
        wait_restored(wide)
        expect(wide.locator("#kv-mini")).to_be_hidden()
    finally:
        wide.close()
    wait_engine_idle(paced_engine)


def test_on_a_phone_a_tap_shows_the_alternatives(browser, app_url, smollm2_llm):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    phone = context.new_page()
    try:
        phone.goto(app_url)
        phone.wait_for_selector("#kv-map .kv-cell")
        wait_restored(phone)
        send(phone, "What is the capital of France?")
        expect(phone.locator('#chat [data-testid="bot"]').last.locator(".pg-finish")).to_have_count(1,
                                                                                                  timeout=120_000)
        expect(phone.locator("#logprobs .lp-hint-tap")).to_be_visible()       # the hint says "tap" there
        expect(phone.locator("#logprobs .lp-hint-hover")).to_be_hidden()
        phone.locator('#logprobs .lp-tok[data-index="2"]').tap()
        expect(phone.locator("#logprobs .lp-tok.lp-selected .lp-tip")).to_be_visible(timeout=10_000)
        expect(phone.locator("#logprobs .lp-tok.lp-selected .lp-tip")).to_contain_text("%")
    finally:
        context.close()
    wait_engine_idle(smollm2_llm)


def test_a_refused_message_keeps_the_conversation_in_view(page, smollm2_llm):
    """A message over the length limit is refused with a toast naming the limit; the chat keeps
    showing the conversation (Gradio used to cover every output of the event, the whole chat
    included, with an "Error" badge) and the message stays in the box to be shortened."""
    send(page, "Say hi.")
    bot = page.locator('#chat [data-testid="bot"]')
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=120_000)
    send(page, "x" * 5000)
    expect(page.get_by_text("the limit is 4000").first).to_be_visible(timeout=10_000)
    time.sleep(1)
    expect(bot).to_have_count(1)
    expect(bot.last).to_be_visible()
    expect(page.locator("#chat").get_by_text("Error", exact=True)).to_have_count(0)
    assert page.input_value("#msg textarea") == "x" * 5000
    wait_engine_idle(smollm2_llm)


def test_the_system_prompt_is_editable_in_chat_mode_only(page):
    """Completion prompts are the conversation's text alone: the system prompt box says so and is
    read-only in completion mode (it looked as if it applied)."""
    page.get_by_text("Mode, system prompt and sampling").click()
    box = page.locator("#system textarea")
    expect(box).to_be_editable(timeout=10_000)
    page.locator("#mode").get_by_text("completion", exact=True).click()
    expect(box).not_to_be_editable(timeout=10_000)
    page.locator("#mode").get_by_text("chat", exact=True).click()
    expect(box).to_be_editable(timeout=10_000)


# JupyterLab 4's rules for an HTML output (@jupyterlab/rendermime/style/base.css and
# @jupyterlab/outputarea/style/base.css), the ones that reach a table inside it.
JUPYTERLAB_OUTPUT_CSS = """
.jp-OutputArea-output{width:600px;height:auto;overflow:auto}
.jp-RenderedHTMLCommon td,.jp-RenderedHTMLCommon th,.jp-RenderedHTMLCommon tr{vertical-align:middle;
 padding:0.5em;line-height:normal;white-space:normal;max-width:none;border:none}
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td{text-align:right}
.jp-RenderedHTMLCommon tbody tr:nth-child(odd){background:#ffffff}
.jp-RenderedHTMLCommon tbody tr:nth-child(even){background:#eeeeee}
"""


def test_notebook_logprob_tooltips_fit_a_jupyterlab_output(browser):
    """Bug 9: in JupyterLab the hover table was clipped by the output area, striped, and its cells
    wrapped ("74.08" / "%", "wid" / "e") under JupyterLab's ``white-space: normal`` for tables."""
    from playground.logprobs import token_records
    from playground.notebook import _logprob_view

    words = [" the", " sea", " is", " wide", "."]
    lps = [{i: {"logprob": -0.3 - 0.7 * i, "rank": i + 1, "decoded_token": w} for i, w in enumerate(words)}
           for _ in range(40)]
    html = _logprob_view(token_records([0] * 40, lps))
    page = browser.new_page(viewport={"width": 700, "height": 600})
    try:
        page.set_content(f"<style>{JUPYTERLAB_OUTPUT_CSS}</style>"
                         f'<div class="jp-OutputArea-output jp-RenderedHTMLCommon">{html}</div>')
        page.locator(".lp-tok").last.hover()
        tip = page.locator(".lp-tok").last.locator(".lp-tip")
        expect(tip).to_be_visible()
        area, box = page.locator(".jp-OutputArea-output").bounding_box(), tip.bounding_box()
        assert box["y"] + box["height"] <= area["y"] + area["height"], "the table is cut by the output area"
        rows = tip.locator("tr")
        heights = [rows.nth(i).bounding_box()["height"] for i in range(rows.count())]
        assert max(heights) < 1.6 * min(heights), f"a cell wraps: row heights {heights}"
        backgrounds = {rows.nth(i).evaluate("r => getComputedStyle(r).backgroundColor") for i in range(2)}
        assert backgrounds == {"rgba(0, 0, 0, 0)"}, backgrounds
    finally:
        page.close()
