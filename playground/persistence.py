"""A conversation as a JSON document: what Export writes and Import reads.

The document is versioned (``FORMAT``, ``VERSION``) and holds two views of the conversation:

* ``messages``: the shown path as OpenAI chat messages (``{"role", "content"}``, a system
  message first when there is one), so any OpenAI-style client can replay it;
* ``tree``: every message and branch (``nodes``, in creation order, each with its ``parent``
  and the index of the child it ``shows``); a reply keeps its token ids, its per-token
  logprob records (``playground.logprobs.token_records``), why it ended and its stats.

``to_document`` writes one; ``from_document`` checks one before building anything and raises
``DocumentError`` naming the first wrong field (``tree.nodes[3].parent: ...``) and what is
accepted. A file with ``messages`` and no ``tree`` (a plain OpenAI conversation) is read as a
single path without logprobs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from .chat import Reply
from .conversation import Conversation, Node

__all__ = ["FORMAT", "VERSION", "MAX_BYTES", "DocumentError", "to_document", "from_document", "dumps", "loads"]

FORMAT = "fleet-playground/conversation"
VERSION = 1
MAX_BYTES = 20 * 2**20
MAX_NODES = 5000
ROLES = ("user", "assistant")
FINISH_REASONS = (None, "stop", "length", "abort", "error")
# Reply fields kept in a document, with the JSON types each accepts.
_REPLY_FIELDS = {
    "text": (str,), "token_ids": (list,), "prefix_token_ids": (list,), "prompt_token_ids": (list,),
    "records": (list,), "num_prompt_tokens": (int,), "num_cached_tokens": (int,),
    "finish_reason": (str, type(None)), "error": (str, type(None)), "stopped": (bool,),
    "ttft": (int, float, type(None)), "decode_tps": (int, float, type(None)),
}


class DocumentError(ValueError):
    """A conversation file that cannot be imported: says which field is wrong and what is accepted."""


def _reply_dict(reply: Reply) -> dict:
    out = {name: getattr(reply, name) for name in _REPLY_FIELDS}
    # A reply still running when saved has ended for whoever reads the document.
    out["stopped"] = bool(reply.stopped or not reply.finished)
    return out


def to_document(tree: Conversation, *, title: str = "", system: str = "", model: str = "") -> dict:
    """The conversation ``tree`` as a JSON-ready document."""
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": n.role, "content": n.text} for n in tree.path()
                 if n.role == "user" or not (n.reply is None or n.reply.error)]
    nodes = []
    for node in tree.nodes.values():
        entry: dict[str, Any] = {"id": node.node_id, "role": node.role if node.role != "root" else "root",
                                 "parent": node.parent, "shown": node.shown}
        if node.role == "user":
            entry["content"] = node.content
        elif node.role == "assistant":
            entry["label"] = node.label
            entry["reply"] = _reply_dict(node.reply)
        nodes.append(entry)
    return {"format": FORMAT, "version": VERSION, "title": title, "model": model, "saved_at": time.time(),
            "messages": messages, "tree": {"nodes": nodes}}


def dumps(document: Mapping) -> str:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":"))


def loads(data: bytes | str) -> dict:
    """Parse a file's bytes: JSON of at most ``MAX_BYTES``, an object."""
    if len(data) > MAX_BYTES:
        raise DocumentError(f"the file is {len(data) / 2**20:.1f} MiB; at most {MAX_BYTES // 2**20} MiB is accepted")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DocumentError(f"the file is not JSON ({exc}); export a conversation to see the format") from None
    if not isinstance(doc, dict):
        raise DocumentError(f"the file holds a JSON {type(doc).__name__}; a conversation is a JSON object "
                            f'with "format": "{FORMAT}"')
    return doc


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise DocumentError(f"{where}: {what}")


def _type_name(types: tuple) -> str:
    names = {str: "text", int: "a whole number", float: "a number", list: "a list", bool: "true/false",
             type(None): "null", dict: "an object"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def _check_ids(value: list, where: str) -> list[int]:
    _need(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value), where,
          "must be a list of non-negative token ids")
    return [int(t) for t in value]


def _check_records(records: list, where: str) -> list[dict]:
    for i, rec in enumerate(records):
        at = f"{where}[{i}]"
        _need(isinstance(rec, dict), at, f"must be an object; got {type(rec).__name__}")
        _need(isinstance(rec.get("token_id"), int), f"{at}.token_id", "must be a token id")
        _need(isinstance(rec.get("text"), str), f"{at}.text", "must be text")
        _need(isinstance(rec.get("alternatives", []), list), f"{at}.alternatives", "must be a list")
        rec.setdefault("index", i)
        rec.setdefault("alternatives", [])
        rec.setdefault("logprob", None)
        rec.setdefault("prob", None)
        rec.setdefault("entropy", None)
        rec.setdefault("forced", False)
    return records


def _reply(data: Any, where: str, node_id: int) -> Reply:
    _need(isinstance(data, dict), where, "must be an object with the reply's text, token_ids and records")
    values = {}
    for name, types in _REPLY_FIELDS.items():
        if name not in data:
            continue
        value = data[name]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        _need(ok, f"{where}.{name}", f"must be {_type_name(types)}; got {json.dumps(value)[:40]}")
        values[name] = value
    _need("text" in values, f"{where}.text", "is missing (the reply's text)")
    for name in ("token_ids", "prefix_token_ids", "prompt_token_ids"):
        if name in values:
            values[name] = _check_ids(values[name], f"{where}.{name}")
    if "records" in values:
        values["records"] = _check_records(values["records"], f"{where}.records")
        n_tokens = len(values.get("prefix_token_ids", [])) + len(values.get("token_ids", []))
        _need(len(values["records"]) <= n_tokens, f"{where}.records",
              f"has {len(values['records'])} records for {n_tokens} tokens; at most one per token")
    _need(values.get("finish_reason") in FINISH_REASONS, f"{where}.finish_reason",
          f"must be one of {', '.join(str(r) for r in FINISH_REASONS[1:])} or null")
    reply = Reply(request_id=f"saved-{node_id}", finished=True, state="done", **values)
    reply.finish_reason = reply.finish_reason or ("abort" if reply.stopped else "stop")
    return reply


