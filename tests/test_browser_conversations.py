"""Conversations in a real browser: queued follow-ups and Stop, a reload mid-reply, the conversation
list, export and import, edit and resend, Continue, copy, and the sampling controls."""

from __future__ import annotations

import json
import time

import pytest
from playwright.sync_api import expect
from test_browser import CHROMIUM_ARGS, app_url, browser, greedy_long_replies, send, set_number, wait_engine_idle  # noqa: F401

pytestmark = pytest.mark.browser

LONG = "Write a long story about a dragon who learns to sing."   # 200 greedy tokens and more


@pytest.fixture
def page(browser, app_url):  # noqa: F811
    context = browser.new_context(viewport={"width": 1400, "height": 1000},
                                  permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.goto(app_url)
    page.wait_for_selector("#kv-map .kv-cell")
    expect(page.locator("#conv-list label")).not_to_have_count(0, timeout=20_000)   # the page restored
    yield page
    context.close()


def upload(page, path) -> None:
    with page.expect_file_chooser() as chooser:
        page.click("#conv-import")
    chooser.value.set_files(str(path))


def finished(bot, timeout=120_000):
    expect(bot.locator(".pg-finish")).to_have_count(1, timeout=timeout)


def started_requests(engine, into: list):
    return engine.subscribe(lambda e: into.append(e.data) if e.kind == "request_added" else None)


@pytest.mark.parametrize("n", [2, 3])
def test_stop_with_several_queued_follow_ups_withdraws_them_all(page, paced_engine, n):
    """Two or three follow-ups queued behind a reply (the page refused a second one before): Stop ends
    the reply, puts every follow-up back in the message box, and none of them ever runs."""
    started = []
    unsubscribe = started_requests(paced_engine, started)
    try:
        greedy_long_replies(page)
        set_number(page, "max tokens", "500")      # the reply still runs when Stop comes, on a busy machine
        send(page, LONG)
        bot = page.locator('#chat [data-testid="bot"]')
        expect(bot.last.locator(".pg-state")).to_have_text("decoding", timeout=60_000)
        follow_ups = [f"Follow-up number {i + 1}?" for i in range(n)]
        for text in follow_ups:
            send(page, text)
            expect(page.locator("#msg textarea")).to_have_value("", timeout=5_000)
        expect(page.locator('#chat [data-testid="user"]')).to_have_count(n + 1, timeout=10_000)
        page.click("#stop")
        expect(bot.last).to_contain_text("(stopped)", timeout=10_000)
        expect(page.locator('#chat [data-testid="user"]')).to_have_count(1, timeout=10_000)
        expect(page.locator("#msg textarea")).to_have_value("\n".join(follow_ups))
        page.wait_for_timeout(2000)         # no withdrawn message starts meanwhile
        assert len(started) == 1 and not paced_engine.snapshot().requests, started
        assert "queued" not in page.inner_text("#chat")
        assert "Follow-up" not in page.inner_text("#chat")
    finally:
        unsubscribe()
    wait_engine_idle(paced_engine)


def test_queued_follow_ups_are_answered_in_order(page, paced_engine):
    greedy_long_replies(page)
    set_number(page, "max tokens", "12")
    send(page, "Name a colour.")
    bot = page.locator('#chat [data-testid="bot"]')
    expect(bot.last.locator(".pg-state")).to_have_text("decoding", timeout=60_000)
    for text in ("Name a fruit.", "Name a city."):
        send(page, text)
        expect(page.locator("#msg textarea")).to_have_value("", timeout=5_000)   # sent, not cleared unsent
    expect(bot).to_have_count(3, timeout=180_000)
    finished(bot.nth(2), timeout=180_000)
    users = page.locator('#chat [data-testid="user"]')
    assert [users.nth(i).inner_text().strip() for i in range(3)] == ["Name a colour.", "Name a fruit.",
                                                                     "Name a city."]
    wait_engine_idle(paced_engine)


def test_reload_mid_reply_restores_the_conversation_and_nothing_is_stuck(page, paced_engine):
    greedy_long_replies(page)
    send(page, "What is the capital of France?")
    bot = page.locator('#chat [data-testid="bot"]')
    finished(bot.last)
    first_reply = bot.last.locator("p").first.inner_text()
    set_number(page, "max tokens", "500")
    send(page, LONG)
    expect(bot.nth(1).locator(".pg-state")).to_have_text("decoding", timeout=60_000)
    page.wait_for_timeout(1000)
    page.reload()
    page.wait_for_selector("#kv-map .kv-cell")
    # The conversation is back: both questions, the first reply as it was, the second ended "stopped".
    users = page.locator('#chat [data-testid="user"]')
    expect(users).to_have_count(2, timeout=20_000)
    expect(users.nth(1)).to_contain_text("dragon who learns to sing")
    expect(bot.nth(0).locator("p").first).to_have_text(first_reply)
    expect(bot.nth(1).locator(".pg-finish-abort")).to_have_count(1, timeout=10_000)
    expect(bot.nth(1)).to_contain_text("(stopped)")
    assert "▌" not in page.inner_text("#chat")
    snap = wait_engine_idle(paced_engine, timeout=15)
    assert not snap["requests"]
    # The logprob view shows the restored reply's tokens, and the conversation goes on.
    expect(page.locator("#logprobs .lp-tok")).not_to_have_count(0, timeout=10_000)
    send(page, "Thanks.")
    expect(bot).to_have_count(3, timeout=60_000)
    finished(bot.last)
    wait_engine_idle(paced_engine)


def test_conversation_list_new_open_rename_delete(page, smollm2_llm):
    set_number(page, "max tokens", "8")
    send(page, "What is two plus two?")
    bot = page.locator('#chat [data-testid="bot"]')
    finished(bot.last)
    items = page.locator("#conv-list label")
    expect(items.first).to_contain_text("What is two plus two?", timeout=10_000)
    count = items.count()
    page.click("#conv-new")
    expect(page.locator('#chat [data-testid="user"]')).to_have_count(0, timeout=10_000)
    expect(items).to_have_count(count + 1, timeout=10_000)
    send(page, "Name a planet.")
    finished(bot.last)
    expect(items.first).to_contain_text("Name a planet.", timeout=10_000)
    # Back to the first conversation from the list.
    items.filter(has_text="What is two plus two?").first.click()
    expect(page.locator('#chat [data-testid="user"]')).to_have_text(["What is two plus two?"], timeout=10_000)
    # Rename it, then delete it: the list keeps the other.
    page.fill("#conv-name input", "Arithmetic")
    page.click("#conv-rename")
    expect(items.filter(has_text="Arithmetic")).to_have_count(1, timeout=10_000)
    page.click("#conv-delete")
    expect(items.filter(has_text="Arithmetic")).to_have_count(0, timeout=10_000)
    expect(items).to_have_count(count, timeout=10_000)
    expect(page.locator('#chat [data-testid="user"]')).not_to_contain_text(["What is two plus two?"])
    wait_engine_idle(smollm2_llm)


def test_export_then_import_keeps_the_tree_and_logprobs_and_a_bad_file_is_named(page, smollm2_llm, tmp_path):
    set_number(page, "max tokens", "10")
    send(page, "What is the capital of Italy?")
    bot = page.locator('#chat [data-testid="bot"]')
    finished(bot.last)
    page.click("#regenerate")
    expect(bot.last.locator(".pg-pos")).to_have_text("2/2", timeout=60_000)
    finished(bot.last)
    reply_text = bot.last.locator("p").first.inner_text()
    page.click("#conv-export")
    link = page.locator("#conv-file a").first
    expect(link).to_be_visible(timeout=15_000)
    with page.expect_download() as info:
        link.click()
    path = tmp_path / "conversation.json"
    info.value.save_as(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "fleet-playground/conversation" and doc["version"] == 1
    assert [m["role"] for m in doc["messages"]] == ["system", "user", "assistant"]
    replies = [n for n in doc["tree"]["nodes"] if n["role"] == "assistant"]
    assert len(replies) == 2 and all(r["reply"]["records"] for r in replies)
    assert replies[0]["reply"]["records"][0]["alternatives"]
    # A broken file: the note names the field, nothing changes.
    bad = dict(doc, tree={"nodes": [dict(n, parent=99) if n["role"] == "assistant" else n
                                    for n in doc["tree"]["nodes"]]})
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    upload(page, tmp_path / "bad.json")
    expect(page.locator("#conv-note .conv-error")).to_contain_text("parent", timeout=15_000)
    expect(page.locator("#conv-note .conv-error")).to_contain_text("99")
    # The good file comes back as a new conversation, on the branch shown, with its logprobs.
    page.click("#conv-new")
    expect(page.locator('#chat [data-testid="user"]')).to_have_count(0, timeout=10_000)
    upload(page, path)
    expect(page.locator("#conv-note")).to_contain_text("Imported", timeout=15_000)
    expect(bot.last.locator(".pg-pos")).to_have_text("2/2", timeout=10_000)
    expect(bot.last.locator("p").first).to_have_text(reply_text)
    expect(page.locator("#logprobs .lp-tok")).not_to_have_count(0)
    wait_engine_idle(smollm2_llm)


def test_edit_and_resend_makes_a_new_branch(page, smollm2_llm):
    set_number(page, "max tokens", "8")
    send(page, "What is the capital of Spain?")
    bot = page.locator('#chat [data-testid="bot"]')
    finished(bot.last)
    original = bot.last.locator("p").first.inner_text()
    user = page.locator('#chat [data-testid="user"]').first
    user.hover()
    page.locator('#chat button[aria-label="Edit"]').first.click()
    box = page.locator("#chat textarea").first
    box.fill("What is the capital of Portugal?")
    page.locator("#chat").get_by_role("button", name="Submit").click()
    expect(bot.last.locator(".pg-message-branches .pg-pos")).to_have_text("2/2", timeout=60_000)
    finished(bot.last)
    expect(page.locator('#chat [data-testid="user"]').first).to_have_text("What is the capital of Portugal?")
    # The original message and its reply are one click away.
    bot.last.locator(".pg-message-branches .pg-prev").click()
    expect(page.locator('#chat [data-testid="user"]').first).to_have_text("What is the capital of Spain?",
                                                                          timeout=10_000)
    expect(bot.last.locator("p").first).to_have_text(original)
    wait_engine_idle(smollm2_llm)


def test_continue_after_a_length_cut_and_copy_the_reply(page, smollm2_llm):
    greedy_long_replies(page)
    set_number(page, "max tokens", "6")
    send(page, "Tell me a long story about a dragon.")
    bot = page.locator('#chat [data-testid="bot"]')
    finished(bot.last)
    expect(bot.last.locator(".pg-finish-length")).to_have_count(1)
    expect(bot.last.locator(".pg-count")).to_have_text("6 tokens")
    before = bot.last.locator("p").first.inner_text()
    bot.last.locator(".pg-continue").click()
    # The same reply grows: 6 new tokens after the 6 it had, counted apart.
    expect(bot.last.locator(".pg-count")).to_have_text("6 tokens + 6 kept", timeout=60_000)
    expect(bot).to_have_count(1)
    after = bot.last.locator("p").first.inner_text()
    assert after.startswith(before.rstrip()) and len(after) > len(before)
    expect(page.locator("#logprobs .lp-tok")).to_have_count(12, timeout=10_000)
    # Copy puts the reply's own text on the clipboard, without the line under it.
    bot.last.locator(".pg-copy").click()
    expect(bot.last.locator(".pg-copy")).to_have_text("copied", timeout=5_000)
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied.strip() == after.strip() and "tokens" not in copied
    wait_engine_idle(smollm2_llm)


def test_sampling_controls_stop_sequences_and_errors_beside_the_field(page, smollm2_llm):
    greedy_long_replies(page)
    # A value the engine refuses is named under the controls at once, not a toast of a traceback.
    set_number(page, "repetition penalty", "0")
    note = page.locator('#sampling-note .sampling-error[data-field="repetition_penalty"]')
    expect(note).to_contain_text("repetition penalty must be in (0.0, inf); got 0.0", timeout=10_000)
    set_number(page, "repetition penalty", "1")
    expect(page.locator("#sampling-note .sampling-error")).to_have_count(0, timeout=10_000)
    set_number(page, "min-p", "0.05")
    # A stop sequence ends the reply where it appears (the same question without it says Paris).
    page.fill("#stop-seqs textarea", "Paris")
    send(page, "What is the capital of France?")
    bot = page.locator('#chat [data-testid="bot"]')
    finished(bot.last)
    expect(bot.last.locator(".pg-finish-stop")).to_have_count(1)
    assert "Paris" not in bot.last.locator("p").first.inner_text()
    page.fill("#stop-seqs textarea", "")
    page.click("#regenerate")
    expect(bot.last.locator(".pg-pos")).to_have_text("2/2", timeout=60_000)
    finished(bot.last)
    assert "Paris" in bot.last.locator("p").first.inner_text()
    wait_engine_idle(smollm2_llm)


def test_completion_mode_is_one_document_coloured_by_probability_and_continues_from_a_token(page, smollm2_llm):
    """Completion mode showed the text and its continuation as a chat (a user bubble, then the continuation
    in a bubble of its own); it is one document now, the continuation coloured token by token."""
    set_number(page, "temperature", "0")
    set_number(page, "max tokens", "8")
    page.locator("#mode").get_by_text("completion", exact=True).click()
    send(page, "The capital of France is")
    bot = page.locator('#chat [data-testid="bot"]')
    finished(bot.last)
    expect(page.locator('#chat [data-testid="user"]')).to_have_count(0)
    expect(bot).to_have_count(1)
    doc = bot.last.locator(".pg-doc")
    expect(doc.locator(".pg-doc-given")).to_have_text("The capital of France is")
    tokens = doc.locator(".pg-tok")
    expect(tokens).to_have_count(8)
    assert all(any(c.startswith("pg-p") for c in tokens.nth(i).get_attribute("class").split()) for i in range(8))
    expect(bot.last.locator(".pg-count")).to_have_text("8 tokens")
    k = next(i for i in range(2, 8) if tokens.nth(i).inner_text().strip())    # a token with text to click
    kept = [tokens.nth(i).inner_text() for i in range(k)]
    # A click on it continues from there: a new branch keeping the tokens before it.
    tokens.nth(k).click()
    expect(bot.last.locator(".pg-pos")).to_have_text("2/2", timeout=60_000)
    finished(bot.last)
    expect(bot.last.locator(".pg-count")).to_have_text(f"8 tokens + {k} kept")
    assert [tokens.nth(i).inner_text() for i in range(k)] == kept
    expect(tokens).to_have_count(8 + k)
    wait_engine_idle(smollm2_llm)


def test_completion_document_is_edited_as_one_text_and_continued_from_its_end(page, smollm2_llm):
    """The document (the text given and the model's continuation) opens as one text where it stands;
    edited anywhere, the continuation included, it is continued from its end as a new version, and
    the version before stays (‹ › under it)."""
    set_number(page, "temperature", "0")
    set_number(page, "max tokens", "8")
    page.locator("#mode").get_by_text("completion", exact=True).click()
    send(page, "The capital of France is")
    bot = page.locator('#chat [data-testid="bot"]')
    finished(bot.last)
    first = bot.last.locator(".pg-doc").inner_text()
    bot.last.locator(".pg-edit-doc").click()
    editor = bot.last.locator(".pg-doc-editor textarea")
    expect(editor).to_be_visible()
    expect(editor).to_have_value(first)              # the whole text, the continuation included
    expect(bot.last.locator(".pg-doc")).to_be_hidden()
    # Cancel puts the document back as it was.
    bot.last.get_by_role("button", name="Cancel").click()
    expect(bot.last.locator(".pg-doc")).to_be_visible()
    expect(bot.last.locator(".pg-doc-editor")).to_have_count(0)
    # Edit the model's words and add some, then continue from the end.
    bot.last.locator(".pg-edit-doc").click()
    edited = first.replace("France", "Italy") + " The capital of Spain is"
    editor.fill(edited)
    bot.last.get_by_role("button", name="Continue ↦").click()
    expect(bot.last.locator(".pg-branches .pg-pos")).to_have_text("2/2", timeout=60_000)
    finished(bot.last)
    expect(bot).to_have_count(1)
    doc = bot.last.locator(".pg-doc")
    assert doc.locator(".pg-doc-given").inner_text() == edited    # all of it is the visitor's text now
    expect(doc.locator(".pg-tok")).not_to_have_count(0)           # and the new continuation, coloured
    generated = int(bot.last.locator(".pg-count").inner_text().split()[0])
    assert doc.locator(".pg-tok").count() in (generated, generated - 1)   # (the end of text is no text)
    # What the engine continued is the edited text, as the tokenizer reads it.
    prompt = smollm2_llm.get_tokenizer().encode(edited, add_special_tokens=True)
    used = int(bot.last.locator(".pg-ctx").inner_text().split("/")[0].split()[-1])
    assert used == len(prompt) + generated
    # The version before is kept.
    bot.last.locator(".pg-nav.pg-prev").click()
    expect(bot.last.locator(".pg-branches .pg-pos")).to_have_text("1/2", timeout=10_000)
    expect(bot.last.locator(".pg-tok")).to_have_count(8)
    assert bot.last.locator(".pg-doc").inner_text() == first
    wait_engine_idle(smollm2_llm)
