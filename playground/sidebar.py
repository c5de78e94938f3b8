"""The conversations sidebar: this browser's list (new, open, rename, delete), export and import.

The page keeps a browser key in ``gr.BrowserState`` (see ``playground.library`` for why the
conversations themselves stay on the server); on load, ``restore`` finds that browser's
conversations and shows the one it showed last, so a reload brings the tab's conversation back.
A reply that was streaming when the page went away ends "stopped" with the text it had.

Export writes the shown conversation as a ``playground.persistence`` document (OpenAI messages,
the branch tree, every reply's tokens and logprobs); Import reads one back as a new conversation,
or says beside the button which field of the file is wrong.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from html import escape
from typing import Any

import gradio as gr

from . import inputs
from .chat import ChatSession
from .handlers import Handlers
from .library import Libraries, Library
from .persistence import DocumentError, dumps, from_document, loads, to_document

__all__ = ["Sidebar"]

ORPHAN_WAIT_S = 5.0     # how long a reload waits for the previous page's reply to end


def _note(text: str, error: bool = False) -> str:
    color = "#b91c1c" if error else "#334155"
    return f'<div class="conv-note{" conv-error" if error else ""}" style="color:{color};font-size:13px">' \
           f"{escape(text)}</div>"


class Sidebar:
    """Events of the conversations sidebar."""

    def __init__(self, h: Handlers, libraries: Libraries | None = None, export_dir: str | None = None):
        self.h = h
        self.libraries = libraries or Libraries()
        self.export_dir = export_dir or os.path.join(tempfile.gettempdir(), "fleet-playground-exports")

    # -- helpers -----------------------------------------------------------------------
    def _library(self, session: ChatSession) -> Library:
        """The tab's library (an API client that never loaded the page gets one of its own)."""
        if session.library is None:
            _, session.library = self.libraries.get(None)
            entry = session.library.new(session.tree)
            session.conversation_id = entry.conversation_id
        return session.library

    def _show(self, session: ChatSession, entry: Any) -> None:
        session.tree, session.conversation_id = entry.tree, entry.conversation_id
        session.library.current = entry.conversation_id
        session.selected = session.selected_node = None
        session.last_render_key = None

    def conversations(self, session: ChatSession) -> Any:
        """The list, with the tab's conversation selected."""
        library = self._library(session)
        return gr.Radio(choices=library.choices(), value=session.conversation_id)

    def _switch_outputs(self, session: ChatSession, note: str = "") -> tuple:
        return (*self.h._outputs(session, msg="", reset_controls=True), self.conversations(session), note)

    def _refuse_while_streaming(self, session: ChatSession, what: str) -> None:
        if session.active_request_id is not None or session.queued:
            raise gr.Error(f"A reply is still being generated: press Stop or wait for it to end before {what}.")

    def _end_orphans(self, session: ChatSession) -> None:
        """Replies of the shown conversation still streaming for a page that is gone (a reload mid-reply):
        that page's close aborts them; wait for it, then end any left so nothing shows as running."""
        running = [n.reply for n in session.tree.replies() if not n.reply.finished]
        live = {s.active_request_id for s in self.h.tabs._sessions.values() if s is not session}
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while any(not r.finished for r in running) and time.monotonic() < deadline:
            live = {s.active_request_id for s in self.h.tabs._sessions.values() if s is not session}
            if all(r.request_id in live for r in running if not r.finished):
                break                       # another open tab of this browser is generating them
            time.sleep(0.05)
        for reply in running:
            if not reply.finished and reply.request_id not in live:
                reply.stopped = True
                self.h.llm.abort(reply.request_id)

    # -- events --------------------------------------------------------------------------
    def restore(self, key: Any, session: ChatSession) -> tuple:
        """Page load: this browser's conversations (a new key for a new browser), the last one shown."""
        key, library = self.libraries.get(key if isinstance(key, str) and key else None)
        if session.library is None and (session.tree.path() or session.active_request_id is not None
                                        or session.queued):
            # A message sent before this load event ran (a slow server): keep that chat on screen,
            # as a new conversation of this browser, instead of replacing it with the last one.
            session.library = library
            session.conversation_id = library.new(session.tree).conversation_id
            return (key, *(gr.skip(),) * 6, self.conversations(session), "")
        session.library = library
        self._show(session, library.open(library.current))
        self._end_orphans(session)
        return (key, *self._switch_outputs(session))

    def new(self, session: ChatSession) -> tuple:
        self._refuse_while_streaming(session, "starting a new conversation")
        self._show(session, self._library(session).new())
        return self._switch_outputs(session)

    def open(self, session: ChatSession, conversation_id: Any) -> tuple:
        library = self._library(session)
        if conversation_id == session.conversation_id:
            return self._switch_outputs(session)
        entry = library.get(conversation_id) if isinstance(conversation_id, str) else None
        if entry is None:
            return self._switch_outputs(session, _note("That conversation was deleted.", error=True))
        if session.active_request_id is not None or session.queued:
            return (*(gr.skip(),) * 6, self.conversations(session),
                    _note("A reply is still being generated: press Stop or wait for it before switching.",
                          error=True))
        self._show(session, entry)
        return self._switch_outputs(session)

    def rename(self, session: ChatSession, title: Any) -> tuple:
        title = inputs.text(title, "name", max_chars=200)
        library = self._library(session)
        if not title.strip():
            return self.conversations(session), _note("Type a name first.", error=True), gr.skip()
        library.rename(session.conversation_id, title)
        return self.conversations(session), "", ""

    def delete(self, session: ChatSession) -> tuple:
        self._refuse_while_streaming(session, "deleting the conversation")
        library = self._library(session)
        self._show(session, library.delete(session.conversation_id))
        return self._switch_outputs(session)

    def export(self, session: ChatSession, system: Any) -> tuple:
        """The shown conversation as a JSON file to download."""
        library = self._library(session)
        entry = library.get(session.conversation_id)
        system = inputs.text(system, "system prompt", max_chars=self.h.limits.max_input_chars)
        if not session.tree.path():
            return gr.File(value=None, visible=False), _note("Nothing to export yet: send a message first.", True)
        name = entry.name() if entry else "conversation"
        doc = to_document(session.tree, title=name, system=system, model=str(getattr(self.h.llm, "model", "")))
        os.makedirs(self.export_dir, exist_ok=True)
        slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")[:40] or "conversation"
        fd, path = tempfile.mkstemp(prefix=f"{slug}-", suffix=".json", dir=self.export_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dumps(doc))
        return gr.File(value=path, visible=True), _note(f"Exported “{name}”: {len(doc['tree']['nodes']) - 1} "
                                                        "messages with every branch and logprob.")

    def import_(self, session: ChatSession, file: Any) -> tuple:
        """A conversation file read back as a new conversation; a wrong file is named beside the button."""
        path = file if isinstance(file, str) else getattr(file, "name", None) or getattr(file, "path", None)
        if not path:
            return (*(gr.skip(),) * 6, gr.skip(), _note("Choose a .json file exported from this playground.", True))
        try:
            if session.active_request_id is not None or session.queued:
                raise DocumentError("a reply is still being generated: press Stop or wait for it, then import")
            with open(path, "rb") as f:
                data = f.read(20 * 2**20 + 1)
            tree, meta = from_document(loads(data))
        except DocumentError as exc:
            return (*(gr.skip(),) * 6, gr.skip(), _note(f"Not imported: {exc}", error=True))
        library = self._library(session)
        entry = library.new(tree, title=meta["title"])
        self._show(session, entry)
        branches = sum(len(n.children) > 1 for n in tree.nodes.values())
        return self._switch_outputs(session, _note(f"Imported “{entry.name()}”: {len(tree.nodes) - 1} messages, "
                                                   f"{branches} with branches."))
