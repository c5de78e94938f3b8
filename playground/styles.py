"""Colours and CSS of the playground's views (used by ``render``).

Every rendered panel starts with ``CSS`` so it is self-contained: the same
string looks the same in a Gradio ``gr.HTML`` and a Jupyter ``ipywidgets.HTML``.
"""

from __future__ import annotations

__all__ = ["PALETTE", "STATE_STYLE", "CSS"]

# Categorical colours for request owners (no greys: those mean cached/free).
PALETTE = (
    "#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#edc948",
    "#76b7b2", "#ff9da7", "#9c755f", "#1d4ed8", "#be123c", "#0e7490",
)
# Looks of the non-owner states (CSS declarations of .kv-<kind>); "shared"
# cells also keep their owners' colours, split diagonally.
STATE_STYLE = {
    "shared": "outline:2px solid #0f172a;outline-offset:-2px",
    "cached": "background:repeating-linear-gradient(45deg,#94a3b8 0 2px,#cbd5e1 2px 4px)",
    "free": "background:#f1f5f9;box-shadow:inset 0 0 0 1px #e2e8f0",
}

CSS = """<style>
.pg-panel{font-family:ui-sans-serif,system-ui,sans-serif;font-size:13px;color:#0f172a}
.pg-head{display:flex;flex-wrap:wrap;gap:4px 14px;margin-bottom:6px;color:#334155}
.pg-head b{color:#0f172a}
.kv-grid{display:grid;gap:2px;max-height:360px;overflow-y:auto;padding:2px}
.kv-cell{aspect-ratio:1;border-radius:2px;min-width:0}
.kv-shared{SHARED}.kv-cached{CACHED}.kv-free{FREE}OWNERS
.kv-cell{cursor:pointer}.kv-dim .kv-cell{opacity:.3}.kv-dim .kv-cell.kv-hl{opacity:1;outline:2px solid #0f172a}
.block-text{white-space:pre-wrap;background:#f1f5f9;border-radius:4px;padding:4px 6px;margin:2px 0;font-size:12px}
.kv-legend{display:flex;flex-wrap:wrap;gap:4px 12px;margin-top:8px;color:#334155}
.kv-legend-item{display:inline-flex;align-items:center;gap:4px;white-space:nowrap}
.kv-swatch{display:inline-block;width:12px;height:12px;border-radius:2px}
.pg-stack{display:flex;height:18px;border-radius:4px;overflow:hidden;background:#e2e8f0;margin:4px 0}
.pg-stack div{height:100%}
.pg-stats{border-collapse:collapse;margin-top:6px}
.pg-stats td{padding:1px 10px 1px 0}
.batch-table td,.batch-table th{vertical-align:top;text-align:left;padding:3px 10px 3px 0}
.batch-table th{font-size:11px;color:#64748b;font-weight:600}.batch-reply{max-width:420px}
.pg-cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(110px,1fr));gap:6px;margin-bottom:8px}
.pg-card{background:#f8fafc;border:1px solid #e2e8f0;border-radius:6px;padding:4px 8px}
.pg-card.wide{grid-column:span 2}
.pg-card .k{font-size:11px;color:#64748b}.pg-card .v{font-size:15px;font-weight:600}
.pg-sub{font-weight:600;margin:8px 0 2px}
.lp-text{line-height:1.9;white-space:pre-wrap;word-break:break-word}
.lp-tok{position:relative;border-radius:3px;padding:1px 0;cursor:pointer;box-shadow:inset -1px 0 0 #fff}
.lp-tok:hover{outline:2px solid #0f172a}
.lp-tok.lp-selected{outline:2px solid #4f46e5;outline-offset:1px}
.lp-tok.lp-forced{text-decoration:underline dashed #4f46e5 2px}
.lp-tok.lp-end{margin-left:4px;padding:0 5px;border:1px solid #64748b;font-size:11px;font-variant:small-caps;
 color:#334155}
.lp-tok.lp-end .lp-tip{font-variant:normal}
.lp-tip{display:none;position:absolute;left:0;top:1.7em;z-index:50;background:#0f172a;color:#f8fafc;
 border-radius:6px;padding:6px 8px;font-size:12px;white-space:nowrap;line-height:1.4;pointer-events:none;
 width:max-content}
.lp-tok:hover .lp-tip{display:block}
.lp-hint-tap{display:none}
@media (hover:none){.lp-hint-hover{display:none}.lp-hint-tap{display:inline}
 .lp-tok.lp-selected .lp-tip{display:block}}
.lp-tip table{border-collapse:collapse;background:transparent!important;margin:0!important;border:0!important}
.lp-tip tr,.lp-tip tr:nth-child(odd),.lp-tip tr:nth-child(even),.lp-tip tr:hover{background:transparent!important}
.lp-tip td{padding:0 6px 0 0!important;color:#e2e8f0!important;border:0!important;text-align:left!important;
 white-space:nowrap!important}
.lp-tip .lp-chosen td{color:#a5b4fc!important;font-weight:600}
.lp-scale{display:flex;align-items:center;gap:6px;margin-top:6px;color:#64748b;font-size:11px}
.lp-scale span.bar{width:120px;height:8px;border-radius:4px;
 background:linear-gradient(90deg,hsl(0,75%,82%),hsl(60,75%,82%),hsl(120,75%,82%))}
</style>""".replace("SHARED", STATE_STYLE["shared"]).replace("CACHED", STATE_STYLE["cached"]).replace(
    "FREE", STATE_STYLE["free"]).replace(
    "OWNERS", "".join(f".kv-o{i}{{background:{c}}}" for i, c in enumerate(PALETTE)))
