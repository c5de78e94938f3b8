"""The playground's views in Chromium (issue 32): the Plotly timeline, the panels that follow the
branch shown, tap targets on a phone, the named API, Stop and Branch that say what they need.

Playwright on Debian's chromium, at 1440x900 and at a phone's 390x844. The app is built on the
shared engine after the start-up warm-up (``playground.__main__._warm_up``), as a fresh
``python -m playground`` serves it.
"""

from __future__ import annotations

import re

import gradio_client
import pytest
from playwright.sync_api import expect
from test_browser import CHROMIUM, CHROMIUM_ARGS, browser, greedy_long_replies, send, wait_engine_idle  # noqa: F401  (fixtures)

from playground.__main__ import _warm_up
from playground.app import build_app, launch

pytestmark = pytest.mark.browser
DESKTOP = {"width": 1440, "height": 900}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def fresh_url(smollm2_llm):
    wait_engine_idle(smollm2_llm)
    _warm_up(smollm2_llm)              # what python -m playground does before the URL
    demo = build_app(smollm2_llm, refresh_every=0.5)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    yield url
    demo.close()
    demo.playground_monitor.close()


def open_page(browser, url, viewport=DESKTOP):  # noqa: F811
    page = browser.new_page(viewport=viewport, has_touch=viewport is PHONE, is_mobile=viewport is PHONE)
    page.goto(url)
    page.wait_for_selector("#kv-map .kv-cell")
    page.wait_for_selector("#kv-map .kv-live[data-tab]")
    expect(page.locator("#conv-list label")).not_to_have_count(0, timeout=30_000)   # the page restored
    if viewport is PHONE and page.locator("#conv-sidebar.open").count():
        page.get_by_role("button", name="Toggle Sidebar").click()     # a phone's page under it
        expect(page.locator("#conv-sidebar.open")).to_have_count(0)
    return page


def finished(page, count=None):
    bot = page.locator('#chat [data-testid="bot"]')
    if count:
        expect(bot).to_have_count(count, timeout=120_000)
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=120_000)
    return bot


