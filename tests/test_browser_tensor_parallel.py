"""The playground started with ``--tensor-parallel-size 2`` (its engine in its own process, which
starts rank 1), in chromium: the Engine tab shows both ranks' KV caches -- the bytes of a block and
of the cache on each rank, one block table -- and the collectives' time of the last step, which
changes once a chat has run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import unavailable
from playwright.sync_api import expect, sync_playwright
from tiny_models import make_tiny_model

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def playground_url(tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        unavailable(f"no {CHROMIUM}: install Debian's chromium (apt-get install -y chromium)")
    model = make_tiny_model(str(tmp_path_factory.mktemp("tp-browser") / "llama"), "LlamaForCausalLM")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("tp-browser-log") / "playground.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "playground", "--model", model, "--tensor-parallel-size", "2",
                                 "--block-size", "4", "--kv-cache-memory", str(64 * 1024), "--port", str(port)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while "Ready." not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()     # the playground stops its engine process, which stops rank 1
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_engine_tab_shows_each_ranks_kv_bytes_and_the_collectives_time(playground_url):
    # the tiny Llama: 2 layers, 2 KV heads of 16 dims; a rank holds one KV head, so a 4-token block
    # is 2 (K, V) x 2 layers x 1 head x 16 x 4 tokens x 4 bytes = 1,024 bytes on each rank, and the
    # 64 KiB a rank is given holds 64 blocks
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(playground_url)
            page.wait_for_selector("#kv-map .kv-cell")
            page.click("button[role=tab]:has-text('Engine')")
            view = page.locator('#engine-panel .tp-view[data-ranks="2"]')
            expect(view).to_have_count(1, timeout=30_000)
            rows = view.locator("tr[data-rank]")
            expect(rows).to_have_count(2)
            for rank in (0, 1):
                row = view.locator(f'tr[data-rank="{rank}"]')
                assert row.get_attribute("data-kv-bytes") == str(64 * 1024)
                expect(row).to_contain_text("1.0 KiB")                # a block's bytes on this rank
                expect(row).to_contain_text("64.0 KiB")               # this rank's cache
            expect(view).to_contain_text("one block table (64 blocks")
            before = view.locator(".tp-comm").inner_text()
            page.fill("#msg textarea", "Hello there")
            page.press("#msg textarea", "Enter")
            expect(page.locator('#chat [data-testid="bot"]').last.locator(".pg-finish")).to_have_count(
                1, timeout=120_000)
            # the chat's steps ran on both ranks: the last step's collectives were timed, and the
            # finished chat's blocks stay in the prefix cache, holding bytes on each rank
            page.wait_for_function(
                "before => { const v = document.querySelector('#engine-panel .tp-view .tp-comm');"
                " return v && v.innerText !== before; }", arg=before, timeout=20_000)
            assert " 0 collectives" not in view.locator(".tp-comm").inner_text()
            held = [int(view.locator(f'tr[data-rank="{r}"]').get_attribute("data-held-bytes")) for r in (0, 1)]
            assert held[0] == held[1] > 0 and held[0] % 1024 == 0
        finally:
            browser.close()
