"""The attention lens's panel in Chromium, at 1440x900 and at a phone's 390x844: open it, click a token
of the reply, and the heat on the text and the mass per block appear (the block map's cells ringed);
switching layer and head draws another heat; a click on the lens's own text moves it there.

Playwright on Debian's chromium (missing: skipped, or failed under CI=true, as every browser test).
``LENS_SHOTS=<dir>`` keeps a screenshot of each size there.
"""

from __future__ import annotations

import os

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


def weights(page) -> list[str]:
    return page.eval_on_selector_all("#lens-view .lz-tok[data-weight]", "els => els.map(e => e.dataset.weight)")


def pick(page, selector: str, option: str) -> None:
    """Choose ``option`` in the Gradio dropdown ``selector``."""
    page.locator(f"{selector} input").click()
    page.get_by_role("option", name=option, exact=True).click()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1440x900", "390x844"])
def test_click_a_token_and_see_where_its_attention_went(browser, app_url, smollm2_llm, viewport):  # noqa: F811
    page = open_page(browser, app_url, viewport)
    for label, value in (("temperature", "0"), ("max tokens", "24")):
        set_number(page, label, value)
    send(page, "Name three colours of the sea.")
    finished(page)
    page.get_by_text("Attention lens: where a token's attention went").click()
    expect(page.locator("#lens-view .lz-empty")).to_be_visible(timeout=10_000)
    # a click on a token of the reply: the lens of that token
    page.locator('#logprobs .lp-tok[data-index="4"]').click()
    view = page.locator("#lens-view .lz-view[data-position]")
    expect(view).to_have_count(1, timeout=60_000)
    position = int(view.get_attribute("data-position"))
    expect(page.locator("#lens-view .lz-tok.lz-query")).to_have_attribute("data-pos", str(position))
    heat = weights(page)
    assert len(heat) == position + 1 and abs(sum(map(float, heat)) - 1) < 1e-3
    rows = page.locator("#lens-view .lz-row")
    assert rows.count() >= 2
    expect(rows.first).to_contain_text("stored by")
    expect(rows.last).to_contain_text("computed by this lens pass")
    # the block map's cell of the most attended block carries the lens's ring
    block = rows.first.get_attribute("data-block")
    ring = page.eval_on_selector(f'#kv-map .kv-cell[data-block="{block}"]', "c => getComputedStyle(c).boxShadow")
    assert "230, 80, 20" in ring
    # another layer, then another head: another heat, drawn from the lens held
    pick(page, "#lens-layer", "layer 3")
    expect(page.locator('#lens-view .lz-view[data-layer="3"]')).to_have_count(1, timeout=20_000)
    layer3 = weights(page)
    assert layer3 != heat and len(layer3) == len(heat)
    pick(page, "#lens-head", "head 2")
    expect(page.locator('#lens-view .lz-view[data-layer="3"][data-head="2"]')).to_have_count(1, timeout=20_000)
    assert weights(page) != layer3
    if os.environ.get("LENS_SHOTS"):
        page.locator("#lens-box").scroll_into_view_if_needed()
        page.screenshot(path=os.path.join(os.environ["LENS_SHOTS"], f"lens-{viewport['width']}x{viewport['height']}.png"),
                        full_page=viewport is DESKTOP)
    # a click on an earlier token of the lens's text moves the lens there (same layer and head)
    page.locator('#lens-view .lz-tok[data-pos="5"]').click()
    expect(page.locator('#lens-view .lz-view[data-position="5"][data-layer="3"]')).to_have_count(1, timeout=60_000)
    assert len(weights(page)) == 6
    # closed, the block map loses the rings
    page.get_by_text("Attention lens: where a token's attention went").click()
    expect(page.locator("#lens-view .lz-view[data-position]")).to_have_count(0, timeout=10_000)
    ring = page.eval_on_selector(f'#kv-map .kv-cell[data-block="{block}"]', "c => getComputedStyle(c).boxShadow")
    assert "230, 80, 20" not in ring
    page.close()
    wait_engine_idle(smollm2_llm)


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1440x900", "390x844"])
def test_the_notebook_lens_reports_clicks_on_its_tokens_and_blocks(browser, smollm2_llm, viewport):  # noqa: F811
    """The Jupyter widget's ES module (``ClickableHTML``) showing the lens, given a model as anywidget
    passes it (``get``, ``set``, ``save_changes``, ``on``: https://anywidget.dev/en/afm/)."""
    import json

    from playground.clickable import CLICK_ESM
    from playground.lens_view import lens_html

    ids = smollm2_llm.get_tokenizer().encode("The block table maps every position to a physical block. " * 3)
    lens = smollm2_llm.attention_lens(ids, len(ids) - 1)
    html = lens_html(lens, layer=2, after=["tail"], map_cells=".kv-map .kv-cell")
    module = CLICK_ESM.replace("export default { render };", "")          # the module's own render()
    assert module != CLICK_ESM
    content = ("<div id=el></div><script type=module>" + module +
               "const state = {value: " + json.dumps(html) + ", clicked: {}}; window.sent = [];"
               "const model = {get: (k) => state[k], set: (k, v) => { state[k] = v; }, on: () => {},"
               " save_changes: () => window.sent.push(state.clicked)};"
               "render({model, el: document.getElementById('el')}); window.ready = true;</script>")
    page = browser.new_page(viewport=viewport)
    try:
        page.set_content(content)
        page.wait_for_function("window.ready === true")
        expect(page.locator(".lz-tok[data-weight]")).to_have_count(len(ids))
        expect(page.locator(".lz-row")).to_have_count(len(set(lens.block_ids)))
        page.click('.lz-tok[data-pos="3"]')
        page.click(f'.lz-bid[data-block="{lens.block_ids[0]}"]')
        page.click(f'.lz-tok[data-pos="{len(ids)}"]')                 # a token after the lens's position
        if os.environ.get("LENS_SHOTS"):
            page.screenshot(path=os.path.join(os.environ["LENS_SHOTS"],
                                              f"lens-notebook-{viewport['width']}x{viewport['height']}.png"))
        sent = page.evaluate("window.sent")
    finally:
        page.close()
    assert sent == [{"position": 3, "n": 1}, {"block": lens.block_ids[0], "n": 2}, {"position": len(ids), "n": 3}]