def wait_until(page, condition, timeout_ms: int) -> None:
    """Let the page run (its events reach the test's handlers) until ``condition()`` holds."""
    for _ in range(timeout_ms // 100):
        if condition():
            return
        page.wait_for_timeout(100)
    assert condition(), f"not within {timeout_ms} ms"


def open_tab(page, name):
    page.locator("button[role=tab]", has_text=name).first.click()


def plot(page, script):
    """``script`` (a function of the timeline's Plotly graph div) evaluated in the page."""
    return page.evaluate(f"(() => {{ const gd = document.querySelector('#timeline .js-plotly-plot'); "
                         f"return gd ? ({script})(gd) : null; }})()")


def test_a_fresh_start_shows_none_of_the_warm_up(browser, fresh_url):  # noqa: F811
    page = open_page(browser, fresh_url)
    assert page.get_attribute("#kv-map .kv-map", "data-step") == "0"
    expect(page.locator('#prefix-panel tr[data-stat="resets"] b')).to_have_text("0")
    expect(page.locator('#prefix-panel tr[data-stat="queried tokens"] b')).to_have_text("0")
    open_tab(page, "Engine")
    expect(page.locator("#engine-panel")).to_contain_text("TTFT · your last reply")
    expect(page.locator("#engine-panel")).to_contain_text("decode · your last reply")
    page.close()


def test_the_timeline_is_a_plotly_chart_with_gaps_hover_window_and_batch_hits(browser, fresh_url, smollm2_llm):  # noqa: F811
    page = open_page(browser, fresh_url)
    send(page, "Hi!")
    finished(page)
    open_tab(page, "Batch demo")
    page.get_by_role("button", name="Fire batch").click()
    expect(page.locator("#batch-view .batch-row[data-state=done]")).to_have_count(4, timeout=120_000)
    open_tab(page, "Engine")
    page.wait_for_selector("#timeline .js-plotly-plot", timeout=30_000)
    expect(page.locator("#timeline .cartesianlayer .subplot")).to_have_count(6)    # six charts, one time axis
    # Its every refresh comes from the panels' route; the batch's requests show their prefix hits.
    page.wait_for_function("""() => { const gd = document.querySelector('#timeline .js-plotly-plot');
        const t = gd && gd.data.find(t => t.name === 'request hit rate');
        return t && t.y.filter(v => v > 0).length >= 4; }""", timeout=15_000)
    lines = plot(page, "gd => gd.data.filter(t => t.mode === 'lines').map(t => [t.line.shape, t.connectgaps])")
    assert lines and all(shape == "hv" and gaps is False for shape, gaps in lines)
    # Idle seconds are gaps (null), not a line down to zero and back.
    assert plot(page, "gd => gd.data.find(t => t.name === 'decode tok/s').y.some(v => v === null)")
    titles = plot(page, "gd => gd.layout.annotations.map(a => a.text)")
    assert any(re.match(r"TTFT \(ms\) · p50/p90/p99 [\d.]+/[\d.]+/[\d.]+ m?s", t) for t in titles), titles
    assert any(t.startswith("ITL (ms) · p50/p90/p99") for t in titles), titles
    # Hovering a request's point shows that point's own values.
    plot(page, "gd => gd.querySelector('.subplot.x5y5').scrollIntoView({block: 'center'})")
    box = page.locator("#timeline .js-plotly-plot").bounding_box()
    xy = plot(page, """gd => { const t = gd.data.findIndex(t => t.name === 'TTFT');
        const pt = gd.calcdata[t][gd.calcdata[t].length - 1]; const xa = gd._fullLayout.xaxis5, ya = gd._fullLayout.yaxis5;
        return [xa._offset + xa.l2p(pt.x), ya._offset + ya.l2p(pt.y)]; }""")
    page.mouse.move(box["x"] + xy[0], box["y"] + xy[1])
    expect(page.locator("#timeline .hoverlayer .hovertext")).to_contain_text("TTFT", timeout=5_000)
    # The window is the user's: 60 s redraws the axis over the last minute.
    page.locator("#timeline-window label", has_text="60 s").click()
    page.wait_for_function("""() => { const gd = document.querySelector('#timeline .js-plotly-plot');
        return gd && gd.layout.xaxis.range[0] === -60; }""", timeout=10_000)
    page.wait_for_timeout(1500)                                  # the route's refresh keeps that window
    assert plot(page, "gd => gd.layout.xaxis.range[0]") == -60
    page.close()
    wait_engine_idle(smollm2_llm)


def test_on_a_phone_tap_targets_and_chart_labels_are_big_enough(browser, fresh_url):  # noqa: F811
    page = open_page(browser, fresh_url, PHONE)
    cell = page.locator("#kv-map .kv-cell").first.bounding_box()
    assert cell["width"] >= 24 and cell["height"] >= 24, cell
    open_tab(page, "Engine")
    page.wait_for_selector("#timeline .js-plotly-plot .ytick text")
    sizes = page.eval_on_selector_all("#timeline .xtick text, #timeline .ytick text, #timeline .annotation-text",
                                      "els => els.map(e => e.getBoundingClientRect().height)")
    assert sizes and min(sizes) >= 11, sizes                     # ~12 px text, as drawn
    page.close()


def test_on_a_phone_branch_arrows_are_tappable_and_branch_scrolls_to_the_new_branch(browser, fresh_url, smollm2_llm):  # noqa: F811
    page = open_page(browser, fresh_url, PHONE)
    send(page, "What is the capital of France?")
    bot = finished(page)
    page.locator('#logprobs .lp-tok[data-index="1"]').tap()
    expect(page.locator('#logprobs .lp-tok.lp-selected')).to_have_count(1, timeout=10_000)
    page.locator("#branch").scroll_into_view_if_needed()
    page.locator("#branch").tap()
    expect(bot.last.locator(".pg-pos")).to_have_text("2/2", timeout=60_000)
    page.wait_for_timeout(800)
    box = bot.last.bounding_box()
    assert box is not None and box["y"] < PHONE["height"] and box["y"] + box["height"] > 0, box   # in view
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=60_000)
    arrow = bot.last.locator(".pg-nav.pg-prev").bounding_box()
    assert arrow["width"] >= 24 and arrow["height"] >= 24, arrow
    page.close()
    wait_engine_idle(smollm2_llm)


def test_the_prefix_panel_follows_the_branch_shown(browser, fresh_url, smollm2_llm):  # noqa: F811
    page = open_page(browser, fresh_url)
    send(page, "Name a colour.")
    bot = finished(page)
    send(page, "Name another one.")
    finished(page, 2)
    expect(page.locator("#prefix-panel .hit-rate-chart rect.bar")).to_have_count(2, timeout=10_000)
    original = page.inner_text("#prefix-panel .cached-tokens")
    page.click("#regenerate")
    expect(bot.last.locator(".pg-pos")).to_have_text("2/2", timeout=60_000)
    finished(page, 2)
    # The shown branch has two replies (first turn, then the regenerated second): two bars, not three.
    expect(page.locator("#prefix-panel .hit-rate-chart rect.bar")).to_have_count(2, timeout=10_000)
    bot.last.locator(".pg-nav.pg-prev").click()
    expect(bot.last.locator(".pg-pos")).to_have_text("1/2", timeout=10_000)
    expect(page.locator("#prefix-panel .hit-rate-chart rect.bar")).to_have_count(2)
    expect(page.locator("#prefix-panel .cached-tokens")).to_have_text(original, timeout=10_000)   # this branch's turn
    page.close()
    wait_engine_idle(smollm2_llm)


