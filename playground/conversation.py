"""A conversation as a tree: every branch of every reply is kept.

A user message has one or more replies (the original and its branches); a
reply has the user messages sent after it. Each node remembers which of its
children is shown, so the page shows one path from the root: the messages the
model sees on the next turn. ``‹ 2/3 ›`` under a reply moves between its
siblings (the llama.cpp web UI's way), and the path below follows the sibling
shown.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Node", "Conversation"]


@dataclass
class Node:
    """One message: the root (``role="root"``), a user message or a reply."""

    node_id: int
    role: str                                   # "root" | "user" | "assistant"
    content: str = ""                           # the user's text (replies keep theirs in ``reply``)
    parent: int | None = None
    children: list[int] = field(default_factory=list)
    shown: int = -1                             # index into ``children`` of the child on the page
    reply: Any = None                           # a ``chat.Reply`` for assistant nodes
    label: str = ""                             # "2" for turn 2's first reply, "2b" for its second branch

    @property
    def text(self) -> str:
        return self.reply.text if self.reply is not None else self.content


class Conversation:
    """The tree of one tab's messages, with the path that is shown."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Back to an empty conversation (the same object: whoever holds it sees it emptied)."""
        self._ids = itertools.count(1)
        self.nodes: dict[int, Node] = {0: Node(0, "root")}

    def restart_ids(self, start: int) -> None:
        """New nodes get ids from ``start`` on (a conversation rebuilt from a saved document)."""
        self._ids = itertools.count(start)

    # -- reading ----------------------------------------------------------------
    def path(self) -> list[Node]:
        """The shown messages, oldest first (the root excluded)."""
        out, node = [], self.nodes[0]
        while node.children:
            node = self.nodes[node.children[node.shown]]
            out.append(node)
        return out

    def last(self) -> Node | None:
        path = self.path()
        return path[-1] if path else None

    def last_reply(self) -> Node | None:
        """The newest reply on the shown path (what the logprob view shows)."""
        return next((n for n in reversed(self.path()) if n.role == "assistant"), None)

    def siblings(self, node_id: int) -> tuple[int, int]:
        """(1-based position, count) of a node among its parent's children."""
        node = self.nodes[node_id]
        brothers = self.nodes[node.parent].children
        return brothers.index(node_id) + 1, len(brothers)

    def messages_before(self, node_id: int) -> list[dict]:
        """The chat messages that precede ``node_id`` on its path (the model's prompt for it).

        Replies that failed or never produced text are left out, so an error
        never becomes part of what the model is told.
        """
        chain = []
        node = self.nodes[node_id]
        while node.parent is not None:
            node = self.nodes[node.parent]
            if node.role != "root":
                chain.append(node)
        chain.reverse()
        out = []
        for n in chain:
            if n.role == "assistant" and (n.reply is None or n.reply.error):
                continue
            out.append({"role": n.role, "content": n.text})
        return out

    def text_before(self, node_id: int) -> str:
        """The path's texts before ``node_id`` run together: the document a completion continues."""
        return "".join(m["content"] for m in self.messages_before(node_id))

    def turn_number(self, node_id: int) -> int:
        """How many user messages lead to this node (its turn in the conversation)."""
        n, node = 0, self.nodes[node_id]
        while node is not None and node.role != "root":
            n += node.role == "user"
            node = self.nodes.get(node.parent) if node.parent is not None else None
        return n

    def replies(self) -> list[Node]:
        """Every reply ever generated in this tab, in creation order."""
        return [n for n in self.nodes.values() if n.role == "assistant"]

    # -- changing -----------------------------------------------------------------
    def _add(self, parent_id: int, role: str, **kw: Any) -> Node:
        node = Node(next(self._ids), role, parent=parent_id, **kw)
        self.nodes[node.node_id] = node
        parent = self.nodes[parent_id]
        parent.children.append(node.node_id)
        parent.shown = len(parent.children) - 1
        return node

    def add_user(self, text: str) -> Node:
        """A user message after the last shown message."""
        last = self.last()
        return self._add(last.node_id if last else 0, "user", content=text)

    def edit_user(self, node_id: int, text: str) -> Node:
        """An edited copy of user message ``node_id``: a sibling of it (a new branch), shown."""
        node = self.nodes.get(node_id)
        if node is None or node.role != "user":
            raise ValueError(f"message {node_id} is not a user message of this conversation")
        return self._add(node.parent, "user", content=text)

    def add_reply(self, user_id: int, reply: Any) -> Node:
        """A reply to user message ``user_id`` (a sibling of its earlier replies), shown."""
        parent = self.nodes[user_id]
        turn = self.turn_number(user_id)
        k = len(parent.children)
        label = str(turn) + ("" if k == 0 else chr(ord("a") + min(k, 25)))
        return self._add(user_id, "assistant", reply=reply, label=label)

    def remove(self, node_id: int) -> None:
        """Drop a leaf (a queued message that was never answered)."""
        node = self.nodes[node_id]
        if node.children:
            raise ValueError(f"message {node_id} has replies; only leaves can be removed")
        parent = self.nodes[node.parent]
        parent.children.remove(node_id)
        parent.shown = min(max(parent.shown, 0), len(parent.children) - 1)
        del self.nodes[node_id]

    def navigate(self, node_id: int, step: int) -> bool:
        """Show the sibling ``step`` places away from ``node_id``; False when there is none."""
        node = self.nodes.get(node_id)
        if node is None or node.parent is None:
            return False
        parent = self.nodes[node.parent]
        target = parent.children.index(node_id) + step
        if not 0 <= target < len(parent.children):
            return False
        parent.shown = target
        return True