def _from_messages(messages: Any) -> tuple[Conversation, str]:
    _need(isinstance(messages, list), "messages", "must be a list of {role, content} objects")
    tree, system = Conversation(), ""
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        _need(isinstance(m, dict), at, "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        _need(role in ("system", "user", "assistant"), f"{at}.role",
              f"must be system, user or assistant; got {json.dumps(role)[:40]}")
        _need(isinstance(content, str), f"{at}.content", "must be text")
        if role == "system":
            _need(i == 0, at, "a system message is accepted only first")
            system = content
            continue
        last = tree.last()
        expected = "user" if last is None or last.role == "assistant" else "assistant"
        _need(role == expected, f"{at}.role", f"must be {expected} here (user and assistant turns alternate)")
        if role == "user":
            tree.add_user(content)
        else:
            tree.add_reply(last.node_id, Reply(request_id=f"saved-{i}", text=content, finished=True,
                                               finish_reason="stop", state="done"))
    return tree, system


def from_document(doc: Mapping) -> tuple[Conversation, dict]:
    """The conversation of ``doc`` and its ``{"title", "system", "model"}``; ``DocumentError`` if wrong."""
    _need(isinstance(doc, Mapping), "document", "must be a JSON object")
    fmt, version = doc.get("format"), doc.get("version")
    if fmt is None and "tree" not in doc and "messages" in doc:
        tree, system = _from_messages(doc["messages"])
        return tree, {"title": "", "system": system, "model": ""}
    _need(fmt == FORMAT, "format", f'must be "{FORMAT}"; got {json.dumps(fmt)[:60]}')
    _need(version == VERSION, "version", f"this playground reads version {VERSION}; got {json.dumps(version)[:20]}")
    meta = {}
    for key in ("title", "model"):
        _need(isinstance(doc.get(key, ""), str), key, "must be text")
        meta[key] = doc.get(key, "")
    messages = doc.get("messages", [])
    _need(isinstance(messages, list), "messages", "must be a list")
    meta["system"] = next((m.get("content", "") for m in messages[:1]
                           if isinstance(m, dict) and m.get("role") == "system"), "")
    _need(isinstance(meta["system"], str), "messages[0].content", "must be text")
    tree_doc = doc.get("tree")
    _need(isinstance(tree_doc, dict) and isinstance(tree_doc.get("nodes"), list), "tree.nodes",
          "is missing: a list of the conversation's messages")
    nodes = tree_doc["nodes"]
    _need(len(nodes) <= MAX_NODES, "tree.nodes", f"has {len(nodes)} messages; at most {MAX_NODES} are accepted")
    tree = Conversation()
    built: dict[int, Node] = {0: tree.nodes[0]}
    shown: dict[int, int] = {}
    for i, data in enumerate(nodes):
        at = f"tree.nodes[{i}]"
        _need(isinstance(data, dict), at, "must be an object")
        node_id, role, parent = data.get("id"), data.get("role"), data.get("parent")
        _need(isinstance(node_id, int) and not isinstance(node_id, bool) and node_id >= 0, f"{at}.id",
              "must be a non-negative whole number")
        if role == "root" or node_id == 0:
            _need(node_id == 0 and role == "root" and parent is None, at,
                  'only the node with id 0 is the root (role "root", parent null)')
        else:
            _need(node_id not in built, f"{at}.id", f"{node_id} is used twice")
            _need(role in ROLES, f"{at}.role", f"must be user or assistant; got {json.dumps(role)[:40]}")
            _need(parent in built, f"{at}.parent",
                  f"{json.dumps(parent)[:20]} is not the id of a message before it (0 is the root)")
            parent_role = built[parent].role
            if role == "user":
                _need(parent_role in ("root", "assistant"), f"{at}.parent",
                      "a user message follows the root or a reply")
                _need(isinstance(data.get("content"), str), f"{at}.content", "must be text")
                node = Node(node_id, "user", content=data["content"], parent=parent)
            else:
                _need(parent_role == "user", f"{at}.parent", "a reply follows a user message")
                _need(isinstance(data.get("label", ""), str), f"{at}.label", "must be text")
                node = Node(node_id, "assistant", parent=parent, reply=_reply(data.get("reply"), f"{at}.reply",
                                                                               node_id),
                            label=data.get("label") or "")
            built[node_id] = tree.nodes[node_id] = node
            built[parent].children.append(node_id)
        if "shown" in data:
            _need(isinstance(data["shown"], int) and not isinstance(data["shown"], bool), f"{at}.shown",
                  "must be a whole number (the index of the child shown)")
            shown[node_id] = data["shown"]
    for node_id, index in shown.items():
        node = built[node_id]
        if node.children:
            _need(0 <= index < len(node.children), f"tree.nodes (id {node_id}).shown",
                  f"must be between 0 and {len(node.children) - 1} (it has {len(node.children)} children)")
            node.shown = index
    for node in built.values():
        if node.children and not 0 <= node.shown < len(node.children):
            node.shown = len(node.children) - 1
    tree.restart_ids(max(built) + 1)
    return tree, meta
