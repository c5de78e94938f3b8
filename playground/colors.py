"""Owner colours and names that stay put while requests come and go.

A colour is given to an *owner group*, not to a request: every turn of one
chat (``chat-<tab>-<n>``) belongs to the group ``chat-<tab>``, so a chat keeps
its colour across turns; each batch-demo request is its own group. A group
keeps its palette slot for as long as it is among the ``len(PALETTE)`` most
recently seen groups, so a request never changes colour during its life,
whatever else starts or ends. One ``OwnerColors`` serves every tab of an app,
so the block map and the batch table of every tab agree.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable

from .styles import PALETTE

__all__ = ["OwnerColors", "owner_group"]

_CHAT = re.compile(r"^(chat-[0-9a-f]+)-\d+$")


def owner_group(request_id: str) -> str:
    """The group a request's colour belongs to (a chat's turns share one)."""
    m = _CHAT.match(request_id)
    return m.group(1) if m else request_id


class OwnerColors:
    """Palette slots for owner groups, least recently seen given up first."""

    def __init__(self) -> None:
        self._slots: OrderedDict[str, int] = OrderedDict()   # group -> slot, least recently seen first
        self._chat_numbers: dict[str, int] = {}
        self._lock = threading.Lock()

    def colors(self, request_ids: Iterable[str]) -> dict[str, str]:
        """``{request_id: colour}``; requests seen before keep theirs."""
        out = {}
        with self._lock:
            for rid in request_ids:
                rid = str(rid)
                if rid in out:
                    continue
                group = owner_group(rid)
                if group in self._slots:
                    self._slots.move_to_end(group)
                else:
                    taken = set(self._slots.values())
                    free = [s for s in range(len(PALETTE)) if s not in taken]
                    if free:
                        slot = free[0]
                    else:   # give up the least recently seen group's slot
                        _, slot = self._slots.popitem(last=False)
                    self._slots[group] = slot
                    if group.startswith("chat-"):
                        self._chat_numbers.setdefault(group, len(self._chat_numbers) + 1)
                out[rid] = PALETTE[self._slots[group]]
        return out

    def name(self, request_id: str, own_session: str | None = None) -> str:
        """Legend name: "this chat" for the viewer's own chat, "chat 2" for another tab's."""
        group = owner_group(request_id)
        if own_session is not None and group == f"chat-{own_session}":
            return "this chat"
        if group in self._chat_numbers:
            return f"chat {self._chat_numbers[group]}"
        return request_id if len(request_id) <= 14 else "…" + request_id[-12:]
