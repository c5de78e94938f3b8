"""Each browser's conversations, kept by the server under an unguessable browser key.

The page keeps only that key in the browser (``gr.BrowserState``, encrypted with the server's
secret); the conversations themselves stay here, in memory, each a live ``Conversation`` with its
replies' tokens and logprobs. A reload, even in the middle of a reply, finds the same tree (the
reply that was streaming ends "stopped" with the text it had), nothing is written to the browser
on every streamed token, and no visitor can reach another's conversations without their key.
They last as long as the server process: Export writes one to a file, Import reads it back.

``Libraries`` maps browser keys to ``Library`` objects (the least recently used browser is
dropped beyond ``max_browsers``); a ``Library`` holds up to ``max_conversations`` conversations
(the oldest untouched one goes first) and which one the browser showed last.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from .conversation import Conversation

__all__ = ["Entry", "Library", "Libraries"]

TITLE_CHARS = 60


@dataclass
class Entry:
    """One conversation of a browser's list."""

    conversation_id: str
    tree: Conversation
    title: str = ""                              # "" until named: the first message stands in
    updated: float = field(default_factory=time.time)

    def name(self) -> str:
        if self.title:
            return self.title
        first = next((n.content for n in self.tree.path() if n.role == "user"), "")
        first = " ".join(first.split())
        return (first[:TITLE_CHARS - 1] + "…" if len(first) > TITLE_CHARS else first) or "New conversation"


class Library:
    """One browser's conversations, newest first."""

    def __init__(self, max_conversations: int = 50):
        self.max_conversations = max_conversations
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.current: str | None = None
        self.lock = threading.RLock()

    def new(self, tree: Conversation | None = None, title: str = "") -> Entry:
        with self.lock:
            entry = Entry(secrets.token_hex(6), tree or Conversation(), title=title)
            self.entries[entry.conversation_id] = entry
            self.entries.move_to_end(entry.conversation_id, last=False)
            self.current = entry.conversation_id
            while len(self.entries) > self.max_conversations:
                oldest = min((e for e in self.entries.values() if e.conversation_id != self.current),
                             key=lambda e: e.updated)
                del self.entries[oldest.conversation_id]
            return entry

    def get(self, conversation_id: str | None) -> Entry | None:
        return self.entries.get(conversation_id) if conversation_id else None

    def open(self, conversation_id: str | None = None) -> Entry:
        """The conversation ``conversation_id`` (or the one shown last, or a new one), now current."""
        with self.lock:
            entry = self.get(conversation_id) or self.get(self.current)
            if entry is None:
                entry = self.new()
            self.current = entry.conversation_id
            return entry

    def touch(self, conversation_id: str | None) -> None:
        entry = self.get(conversation_id)
        if entry is not None:
            entry.updated = time.time()

    def rename(self, conversation_id: str, title: str) -> Entry:
        entry = self.get(conversation_id)
        if entry is None:
            raise KeyError(conversation_id)
        entry.title = " ".join(title.split())[:TITLE_CHARS]
        return entry

    def delete(self, conversation_id: str) -> Entry:
        """Drop a conversation; the one now current (another, or a new empty one)."""
        with self.lock:
            self.entries.pop(conversation_id, None)
            if self.current == conversation_id or self.current not in self.entries:
                self.current = next(iter(self.entries), None)
            return self.open(self.current)

    def choices(self) -> list[tuple[str, str]]:
        """(name, id) of every conversation, newest first: the sidebar's list."""
        return [(e.name(), e.conversation_id) for e in self.entries.values()]


class Libraries:
    """Every browser's ``Library``, by browser key."""

    def __init__(self, max_browsers: int = 1000, max_conversations: int = 50):
        self.max_browsers, self.max_conversations = max_browsers, max_conversations
        self._libraries: OrderedDict[str, Library] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str | None) -> tuple[str, Library]:
        """The library of browser ``key``; a new key and library when it is unknown or missing."""
        with self._lock:
            if not isinstance(key, str) or key not in self._libraries:
                key = secrets.token_urlsafe(18)
                self._libraries[key] = Library(self.max_conversations)
            self._libraries.move_to_end(key)
            while len(self._libraries) > self.max_browsers:
                self._libraries.popitem(last=False)
            return key, self._libraries[key]

    def __len__(self) -> int:
        return len(self._libraries)