def test_the_inspector_knows_the_tabs_own_blocks_and_batch_names_agree(browser, fresh_url, paced_engine):  # noqa: F811
    page = open_page(browser, fresh_url)
    smollm2_llm = paced_engine
    wait_engine_idle(smollm2_llm)
    smollm2_llm.reset_prefix_cache()                # the only cached blocks are this chat's
    send(page, "Write one sentence about rivers.")
    finished(page)
    wait_engine_idle(smollm2_llm)
    page.locator("#kv-map .kv-cell.kv-cached").first.wait_for(timeout=10_000)
    page.locator("#kv-map .kv-cell.kv-cached").first.click()
    inspector = page.locator("#block-inspector")
    expect(inspector).to_contain_text("cached, reusable", timeout=10_000)
    expect(inspector.locator(".block-text")).to_have_count(1)          # its text: this tab wrote it
    expect(inspector).to_contain_text("this chat")
    # The batch demo's requests are this tab's: named as the legend names them, never "another visitor's".
    open_tab(page, "Batch demo")
    page.get_by_role("button", name="Fire batch").click()
    page.wait_for_selector('#kv-map .kv-cell.kv-used[data-owners^="batch-"]', timeout=60_000)
    page.locator('#kv-map .kv-cell.kv-used[data-owners^="batch-"]').last.click()
    expect(inspector).to_contain_text("a request of this tab", timeout=10_000)
    expect(inspector).not_to_contain_text("Another visitor")
    owners = inspector.locator('tr[data-field="owners"] b').inner_text()
    legend = page.locator('#kv-map .kv-legend-item[data-kind="owner"][data-request^="batch-"]').all_inner_texts()
    expect(page.locator("#batch-view .batch-row[data-state=done]")).to_have_count(4, timeout=120_000)
    names = [t.strip() for t in page.locator("#batch-view .batch-name").all_inner_texts()]
    assert names == ["batch #1", "batch #2", "batch #3", "batch #4"]
    assert all(o.strip() in names for o in owners.split(",")), (owners, names)
    assert all(any(n in item for n in names) for item in legend), (legend, names)
    page.close()
    wait_engine_idle(smollm2_llm)


def test_stop_is_off_with_nothing_running_and_branch_asks_for_a_token(browser, fresh_url, paced_engine):  # noqa: F811
    page = open_page(browser, fresh_url)
    expect(page.locator("#stop")).to_be_disabled(timeout=15_000)
    greedy_long_replies(page)                          # 200 tokens at 0.1 s a step or more
    polls = []
    page.on("response", lambda r: polls.append(r) if "/playground/panels" in r.url else None)
    send(page, "Count from one to two hundred in words, one number per line.")
    expect(page.locator("#stop")).to_be_enabled(timeout=5_000)
    bot = page.locator('#chat [data-testid="bot"]')
    expect(bot.last.locator(".pg-state")).to_have_text("decoding", timeout=60_000)
    # The engine held between two of its steps (LLM.paused): the reply is still running, whatever the
    # machine's speed, while the page's script asks the panels' route three more times.
    with paced_engine.paused():
        asked = len(polls)
        wait_until(page, lambda: len(polls) >= asked + 3, 20_000)
        assert [r.json()["stop"] for r in polls[asked:]] == [{"disabled": False}] * (len(polls) - asked)
        expect(page.locator("#stop")).to_be_enabled()   # the route's word, not the click's
        assert bot.last.locator(".pg-finish").count() == 0
    finished(page)
    expect(page.locator("#stop")).to_be_disabled(timeout=15_000)
    page.click("#branch")                              # no token clicked
    toast = page.locator(".toast-body")
    expect(toast).to_contain_text("Click a token", timeout=10_000)
    expect(toast).not_to_contain_text("is missing")
    expect(bot).to_have_count(1)
    page.close()
    wait_engine_idle(paced_engine)


def test_the_api_page_names_every_parameter(browser, fresh_url):  # noqa: F811
    info = gradio_client.Client(fresh_url, verbose=False).view_api(return_format="dict", print_info=False)
    assert not info["unnamed_endpoints"]
    params = {name: [p["parameter_name"] for p in ep["parameters"]] for name, ep in info["named_endpoints"].items()}
    assert not [n for n in params if "lambda" in n], params
    assert params["/chat"][:3] == ["message", "system_prompt", "temperature"] and "top_p" in params["/chat"]
    assert params["/branch"][:2] == ["token_index", "alternative"]
    assert not [p for ps in params.values() for p in ps if p.startswith("param_")], params
    page = open_page(browser, fresh_url)
    page.get_by_text("Use via API").first.click()
    expect(page.get_by_text("/chat", exact=False).first).to_be_visible(timeout=30_000)
    expect(page.locator("body")).to_contain_text("message")
    expect(page.locator("body")).not_to_contain_text("param_0")
    expect(page.locator("body")).not_to_contain_text("lambda")
    page.close()
