"""The engine panel's tensor-parallel view: each rank's KV cache and the collectives' time per step.

Drawn from the snapshot's ``tensor_parallel`` field (``TensorParallelRunner.info``), which crosses
the process and HTTP boundaries with the rest of the snapshot. Under tensor parallelism there is one
block table (rank 0's scheduler) and one paged cache per rank, each holding that rank's KV heads: a
block is the same block on every rank, its bytes are per rank. So the view shows, per rank, the KV
heads, the bytes of one block, the cache's size and the bytes the blocks in use (or cached for the
prefix cache) hold; and the last step's split into compute and communication (all-reduces after
the row-parallel layers and the embedding, the all-gather of the logits), as rank 0 timed it.
"""

from __future__ import annotations

from html import escape
from typing import Any, Mapping


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def tensor_parallel_html(snapshot: Mapping[str, Any]) -> str:
    """The view, or ``""`` for an engine of one process (no ``tensor_parallel`` in the snapshot)."""
    tp = snapshot.get("tensor_parallel")
    if not tp:
        return ""
    blocks = snapshot.get("blocks") or []
    holding = sum(1 for b in blocks if b.get("state") in ("used", "cached"))
    rows = []
    for r in tp.get("ranks", []):
        held = holding * r["bytes_per_block"]
        rows.append(f'<tr data-rank="{r["rank"]}" data-kv-bytes="{r["kv_bytes"]}" data-held-bytes="{held}">'
                    f'<td>rank {r["rank"]}</td><td>{r["kv_heads"]}</td><td>{_bytes(r["bytes_per_block"])}</td>'
                    f'<td>{_bytes(r["kv_bytes"])}</td><td>{_bytes(held)}</td></tr>')
    last, totals = tp.get("last_step") or {}, tp.get("totals") or {}
    compute, comm = float(last.get("compute_s", 0.0)), float(last.get("comm_s", 0.0))
    share = comm / (compute + comm) if compute + comm > 0 else 0.0
    all_compute, all_comm = float(totals.get("compute_s", 0.0)), float(totals.get("comm_s", 0.0))
    all_share = all_comm / (all_compute + all_comm) if all_compute + all_comm > 0 else 0.0
    step_line = (f'last step: <b data-tp="comm-ms">{_ms(comm)}</b> in {last.get("collectives", 0)} collectives '
                 f'beside {_ms(compute)} of compute ({share:.0%} communication); {totals.get("steps", 0)} steps: '
                 f'{all_share:.0%} communication')
    failure = (f'<div class="pg-sub" style="color:#b91c1c">{escape(str(tp["failure"]))}</div>'
               if tp.get("failure") else "")
    return (f'<div class="tp-view" data-ranks="{tp.get("size")}">'
            f'<div class="pg-sub">Tensor parallel: {tp.get("size")} ranks, one block table '
            f'({len(blocks)} blocks, {holding} holding KV), a cache per rank</div>'
            '<table class="pg-stats tp-ranks"><tr><th>rank</th><th>KV heads</th><th>bytes a block</th>'
            f'<th>KV cache</th><th>held now</th></tr>{"".join(rows)}</table>'
            f'<div class="pg-sub tp-comm">{step_line}</div>{failure}</div>')
