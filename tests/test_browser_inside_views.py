"""The sampler's pipeline and the KV provenance views in Chromium, at 1440x900 and at a phone's
390x844: a click on a reply token shows each stage of the sampler with the sampled token inside the
last stage's kept set; a second turn's prompt tokens are coloured by their source, the cached ones
as many as the reply's meta line says came from the prefix cache, naming the turn that stored them,
beside the Plotly figure of its tokens' batches. Neither view overflows a phone's width.

Playwright on Debian's chromium (missing: skipped, or failed under CI=true, as every browser test).
Screenshots of both views go to ``INSIDE_SHOTS=<dir>`` when it is set.
"""

from __future__ import annotations

import os
import re

import pytest
from playwright.sync_api import expect
from test_browser import CHROMIUM, CHROMIUM_ARGS, browser, send, serving, set_number, wait_engine_idle  # noqa: F401
from test_browser_v3_views import DESKTOP, PHONE, finished, open_page


pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def app_url(smollm2_llm):
    wait_engine_idle(smollm2_llm)
    with serving(smollm2_llm) as url:
        yield url


def fits(page, selector: str) -> bool:
    return page.eval_on_selector(selector, "e => e.scrollWidth <= e.clientWidth + 1")


def shot(page, selector: str, name: str, viewport: dict) -> None:
    where = os.environ.get("INSIDE_SHOTS")
    if where:
        page.eval_on_selector(selector, "e => { e.scrollIntoView({block: 'start'}); window.scrollBy(0, -96); }")
        page.wait_for_timeout(300)
        page.screenshot(path=os.path.join(where, f"{name}-{viewport['width']}x{viewport['height']}.png"))


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1440x900", "390x844"])
def test_sampler_stages_of_a_clicked_token_and_where_the_kv_came_from(browser, app_url, smollm2_llm,  # noqa: F811
                                                                      viewport):
    page = open_page(browser, app_url, viewport)
    set_number(page, "max tokens", "16")
    set_number(page, "top-k (0 = off)", "40")
    send(page, f"Name a colour of the sea ({viewport['width']}).")
    finished(page)
    # the sampler's panel: open, then click a token of the reply
    page.get_by_text("Sampler pipeline: how a clicked reply token was picked").click()
    expect(page.locator("#sampler-view .sp-view")).to_have_count(1, timeout=10_000)
    token = page.locator('#logprobs .lp-tok[data-index="3"]')
    token.click()
    view = page.locator("#sampler-view .sp-view[data-token]")
    expect(view).to_have_count(1, timeout=60_000)
    assert view.get_attribute("data-token") == token.get_attribute("data-token-id")
    assert view.get_attribute("data-in-kept") == "true"
    stages = page.locator("#sampler-view .sp-stage")
    expect(stages).to_have_count(6)
    names = [stages.nth(i).get_attribute("data-stage") for i in range(6)]
    assert names == ["raw", "penalties", "temperature", "top_k", "min_p", "top_p"]
    kept = [int(stages.nth(i).get_attribute("data-kept")) for i in range(6)]
    assert kept[3] == 40 and 1 <= kept[5] <= 40 and kept[0] > 1000
    expect(stages.last.locator(".sp-bar.sp-token")).to_have_count(1)
    assert stages.last.get_attribute("data-token-rank")
    assert fits(page, "#sampler-view .sp-view")
    shot(page, "#sampler-box", "sampler", viewport)
    # a second turn: its prompt holds the first turn, read from the prefix cache
    send(page, "And another one?")
    bot = finished(page, 2)
    meta = bot.last.locator("text=/prompt tokens cached/").inner_text()
    cached, prompt = map(int, re.match(r"(\d+)/(\d+)", meta).groups())
    assert cached > 0
    page.get_by_text("KV provenance: where each token's K/V came from").click()
    counts = page.locator("#provenance-view .ps-counts")
    expect(counts).to_have_count(1, timeout=20_000)
    assert int(counts.get_attribute("data-cached")) == cached
    assert page.locator("#provenance-view .ps-prompt .ps-tok").count() == prompt
    assert page.locator("#provenance-view .ps-prompt .ps-tok.ps-cached").count() == cached
    assert int(counts.get_attribute("data-prefill")) == prompt - cached
    expect(counts).to_contain_text(re.compile(r"stored by (.*, )?turn 1"))   # the system prompt: maybe another tab
    expect(page.locator("#provenance-view .ps-replytext .ps-tok")).to_have_count(
        int(counts.get_attribute("data-reply")))
    # the tokens' batches: a Plotly figure, latency over the requests in each step
    expect(page.locator("#provenance-batches .js-plotly-plot")).to_have_count(1, timeout=20_000)
    points = page.eval_on_selector("#provenance-batches .js-plotly-plot", "p => p.data[0].x.length")
    assert points == int(counts.get_attribute("data-reply")) - 1
    assert fits(page, "#provenance-view .ps-view")
    shot(page, "#provenance-box", "prov", viewport)
    page.close()
    wait_engine_idle(smollm2_llm)
