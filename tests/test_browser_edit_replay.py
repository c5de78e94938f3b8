"""What an edit will cost, and the preemption replay, in a real browser (Playwright driving Debian's
chromium) at 1440x900 and 390x844, on a tiny engine with a small KV pool: the panel shows the
estimate while the message is edited in the chat, and after sending the same cached count as the
engine's prefix hits for that reply; the replay loads the engine's KV events, its counts equal the
engine's counters, and the slider moves the state to a preemption and its cause."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect
from test_browser import CHROMIUM, CHROMIUM_ARGS, browser, serving, set_number, wait_engine_idle  # noqa: F401  (fixtures)

from engine import LLM, SamplingParams
from tiny_models import make_tiny_model, tiny_prompts

pytestmark = pytest.mark.browser
VIEWPORTS = {"desktop": {"width": 1440, "height": 900}, "phone": {"width": 390, "height": 844}}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM", seed=3)
    llm = LLM(model=path, block_size=4, kv_cache_memory=24 * 2048)       # 24 blocks of 4 tokens
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def app_url(tiny_llm):
    with serving(tiny_llm, system_prompt="w1 w2 w3") as url:
        yield url


def open_page(browser, url, viewport):  # noqa: F811
    phone = viewport["width"] < 500
    page = browser.new_page(viewport=viewport, has_touch=phone, is_mobile=phone)
    page.goto(url)
    page.wait_for_selector("#kv-map .kv-cell")
    expect(page.locator("#conv-list label")).not_to_have_count(0, timeout=30_000)
    if phone and page.locator("#conv-sidebar.open").count():
        page.get_by_role("button", name="Toggle Sidebar").click()
        expect(page.locator("#conv-sidebar.open")).to_have_count(0)
    return page


def open_tab(page, name):
    """A tab of the right column; on a phone Gradio folds the last ones into its "More tabs" menu."""
    tab = page.locator("button[role=tab]", has_text=name).first
    if not tab.is_visible():
        page.get_by_role("button", name="More tabs").first.click()
        tab = page.locator(".overflow-dropdown button", has_text=name).first
    tab.click()


def finished(page, count):
    bot = page.locator('#chat [data-testid="bot"]')
    expect(bot).to_have_count(count, timeout=120_000)
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=120_000)


def headline(page) -> tuple[int, int]:
    text = page.locator("#edit-cost .ec h4").inner_text()
    cached, total = re.search(r"([\d,]+) of ([\d,]+) prompt tokens from the cache", text).groups()
    return int(cached.replace(",", "")), int(total.replace(",", ""))


@pytest.mark.parametrize("size", list(VIEWPORTS))
def test_the_cost_of_an_edit_while_it_is_typed_then_beside_the_actual(browser, app_url, tiny_llm, size):  # noqa: F811
    page = open_page(browser, app_url, VIEWPORTS[size])
    set_number(page, "temperature", "0")
    set_number(page, "max tokens", "4")
    page.fill("#msg textarea", "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20")
    page.press("#msg textarea", "Enter")
    finished(page, 1)
    wait_engine_idle(tiny_llm)
    user = page.locator('#chat [data-testid="user"]').first
    user.hover()
    page.locator('#chat button[aria-label="Edit"]').first.click()
    box = page.locator("#chat textarea.edit-textarea").first
    box.fill("w10 w11 w12 w13 w14 w15 w16 w99 w18 w19 w20")   # an edit in the middle
    expect(page.locator("#edit-cost .ec h4")).to_contain_text("Sending this edit", timeout=20_000)
    cached, total = headline(page)
    assert 0 < cached < total
    expect(page.locator("#edit-cost .ec-blocks .ec-b.shared")).to_have_count(cached // 4)
    page.locator("#chat").get_by_role("button", name="Submit").click()
    finished(page, 1)
    expect(page.locator("#edit-cost th", has_text="actual")).to_have_count(1, timeout=30_000)
    expect(page.locator("#edit-cost td.ok").first).to_have_text(f"{cached:,} tokens")
    # the engine's own count for that reply: its prefix hits
    snap_hits = [r for r in tiny_llm.kv_events()["events"] if r["kind"] == "allocate" and r["shared"]]
    assert len(snap_hits[-1]["shared"]) * 4 == cached
    assert page.evaluate("document.documentElement.scrollWidth") <= VIEWPORTS[size]["width"] + 1
    page.close()


@pytest.mark.parametrize("size", list(VIEWPORTS))
def test_the_replay_of_a_run_that_preempts(browser, app_url, tiny_llm, size):  # noqa: F811
    wait_engine_idle(tiny_llm)
    tiny_llm.generate(tiny_prompts(8), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    counters = tiny_llm.kv_events()["counters"]
    assert counters["preemptions"] > 0
    page = open_page(browser, app_url, VIEWPORTS[size])
    open_tab(page, "KV replay")
    page.locator("#replay-load").click()
    summary = page.locator("#replay-summary")
    expect(summary).to_contain_text(f"{counters['preemptions']} preemptions, {counters['evictions']} evictions",
                                    timeout=30_000)
    expect(summary).to_contain_text(f"{counters['preemptions']} preempt")
    page.wait_for_function("""() => { const gd = document.querySelector('#replay-figure .js-plotly-plot');
        return gd && gd.data && gd.data.some((t) => t.meta === 'preempt' && (t.x || []).length); }""", timeout=30_000)
    markers = page.evaluate("""() => { const gd = document.querySelector('#replay-figure .js-plotly-plot');
        return gd ? Object.fromEntries(gd.data.map((t) => [t.meta, (t.x || []).length])) : null; }""")
    assert markers["preempt"] == counters["preemptions"] and markers["evict"] == counters["evictions"]
    # scrub to the first preemption: the state names its cause
    events = tiny_llm.kv_events()["events"]
    at = next(i for i, e in enumerate(events) if e["kind"] == "preempt")
    slider = page.get_by_label("number input for event (scrub)")
    slider.fill(str(at))
    slider.press("Enter")
    expect(page.locator("#replay-state")).to_contain_text(events[at]["cause"], timeout=20_000)
    expect(page.locator("#replay-state b").first).to_have_text("preempt")
    page.wait_for_function("""(seq) => { const gd = document.querySelector('#replay-figure .js-plotly-plot');
        return gd && gd.layout.shapes && gd.layout.shapes[0].x0 === seq; }""", arg=events[at]["seq"], timeout=30_000)
    assert page.evaluate("document.documentElement.scrollWidth") <= VIEWPORTS[size]["width"] + 1
    page.close()
