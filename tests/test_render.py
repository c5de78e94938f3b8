"""Renderers (playground.render): handcrafted snapshot dicts → HTML content."""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser

import pytest

from playground import render
from playground.logprobs import entropy_bits, forced_record, token_records


class Elements(HTMLParser):
    """Collect every start tag as (tag, attrs, text inside it up to its end)."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.items: list[dict] = []
        self._open: list[dict] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        item = {"tag": tag, "attrs": dict(attrs), "text": ""}
        self.items.append(item)
        if tag not in ("br", "img", "input", "meta", "link"):
            self._open.append(item)

    def handle_endtag(self, tag):
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i]["tag"] == tag:
                del self._open[i:]
                break

    def handle_data(self, data):
        for item in self._open:
            item["text"] += data

    def by_class(self, cls: str) -> list[dict]:
        return [i for i in self.items if cls in (i["attrs"].get("class") or "").split()]


def _block(bid, state, ref=0, owners=(), hashed=False, token_range=None):
    return {"block_id": bid, "state": state, "ref_cnt": ref, "owners": list(owners),
            "hashed": hashed, "token_range": token_range}


@pytest.fixture
def snapshot():
    blocks = [
        _block(0, "used", 2, ["req-a", "req-b"], True, [0, 16]),      # shared prefix
        _block(1, "used", 1, ["req-a"], True, [16, 32]),
        _block(2, "used", 1, ["req-a"], False, [32, 40]),
        _block(3, "used", 1, ["req-b"], False, [16, 20]),
        _block(4, "cached", 0, [], True, None),
        _block(5, "cached", 0, [], True, None),
    ] + [_block(i, "free") for i in range(6, 10)]
    return {
        "step": 42, "model": "smollm2-135m-instruct", "model_impl": "native", "device": "cpu",
        "block_size": 16, "num_blocks": 10, "kv_usage": 0.4, "blocks": blocks,
        "requests": [
            {"request_id": "req-a", "status": "running", "block_table": [0, 1, 2], "num_prompt_tokens": 30,
             "num_computed_tokens": 40, "num_cached_tokens": 16, "num_output_tokens": 10},
            {"request_id": "req-b", "status": "running", "block_table": [0, 3], "num_prompt_tokens": 20,
             "num_computed_tokens": 20, "num_cached_tokens": 16, "num_output_tokens": 0},
        ],
        "prefix_cache": {"queries": 200, "hits": 80, "hit_rate": 0.4, "requests": 5, "reset_count": 1},
        "last_step": {"step": 42, "batch_size": 2, "num_tokens": 6, "prefill": {"req-b": 5},
                      "decode": ["req-a"], "duration_s": 0.01},
    }


def test_block_map_one_cell_per_block_with_state_classes(snapshot):
    doc = Elements(render.block_map_html(snapshot))
    cells = doc.by_class("kv-cell")
    assert [int(c["attrs"]["data-block"]) for c in cells] == list(range(10))
    kinds = [next(k for k in ("used", "shared", "cached", "free") if f"kv-{k}" in c["attrs"]["class"]) for c in cells]
    assert kinds == ["shared", "used", "used", "used", "cached", "cached", "free", "free", "free", "free"]
    colors = render.owner_colors(["req-a", "req-b"])
    assert colors["req-a"] != colors["req-b"]
    html = render.block_map_html(snapshot)
    # Used cells are painted with their owner's colour class; the shared one with both owners'.
    cls_a, cls_b = (f"kv-o{render.PALETTE.index(colors[r])}" for r in ("req-a", "req-b"))
    assert f".{cls_a}{{background:{colors['req-a']}}}" in html
    assert cls_a in cells[1]["attrs"]["class"].split() and cls_a in cells[2]["attrs"]["class"].split()
    assert cls_b in cells[3]["attrs"]["class"].split()
    assert colors["req-a"] in cells[0]["attrs"]["style"] and colors["req-b"] in cells[0]["attrs"]["style"]
    # Cached and free cells get no owner colour: their look comes from the state CSS.
    assert "style" not in cells[4]["attrs"] and "style" not in cells[9]["attrs"]
    assert "data-owners" not in cells[9]["attrs"]
    assert ".kv-cached{" + render.STATE_STYLE["cached"] in html
    assert ".kv-free{" + render.STATE_STYLE["free"] in html
    assert len({render.STATE_STYLE[k] for k in ("shared", "cached", "free")}) == 3


def test_block_map_hover_titles(snapshot):
    cells = Elements(render.block_map_html(snapshot)).by_class("kv-cell")
    shared = cells[0]["attrs"]
    assert shared["data-ref"] == "2" and shared["data-owners"] == "req-a,req-b"
    assert "block 0" in shared["title"] and "ref 2" in shared["title"]
    assert "owners req-a, req-b" in shared["title"] and "tokens 0–15" in shared["title"]
    assert "tokens 32–39" in cells[2]["attrs"]["title"]
    assert cells[4]["attrs"]["title"] == "block 4 · cached, reusable · ref 0"
    assert "hashed" in cells[1]["attrs"]["title"] and "hashed" not in cells[2]["attrs"]["title"]
    assert cells[7]["attrs"]["title"] == "block 7 · free"


def test_block_map_legend_and_header(snapshot):
    doc = Elements(render.block_map_html(snapshot, labels={"req-a": "this chat"}))
    legend = {i["attrs"].get("data-request") or i["attrs"]["data-kind"]: i["text"] for i in doc.by_class("kv-legend-item")}
    assert legend == {
        "req-a": "this chat (3)",          # blocks 0, 1, 2
        "req-b": "req-b (2)",              # blocks 0, 3
        "shared": "shared (ref > 1) (1)",
        "cached": "cached, reusable (2)",
        "free": "free (4)",
    }
    head = doc.by_class("pg-head")[0]["text"]
    assert "4 / 10 blocks in use (40.0%)" in head and "step 42" in head


def test_block_map_readable_at_thousands_of_blocks():
    n = 2500
    blocks = [_block(i, "used", 1, [f"r{i % 7}"], False, [0, 16]) if i < 700 else _block(i, "free") for i in range(n)]
    snap = {"blocks": blocks, "requests": [], "block_size": 16, "step": 1}
    html = render.block_map_html(snap)
    doc = Elements(html)
    assert len(doc.by_class("kv-cell")) == n
    grid = doc.by_class("kv-grid")[0]["attrs"]["style"]
    assert "repeat(64," in grid              # denser grid for big pools
    assert len(html) < 100 * n               # compact: updates every second stay small
    owners = [i for i in doc.by_class("kv-legend-item") if i["attrs"].get("data-kind") == "owner"]
    assert len(owners) == 7
    swatches = [i for i in doc.items if i["attrs"].get("class") == "kv-swatch"]
    owner_colors = {re.search(r"#[0-9a-f]{6}", s["attrs"]["style"]).group(0) for s in swatches[:7]}
    assert len(owner_colors) == 7            # seven requests, seven colours
    used = [c for c in doc.by_class("kv-used")]
    assert len({c["attrs"]["class"] for c in used}) == 7


def test_owner_colors_stable_and_distinct():
    first = render.owner_colors(["x", "y"])
    again = render.owner_colors(["w", "x", "y", "z"])
    assert first["x"] == render.owner_colors(["x"])["x"]
    many = render.owner_colors([f"r{i}" for i in range(len(render.PALETTE))])
    assert len(set(many.values())) == len(render.PALETTE)
    assert set(again.values()) <= set(render.PALETTE)


def test_prefix_cache_panel(snapshot):
    history = [{"num_prompt_tokens": 40, "num_cached_tokens": 0},
               {"num_prompt_tokens": 80, "num_cached_tokens": 48}]
    doc = Elements(render.prefix_cache_html(snapshot, history))
    assert doc.by_class("cached-tokens")[0]["text"] == "48"
    assert doc.by_class("computed-tokens")[0]["text"] == "32"
    assert "width:60.00%" in doc.by_class("seg-cached")[0]["attrs"]["style"]
    bars = [i for i in doc.items if i["tag"] == "rect" and "bar" in i["attrs"].get("class", "")]
    assert [float(b["attrs"]["data-value"]) for b in bars] == [0.0, 0.6]
    assert "turn 2: 48/80 tokens cached (60%)" in bars[1]["text"]
    stats = {i["attrs"]["data-stat"]: i["text"] for i in doc.items if "data-stat" in i["attrs"]}
    assert stats["queried tokens"].endswith("200") and stats["hit tokens"].endswith("80")
    assert stats["hit rate"].endswith("40.0%") and stats["KV usage"].endswith("40.0%")
    assert stats["cached blocks"].endswith("2") and stats["resets"].endswith("1")


def test_prefix_cache_panel_without_turns(snapshot):
    html = render.prefix_cache_html(snapshot, [])
    assert "Send a message" in html and "no data yet" in html


def _lp(value, rank, text):
    return {"logprob": math.log(value), "rank": rank, "decoded_token": text}


@pytest.fixture
def records():
    ids = [11, 12, 13]
    logprobs = [
        {11: _lp(0.9, 1, "Hello"), 20: _lp(0.06, 2, "Hi"), 21: _lp(0.04, 3, "Hey")},
        {12: _lp(0.2, 2, ","), 22: _lp(0.7, 1, "!")},
        {13: _lp(0.5, 1, "\n")},
    ]
    return token_records(ids, logprobs)


def test_token_records(records):
    assert [r["text"] for r in records] == ["Hello", ",", "\n"]
    assert records[0]["prob"] == pytest.approx(0.9)
    assert [a["token_id"] for a in records[1]["alternatives"]] == [22, 12]   # most likely first
    assert records[0]["entropy"] == pytest.approx(-(0.9 * math.log2(0.9) + 0.06 * math.log2(0.06)
                                                    + 0.04 * math.log2(0.04)))
    assert not records[0]["entropy_is_bound"] and records[1]["entropy_is_bound"]
    h, bound = entropy_bits([0.5, 0.5])
    assert h == pytest.approx(1.0) and not bound


def test_logprob_view_spans(records):
    doc = Elements(render.logprob_html(records, selected=1))
    toks = doc.by_class("lp-tok")
    assert [t["attrs"]["data-index"] for t in toks] == ["0", "1", "2"]
    assert [float(t["attrs"]["data-prob"]) for t in toks] == pytest.approx([0.9, 0.2, 0.5])
    # Colour follows probability: green-ish for 0.9, red-ish for 0.2.
    assert render.prob_color(0.9) in toks[0]["attrs"]["style"] and "hsl(108," in toks[0]["attrs"]["style"]
    assert "hsl(24," in toks[1]["attrs"]["style"]
    assert "lp-selected" in toks[1]["attrs"]["class"] and "lp-selected" not in toks[0]["attrs"]["class"]
    tip = doc.by_class("lp-tip")[1]
    assert "!70.00%" in tip["text"].replace(" ", "") and ",20.00%" in tip["text"].replace(" ", "")
    chosen = doc.by_class("lp-chosen")[1]
    assert chosen["attrs"]["data-token-id"] == "12"
    assert "entropy ≥" in tip["text"]          # 10% of the mass is outside the top-k
    assert "entropy 0.57 bits" in doc.by_class("lp-tip")[0]["text"]
    # The newline token is shown as ↵ and breaks the line.
    assert toks[2]["text"].startswith("↵")
    assert "</span></span><br>" in render.logprob_html(records)


def test_forced_token_keeps_alternatives(records):
    forced = forced_record(1, 22, "!", records[1])
    assert forced["forced"] and forced["prob"] == pytest.approx(0.7) and forced["text"] == "!"
    doc = Elements(render.logprob_html([records[0], forced]))
    tok = doc.by_class("lp-tok")[1]
    assert "lp-forced" in tok["attrs"]["class"] and "forced by branch" in tok["text"]


def test_logprob_view_empty():
    assert "next reply" in render.logprob_html([])


def test_engine_panel(snapshot):
    steps = [{"step": 40, "batch_size": 1, "num_tokens": 30, "num_prefill": 1, "num_decode": 0, "duration_s": 0.05},
             {"step": 41, "batch_size": 3, "num_tokens": 3, "num_prefill": 0, "num_decode": 3, "duration_s": 0.01},
             {"step": 42, "batch_size": 2, "num_tokens": 9, "num_prefill": 1, "num_decode": 1}]
    doc = Elements(render.engine_panel_html(snapshot, steps, {"ttft": 0.25, "decode_tps": 42.5}))
    cards = {c["attrs"]["data-card"]: c["text"] for c in doc.items if "data-card" in c["attrs"]}
    assert cards["model"].endswith("smollm2-135m-instruct")
    assert cards["model_impl"].endswith("native")
    assert cards["ttft"].endswith("250 ms") and cards["decode_tps"].endswith("42.5 tok/s")
    assert cards["running"].endswith("2") and cards["step"].endswith("42")
    bars = [i for i in doc.items if i["tag"] == "rect"]
    assert [b["attrs"]["data-value"] for b in bars] == ["1", "3", "2"]
    assert bars[0]["attrs"]["fill"] != bars[1]["attrs"]["fill"]       # prefill steps stand out
    assert bars[2]["attrs"]["fill"] == bars[0]["attrs"]["fill"]
    assert "step 41: batch 3 (3 decoding), 3 tokens, 10.0 ms" in bars[1]["text"]
    assert "step 42: batch 2 (1 prefilling, 1 decoding), 9 tokens" in bars[2]["text"]


def test_engine_panel_before_any_request(snapshot):
    html = render.engine_panel_html(snapshot)
    assert "no engine steps yet" in html and "–" in html


def test_batch_table():
    rows = [{"request_id": "batch-1", "question": "Name a colour.", "text": "Blue.", "num_prompt_tokens": 30,
             "num_cached_tokens": 16, "finished": True, "error": None},
            {"request_id": "batch-2", "question": "Name a planet.", "text": "Mar", "num_prompt_tokens": 31,
             "num_cached_tokens": 16, "finished": False, "error": None},
            {"request_id": "batch-3", "question": "Hi", "text": "", "num_prompt_tokens": 0,
             "num_cached_tokens": 0, "finished": True, "error": "ValueError: boom"}]
    doc = Elements(render.batch_table_html(rows))
    trs = doc.by_class("batch-row")
    assert [(t["attrs"]["data-request"], t["attrs"]["data-state"]) for t in trs] == [
        ("batch-1", "done"), ("batch-2", "streaming…"), ("batch-3", "error")]
    assert "Blue." in trs[0]["text"] and "16/30" in trs[0]["text"] and "ValueError: boom" in trs[2]["text"]
    assert "Fire a batch" in render.batch_table_html([])


def test_alignment_table():
    report = {"model": "m", "impl_a": "native", "impl_b": "paddleformers", "all_greedy_identical": False,
              "rows": [{"positions": 40, "top1_agreement": 0.975, "max_abs_logprob_diff": 1.5e-4,
                        "mean_kl": 2e-9, "greedy_identical": False, "first_divergence": 7, "greedy_tokens": 16}]}
    doc = Elements(render.alignment_html(report))
    row = doc.by_class("align-row")[0]
    assert row["attrs"]["data-identical"] == "false"
    assert "97.5%" in row["text"] and "1.50e-04" in row["text"] and "differs at token 7 (16 tokens)" in row["text"]
    assert doc.by_class("align-verdict")[0]["text"] == "greedy outputs differ"
    assert "native" in doc.by_class("pg-head")[0]["text"]
    assert "Backend consistency" in render.alignment_html(None) and "not accuracy" in render.alignment_html(None)


def _colliding_ids():
    """Two request ids whose hashes pick the same palette slot."""
    import zlib
    seen = {}
    for i in range(1000):
        rid = f"batch-{i}"
        slot = zlib.crc32(rid.encode()) % len(render.PALETTE)
        if slot in seen:
            return seen[slot], rid
        seen[slot] = rid


def test_owner_colours_never_change_during_a_request():
    """Bug 6: a hash collision re-resolved each frame moved a running request to another colour."""
    from playground.colors import OwnerColors

    a, b = _colliding_ids()
    book = OwnerColors()
    mine = book.colors([a])[a]
    assert book.colors([b, a])[a] == mine             # b arrived first in a later snapshot: a keeps its colour
    assert book.colors([b, a])[b] != mine
    # A chat keeps one colour across its turns; another tab's chat is named "chat N", not by its id.
    assert book.colors(["chat-abc123-1"])["chat-abc123-1"] == book.colors(["chat-abc123-7"])["chat-abc123-7"]
    book.colors(["chat-def456-2"])
    assert book.name("chat-abc123-7", own_session="abc123") == "this chat"
    assert book.name("chat-def456-2", own_session="abc123") == "chat 2"
    # The block map paints with the colours it is given, so the map and the batch table agree.
    snap = {"blocks": [_block(0, "used", 1, [a]), _block(1, "used", 1, [b])], "requests": [], "block_size": 16}
    colors = book.colors([a, b])
    html = render.block_map_html(snap, colors=colors)
    assert f"kv-o{render.PALETTE.index(colors[a])}" in html and f"kv-o{render.PALETTE.index(colors[b])}" in html
    table = render.batch_table_html([{"request_id": a, "question": "q", "text": "", "finished": False}],
                                    colors=colors)
    assert colors[a] in table


def test_last_axis_label_stays_inside_the_chart():
    """Bug 7: the last x-axis label was centred on the right edge and clipped."""
    from playground.svgchart import bar_chart_svg

    svg = bar_chart_svg([1] * 120, labels=[str(1000 + i) for i in range(120)], width=420)
    texts = re.findall(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="(\w+)"[^>]*>(\d{4})</text>', svg)
    x, anchor, label = texts[-1]
    right = float(x) + (0 if anchor == "end" else 3.0 * len(label))
    assert label == "1119" and right <= 420


def test_conversation_tree_keeps_every_branch():
    from playground.conversation import Conversation

    class R:   # the fields of chat.Reply that the tree reads
        def __init__(self, text, error=None):
            self.text, self.error = text, error

    tree = Conversation()
    u1 = tree.add_user("Hi")
    a1 = tree.add_reply(u1.node_id, R("Hello!"))
    u2 = tree.add_user("Name a colour.")
    first = tree.add_reply(u2.node_id, R("Blue."))
    second = tree.add_reply(u2.node_id, R("Red."))
    assert [n.label for n in tree.replies()] == ["1", "2", "2b"]
    assert tree.siblings(second.node_id) == (2, 2) and tree.last_reply() is second
    u3 = tree.add_user("Why?")                       # continues the branch shown
    assert u3.parent == second.node_id
    assert tree.messages_before(u3.node_id)[-1] == {"role": "assistant", "content": "Red."}
    assert tree.navigate(second.node_id, -1) and tree.last_reply() is first   # the other branch, no "Why?"
    assert [n.text for n in tree.path()] == ["Hi", "Hello!", "Name a colour.", "Blue."]
    assert not tree.navigate(first.node_id, -1)      # nothing before the first branch
    tree.navigate(first.node_id, 1)
    assert [n.text for n in tree.path()][-2:] == ["Red.", "Why?"]   # the path below follows the branch
    failed = tree.add_reply(u3.node_id, R("", error="boom"))
    u4 = tree.add_user("Again?")
    assert {"role": "assistant", "content": ""} not in tree.messages_before(u4.node_id)   # errors are not context
    assert failed.parent == u3.node_id and a1.label == "1"


def test_logprob_view_toggles_probability_logprob_rank(records):
    prob = render.logprob_html(records)
    raw = render.logprob_html(records, metric="logprob")
    rank = render.logprob_html(records, metric="rank")
    assert "<td>90.00%</td>" in prob and f"<td>{math.log(0.9):.3f}</td>" in raw and "<td>#1</td>" in rank
    # Rank colours: token 1 (","), sampled at rank 2, is no longer coloured like its 20% probability.
    tok = [t for t in Elements(rank).by_class("lp-tok") if t["attrs"]["data-index"] == "1"][0]
    assert render.prob_color(0.5) in tok["attrs"]["style"]
    assert "rank <span>#4+</span>" in rank and "logprob <span>−∞</span>" in raw


def test_engine_badges_name_the_attention_kernels_and_decode_path(smollm2_llm):
    """The header (Gradio and the widget) says which kernels and which decode path serve the model."""
    badges = render.engine_badges(smollm2_llm.snapshot().to_dict())
    assert badges[:3] == ["smollm2-135m-instruct", "native", "cpu"]
    assert "attention: cpu" in badges
    assert any(b.startswith("decode: fused") or b.startswith("decode: paddle") for b in badges)
    assert "None" not in " ".join(badges)


def test_block_hash_in_the_snapshot_is_the_stored_event_hash_and_the_inspector_shows_it(smollm2_llm):
    """A hashed block carries the prefix-cache hash that its blocks_stored event named."""
    from engine import SamplingParams
    from playground import inspector

    stored = {}
    unsubscribe = smollm2_llm.subscribe(
        lambda e: stored.update(zip(e.data["block_ids"], e.data["block_hashes"])) if e.kind == "blocks_stored" else None)
    try:
        smollm2_llm.generate([" ".join(["hashing"] * 40)], SamplingParams(max_tokens=2, temperature=0))
    finally:
        unsubscribe()
    snap = smollm2_llm.snapshot().to_dict()
    hashed = [b for b in snap["blocks"] if b["block_hash"]]
    assert hashed and all(b["hashed"] for b in hashed)
    assert not any(b["block_hash"] for b in snap["blocks"] if not b["hashed"])
    for b in hashed:
        if b["block_id"] in stored:
            assert stored[b["block_id"]].startswith(b["block_hash"])
    assert any(b["block_id"] in stored for b in hashed)
    html = inspector.block_inspector_html(snap, hashed[0]["block_id"])
    assert hashed[0]["block_hash"][:8] in html


def test_every_tab_draws_a_snapshots_cells_once(snapshot, monkeypatch):
    """Four tabs refreshing the same snapshot drew all its cells four times; the cells (not the
    legend, whose names differ per tab) are drawn once and shared."""
    monkeypatch.setattr(render, "_cells", {})
    drawn = []
    title = render._cell_title
    monkeypatch.setattr(render, "_cell_title", lambda b, kind: drawn.append(b["block_id"]) or title(b, kind))
    snap = dict(snapshot, blocks=tuple(snapshot["blocks"]))     # as the monitor keeps it: immutable blocks
    mine = render.block_map_html(snap, labels={"req-a": "this chat", "req-b": "chat 2"})
    theirs = render.block_map_html(snap, labels={"req-a": "chat 1", "req-b": "this chat"})
    assert sorted(drawn) == list(range(10))
    assert mine != theirs and mine.split('class="kv-legend"')[0] == theirs.split('class="kv-legend"')[0]
    assert "this chat (2)" in theirs and "chat 1 (3)" in theirs
    render.block_map_html(dict(snap, blocks=tuple(dict(b) for b in snap["blocks"])))    # a new snapshot
    assert len(drawn) == 10                     # ... of the same blocks: every cell as drawn before


def test_a_new_snapshot_draws_only_the_cells_of_blocks_that_changed(snapshot, monkeypatch):
    """Between two snapshots of a decoding engine only the blocks requests wrote to change: the map
    draws those cells again and takes the others as drawn before, with the same HTML as a map drawn
    from scratch."""
    monkeypatch.setattr(render, "_cells", {})
    drawn = []
    title = render._cell_title
    monkeypatch.setattr(render, "_cell_title", lambda b, kind: drawn.append(b["block_id"]) or title(b, kind))
    render.block_map_html(dict(snapshot, blocks=tuple(snapshot["blocks"])))
    assert sorted(drawn) == list(range(10))
    changed = [dict(b) for b in snapshot["blocks"]]
    changed[3] = dict(changed[3], ref_cnt=changed[3]["ref_cnt"] + 1, owners=[*changed[3]["owners"], "req-c"])
    drawn.clear()
    html = render.block_map_html(dict(snapshot, blocks=tuple(changed)))
    assert drawn == [3]
    monkeypatch.setattr(render, "_cells", {})
    monkeypatch.setattr(render, "_last_grid", ())
    assert html == render.block_map_html(dict(snapshot, blocks=tuple(changed)))


def test_the_monitors_snapshot_dict_is_the_snapshots_to_dict(smollm2_llm):
    """The monitor builds the dict without asdict's deep copy (several times a second, on the
    interpreter and cores the engine needs); the content is the same."""
    import threading

    from engine import SamplingParams
    from playground.monitor import snapshot_dict

    done = threading.Event()
    snaps = []
    worker = threading.Thread(target=lambda: (smollm2_llm.generate(
        ["Tell me about the sea."] * 2, SamplingParams(max_tokens=24, temperature=0, logprobs=2)), done.set()))
    worker.start()
    while not done.is_set() and len(snaps) < 50:
        snaps.append(smollm2_llm.snapshot())
    worker.join()
    assert any(s.requests and s.last_step for s in snaps)
    for s in snaps[::5] + snaps[-1:]:
        d = snapshot_dict(s)
        assert d == s.to_dict() and isinstance(d["blocks"], tuple)
    last = None                     # the monitor's way: each dict built on the previous one
    for s in snaps:
        d = snapshot_dict(s, last)
        assert d == s.to_dict()
        if last is not None:        # a block the engine kept (same BlockInfo) keeps its dict
            for i, (a, b) in enumerate(zip(last[0].blocks, s.blocks)):
                assert (last[1]["blocks"][i] is d["blocks"][i]) == (a is b)
        last = (s, d)


def test_the_monitor_slows_down_while_no_view_reads_it(paced_engine):
    """The monitor took a snapshot (under the engine's lock) every interval whenever the engine
    ran, watched or not; unwatched it takes one per idle interval, and a view's read brings the
    fast pace back at once."""
    import threading
    import time

    from engine import SamplingParams
    from playground.monitor import EngineMonitor

    class Counting:                      # the real engine, counting the monitor's snapshots
        def __init__(self):
            self.calls = []

        def snapshot(self):
            self.calls.append(time.monotonic())
            return paced_engine.snapshot()

        def subscribe(self, callback):
            return paced_engine.subscribe(callback)

    llm = Counting()
    twelve = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)     # 12 steps of >= 0.1 s
    monitor = EngineMonitor(llm, interval=0.02, idle_interval=0.5, idle_after=0.1)
    try:
        time.sleep(0.2)                                          # nobody has read it for a while
        start = time.monotonic()
        paced_engine.generate(["Tell me about the sea."], twelve)
        unwatched = time.monotonic() - start
        taken = [t for t in llm.calls if t >= start]
        assert len(taken) <= unwatched / 0.5 + 2, (len(taken), unwatched)
        version = monitor.version
        reading = threading.Event()

        def view():                                              # a tab's timer: a read every 20 ms
            while not reading.wait(0.02):
                monitor.snapshot()

        reader = threading.Thread(target=view)
        reader.start()
        start = time.monotonic()
        try:
            paced_engine.generate(["Tell me about the moon."], twelve)
        finally:
            reading.set()
            reader.join()
        watched = time.monotonic() - start
        assert monitor.version > version
        assert len([t for t in llm.calls if t >= start]) > watched / 0.5 + 2, watched
    finally:
        monitor.close()


def test_every_tabs_map_of_one_snapshot_reads_its_blocks_owners_once(snapshot):
    """Every open tab draws the same snapshot's map several times a second (only its legend names
    differ). Each drawing listed the owners of every block again to order the colours, on top of
    the grid of cells (drawn once per snapshot): four tabs read each block's owners five times.
    The owners' order is now kept for the last snapshot, like the grid."""
    reads = []

    class Block(dict):
        def get(self, key, default=None):
            if key == "owners":
                reads.append(self["block_id"])
            return super().get(key, default)

    snap = {**snapshot, "blocks": tuple(Block(b) for b in snapshot["blocks"]),
            "requests": tuple(snapshot["requests"])}
    names = ("this chat", "chat 2", "chat 3", "chat 4")
    maps = [render.block_map_html(snap, labels={"req-a": names[0]}, css=False)]
    first = len(reads)
    assert first > 0
    maps += [render.block_map_html(snap, labels={"req-a": name}, css=False) for name in names[1:]]
    assert all(f"{name} (3)" in m for m, name in zip(maps, names))
    assert len(reads) == first          # the other tabs' drawings reuse the order and the grid


def test_the_logprob_view_draws_each_token_once_and_redraws_what_changed(records):
    """A streaming reply's view is drawn again with every token so far: the tokens drawn before come
    from a cache, and a token that changed (it ended the reply) or another metric is drawn again."""
    render._SPANS.clear()
    first = render.logprob_html(records, selected=1)
    assert len(render._SPANS) == len(records) - 1          # the selected token is drawn each time
    again = render.logprob_html(records, selected=1)
    render._SPANS.clear()
    assert again == first == render.logprob_html(records, selected=1)
    records[-1]["stop"] = True                             # the reply ended on its last token
    ended = render.logprob_html(records)
    assert re.findall(r"<span class=\"lp-tok[^\"]*\"", ended)[-1] == "<span class=\"lp-tok lp-end\""
    assert "ended the reply" in ended and "ended the reply" not in render.logprob_html(records[:-1])
    assert render.logprob_html(records, metric="rank") != render.logprob_html(records, metric="probability")
