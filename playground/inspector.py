"""The block inspector: what one KV block holds, for a click on the block map.

A snapshot says, per block, its state, reference count, owners, whether it
is hashed (so the prefix cache can find it) and which token positions of its
first owner it holds. The text of those tokens is shown only when the owner is
the viewer's own request (the tab knows its prompt and reply tokens); other
visitors' blocks show positions, never their text.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from html import escape
from typing import Any

from .styles import CSS as _CSS

__all__ = ["block_inspector_html", "BLOCK_CLICK_JS"]

# Click a cell: the block's id goes to the server. Hover a legend entry: that
# request's cells are outlined (class kv-hl), everything else dims.
BLOCK_CLICK_JS = """
let hovered = null;
const paint = () => {
  const grid = element.querySelector('.kv-grid');
  if (!grid) return;
  grid.classList.toggle('kv-dim', hovered !== null);
  grid.querySelectorAll('.kv-cell[data-owners]').forEach((c) => {
    c.classList.toggle('kv-hl', hovered !== null && c.dataset.owners.split(',').includes(hovered));
  });
};
element.addEventListener('click', (e) => {
  const cell = e.target.closest('.kv-cell');
  if (cell) trigger('click', {block: Number(cell.dataset.block)});
});
element.addEventListener('mouseover', (e) => {
  const item = e.target.closest('.kv-legend-item[data-request]');
  const next = item ? item.dataset.request : null;
  if (next !== hovered) { hovered = next; paint(); }
});
element.addEventListener('mouseleave', () => { hovered = null; paint(); });
// The map is redrawn several times a second: keep the highlight on the new cells.
new MutationObserver(() => { if (hovered !== null) paint(); }).observe(element, {childList: true, subtree: true});
"""


def block_inspector_html(
    snapshot: Mapping[str, Any] | None,
    block_id: int | None,
    *,
    name: Callable[[str], str] = str,
    own_tokens: Mapping[str, Sequence[int]] | None = None,
    own_requests: Collection[str] = (),
    last_owner: tuple[str, str, tuple[int, int]] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> str:
    """Describe ``block_id`` of ``snapshot``.

    Args:
        name: request id -> the name the legend uses ("this chat", "chat 2").
        own_tokens: this viewer's requests -> their token ids (prompt + output),
            the only ones whose text may be shown.
        own_requests: every request of this viewer (its batch demo's too, whose tokens it does not keep).
        last_owner: ``(block hash, request, token range)`` of the request that last held the block
            (``EngineMonitor.last_owner``): a cached block keeps no owner, but if the block still has
            that hash and the request is this viewer's, its text is shown.
        decode: token ids -> text.
        provenance: this viewer's finished requests -> their ``engine.provenance.Provenance``: the
            block's positions get a line saying what computed them (``provenance_view.block_source``).
    """
    if snapshot is not None and snapshot.get("blocks_hidden"):
        return (f'{_CSS}<div class="pg-panel block-inspector block-hidden"><i>No block to inspect: this server '
                "does not expose its KV blocks (the map above says why).</i></div>")
    if snapshot is None or block_id is None:
        return f'{_CSS}<div class="pg-panel block-inspector"><i>Click a block for what it holds.</i></div>'
    block = next((b for b in snapshot.get("blocks") or [] if b.get("block_id") == block_id), None)
    if block is None:
        return f'{_CSS}<div class="pg-panel block-inspector">No block {int(block_id)} in this engine.</div>'
    ref = int(block.get("ref_cnt", 0))
    state = ("shared" if ref > 1 else "used") if ref else ("cached, reusable" if block.get("hashed") else "free")
    owners = [str(o) for o in block.get("owners") or []]
    rows = [("block", block_id), ("state", state), ("reference count", ref),
            ("hashed (findable by the prefix cache)",
             f"yes, {block['block_hash'][:8]}…" if block.get("block_hash") else ("yes" if block.get("hashed") else "no"))]
    if owners:
        rows.append(("owners", ", ".join(name(o) for o in owners)))
    span = block.get("token_range")
    text = None
    cached_from = None
    if not owners and last_owner and block.get("block_hash") and last_owner[0] == block["block_hash"]:
        cached_from, span = last_owner[1], last_owner[2]       # the same content its last owner wrote
        rows.append(("written by", name(cached_from)))
    if span and span[1] > span[0]:
        rows.append(("token positions", f"{span[0]}–{span[1] - 1} ({span[1] - span[0]} tokens)"))
        mine = next((o for o in [*owners, cached_from] if o and own_tokens and o in own_tokens), None)
        if mine is not None and decode is not None:
            text = decode(list(own_tokens[mine])[span[0]:span[1]])
    if span and provenance:
        from .provenance_view import block_source

        source = next((o for o in [*owners, cached_from] if o in provenance), None)
        line = block_source(provenance[source], span[0], span[1], name) if source is not None else None
        if line:
            rows.append(("K/V computed", line))
    mine_untold = next((o for o in owners if o in own_requests), None)
    table = "".join(f'<tr data-field="{escape(str(k))}"><td>{escape(str(k))}</td><td><b>{escape(str(v))}</b></td></tr>'
                    for k, v in rows)
    if text is not None:
        body = f'<div class="pg-sub">Its tokens</div><pre class="block-text">{escape(text)}</pre>'
    elif state == "free":
        body = "<div>Holds nothing: the next request that needs a block may take it.</div>"
    elif state == "cached, reusable":
        body = ("<div>No request holds it, but its hash keeps it findable: a prompt that starts with the same "
                "tokens reuses it instead of computing them. It is evicted when free blocks run out.</div>")
    elif mine_untold is not None:
        body = f"<div>{escape(name(mine_untold))}, a request of this tab: its reply is in the Batch demo tab.</div>"
    else:
        body = "<div>Another visitor's request: its text is not shown.</div>"
    return (f'{_CSS}<div class="pg-panel block-inspector" data-block="{int(block_id)}">'
            f'<table class="pg-stats">{table}</table>{body}</div>')
