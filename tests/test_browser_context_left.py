"""Max tokens up to the context left, in Chromium: the slider's maximum follows the conversation.

The app's own cap on max tokens is the whole context here, so the context left, not the cap, is
what bounds the slider once the conversation holds tokens (with the default cap of 512 tokens that
takes a conversation of thousands of tokens, minutes of decoding on a CPU).
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect
from test_browser import browser, send, set_number, wait_engine_idle, wait_restored  # noqa: F401  (fixtures)

from playground.app import build_app, launch
from playground.handlers import Limits

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def whole_context_url(smollm2_llm):
    demo = build_app(smollm2_llm, limits=Limits(max_tokens=smollm2_llm.max_model_len), refresh_every=0.5)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    yield url
    demo.close()
    demo.playground_monitor.close()


def gauge(bot) -> tuple[int, int, int]:
    """(used, max_model_len, left) as the context gauge under the reply says them."""
    text = bot.locator(".pg-ctx").text_content()
    found = re.search(r"(\d+)/(\d+)\s*·\s*(\d+) left", text)
    assert found, text
    used, total, left = map(int, found.groups())
    return used, total, left


def test_max_tokens_goes_up_to_the_context_left_and_a_value_above_it_is_lowered(browser, whole_context_url,
                                                                                smollm2_llm):  # noqa: F811
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(whole_context_url)
    page.wait_for_selector("#kv-map .kv-cell")
    wait_restored(page)
    total = smollm2_llm.max_model_len
    box = page.get_by_label("number input for max tokens")
    top = page.get_by_label("range slider for max tokens")
    field = page.locator("#max-tokens")
    set_number(page, "temperature", "0")
    set_number(page, "max tokens", "16")
    send(page, "What is the capital of France?")
    bot = page.locator('#chat [data-testid="bot"]')
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=120_000)
    used, shown_total, left = gauge(bot.last)
    assert shown_total == total and used > 10 and left == total - used
    # The slider now ends at the context left (the gauge's "N left"), and says why.
    expect(top).to_have_attribute("max", str(left), timeout=15_000)
    expect(field).to_contain_text(f"max_model_len {total} − {used} tokens of this conversation")
    expect(box).to_have_value("16")
    # It follows the conversation as it grows: the next reply leaves less.
    send(page, "And of Italy?")
    expect(bot).to_have_count(2, timeout=60_000)
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=120_000)
    used2, _, left2 = gauge(bot.last)
    assert used2 > used and left2 == total - used2
    expect(top).to_have_attribute("max", str(left2), timeout=15_000)
    # A new conversation has the whole context; asked for all of it there, then back in the first
    # conversation, the value above its context left is lowered to it, and the note says so.
    page.click("#conv-new")
    expect(bot).to_have_count(0, timeout=15_000)
    expect(top).to_have_attribute("max", str(total), timeout=15_000)
    set_number(page, "max tokens", str(total))
    page.locator("#conv-list label", has_text="capital of France").first.click()
    expect(bot).to_have_count(2, timeout=15_000)
    expect(top).to_have_attribute("max", str(left2), timeout=15_000)
    expect(box).to_have_value(str(left2))
    expect(field).to_contain_text(f"lowered from {total}")
    page.close()
    wait_engine_idle(smollm2_llm)
