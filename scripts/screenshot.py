"""``python scripts/screenshot.py``: the README's picture of the playground, taken from the real app.

Loads the default model in a process of its own (as ``python -m playground``
does), serves the playground on a local port, drives it in headless Chromium
through Playwright the way a visitor would (a question, a branch from one of
the reply's tokens, a second question whose reply is still streaming, one of
its blocks inspected), and writes ``docs/playground.png``.
Needs Debian's ``chromium`` (``--chromium`` points elsewhere).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # this checkout's packages, whatever is installed

from playwright.sync_api import expect, sync_playwright  # noqa: E402

from engine import LLMProcess  # noqa: E402
from engine.client import connect  # noqa: E402
from playground.app import build_app, launch  # noqa: E402
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def drive(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("#kv-map .kv-cell")
    if page.viewport_size["width"] < 700 and page.locator("#conv-sidebar.open").count():
        page.get_by_role("button", name="Toggle Sidebar").click()     # on a phone it covers the page
    page.click("#msg textarea")
    page.fill("#msg textarea", "What is the capital of France?")
    page.press("#msg textarea", "Enter")
    bot = page.locator('#chat [data-testid="bot"]')
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=180_000)
    # Branch at the reply's third token with its first alternative: the reply gets ‹ 2/2 ›.
    page.locator('#logprobs .lp-tok[data-index="2"]').click()
    expect(page.locator('#logprobs .lp-tok.lp-selected')).to_have_count(1, timeout=10_000)
    page.click("#branch")
    expect(bot.last.locator(".pg-pos")).to_have_text("2/2", timeout=60_000)
    expect(bot.last.locator(".pg-finish")).to_have_count(1, timeout=180_000)
    page.fill("#msg textarea", "Now describe Rome in three short paragraphs.")
    page.press("#msg textarea", "Enter")
    expect(bot).to_have_count(2, timeout=30_000)
    # While the second reply streams, the map shows this chat's blocks next to the cached ones.
    cells = page.locator('#kv-map .kv-cell.kv-used[data-owners^="chat-"]')
    page.wait_for_function("document.querySelectorAll("
                           "'#kv-map .kv-cell.kv-used[data-owners^=\"chat-\"]').length >= 6", timeout=120_000)
    cells.nth(1).click()
    expect(page.locator("#block-inspector .block-text")).to_have_count(1, timeout=10_000)
    time.sleep(0.5)


def engine_tab(page, out: str) -> None:
    """A batch demo, then the Engine tab's timeline (the Plotly chart) in view: ``out``."""
    expect(page.locator('#chat [data-testid="bot"]').last.locator(".pg-finish")).to_have_count(1, timeout=180_000)
    page.locator("button[role=tab]", has_text="Batch demo").first.click()
    page.get_by_role("button", name="Fire batch").click()
    expect(page.locator("#batch-view .batch-row[data-state=done]")).to_have_count(4, timeout=180_000)
    page.locator("button[role=tab]", has_text="Engine").first.click()
    page.wait_for_selector("#timeline .js-plotly-plot .ytick text", timeout=60_000)
    time.sleep(2.5)                                   # a refresh from the panels' route
    page.locator("#timeline").scroll_into_view_if_needed()
    page.screenshot(path=out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "playground.png"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--engine-tab", metavar="PNG", help="also a batch demo and the Engine tab's timeline, here")
    parser.add_argument("--server", metavar="URL", help="the engine of a running engine server (as python -m "
                        "playground --server URL) instead of one loaded here")
    args = parser.parse_args(argv)
    llm = connect(args.server) if args.server else LLMProcess()   # as python -m playground runs it
    demo = build_app(llm)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            phone = args.width < 700
            page = browser.new_page(viewport={"width": args.width, "height": args.height}, is_mobile=phone,
                                    has_touch=phone)
            drive(page, url)
            page.screenshot(path=args.out, full_page=True)
            if args.engine_tab:
                engine_tab(page, args.engine_tab)
                print(f"wrote {args.engine_tab}")
            browser.close()
    finally:
        demo.close()
        demo.playground_monitor.close()
        llm.shutdown()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
