"""How a results file looks: its Markdown (a header with the date, the machine and its load, the
figures ours beside the peer's, the benchmark's tables, targets and notes) and its plot (ours /
the peer's for every figure, or the benchmark's own). Pure functions of the JSON document;
`benchmarks.results` writes the files."""

from __future__ import annotations

from pathlib import Path


def fmt(value, unit: str = "") -> str:
    """How a number is printed in the tables (and quoted in the docs)."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    a = abs(value)
    digits = 1 if a >= 10 else 2 if a >= 1 else 3
    return f"{value:.{digits}f}"


def ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _table(columns: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return out


def header(doc: dict) -> list[str]:
    m = doc["machine"]
    load = "load not recorded" if not m.get("load_start") else f"load average {m['load_start'][0]:.2f} at the start" + (
        f", {m['load_end'][0]:.2f} at the end" if m.get("load_end") else "")
    commit = doc["commit"] + (" (with uncommitted changes)" if doc.get("uncommitted_changes") else "")
    lines = [f"`{doc['command']}`", "",
             f"{doc['date']} · {m['cpu']}" + (f", {m['cores']} cores" if m.get("cores") else "")
             + f", {load} · commit {commit} · "
             + ", ".join(([f"Python {m['python']}"] if m.get("python") else [])
                         + [f"{k} {v}" for k, v in doc.get("versions", {}).items()])]
    if doc.get("quick"):
        lines += ["", "Quick settings (fewer rounds and tokens): this run shows that the benchmark and its "
                      "results work; compare the columns of one run, not runs with each other."]
    if doc.get("source"):
        lines += ["", doc["source"]]
    return lines


def markdown(doc: dict) -> str:
    lines = [f"# {doc['title']}", "", *header(doc), ""]
    if doc.get("settings"):
        lines += ["Settings: " + ", ".join(f"{k} {v}" for k, v in doc["settings"].items()), ""]
    figs = doc["figures"]
    if figs:
        peer = doc.get("peer")
        cols = ["figure", "unit", doc.get("ours") or "ours"] + ([peer, f"{doc.get('ours') or 'ours'} / {peer}"]
                                                                 if peer else [])
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for f in figs:
            cells = [f["figure"] + ("" if f.get("better", "higher") == "higher" else " (lower is better)"),
                     f["unit"], fmt(f["ours"])]
            if peer:
                cells += [fmt(f.get("peer")), ratio(f.get("ratio"))]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for t in doc.get("tables", []):
        lines += [f"{t['title']}:", "", *_table(t["columns"], t["rows"]), ""]
    if doc.get("targets"):
        lines += ["Targets:", ""]
        for t in doc["targets"]:
            met = {True: "met", False: "not met"}.get(t.get("met"), "not measured")
            lines.append(f"- {t['target']}: {t['value']} — {met}")
        lines.append("")
    for note in doc.get("notes", []):
        if note.startswith("- ") and len(lines) >= 2 and lines[-2].startswith("- "):
            lines.pop()
        lines += [note, ""]
    if doc.get("has_plot"):
        lines += [f"![{doc['title']}]({doc['benchmark']}.png)", ""]
    lines.append(f"From [`benchmarks/results/{doc['benchmark']}.json`](../../benchmarks/results/{doc['benchmark']}.json)"
                 if doc.get("_default_dirs") else f"From `{doc['benchmark']}.json`")
    return "\n".join(lines) + "\n"


def _plots(doc: dict) -> list[dict]:
    """The run's own plots, else ours / the peer's for every figure that has both (green where
    ours is better), else ours alone, a panel per unit."""
    if doc.get("plots"):
        return doc["plots"]
    paired = [f for f in doc["figures"] if f.get("ratio")]
    if paired:
        return [{"title": f"{doc.get('ours') or 'ours'} / {doc.get('peer') or 'peer'} (1 = even)", "kind": "ratio",
                 "x": [f"{f['figure']} ({f['unit']})" for f in paired], "ylabel": "ratio, log scale",
                 "series": {"ratio": [f["ratio"] for f in paired]},
                 "better": [(f["ratio"] > 1) == (f.get("better", "higher") == "higher") for f in paired]}]
    by_unit: dict[str, list[dict]] = {}
    for f in doc["figures"]:
        if isinstance(f.get("ours"), (int, float)):
            by_unit.setdefault(f["unit"], []).append(f)
    return [{"title": unit, "kind": "barh", "x": [f["figure"] for f in figs], "ylabel": unit,
             "series": {doc.get("ours") or "ours": [f["ours"] for f in figs]}} for unit, figs in by_unit.items()]


def plot(doc: dict, path: Path) -> bool:
    plots = _plots(doc)
    if not plots:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [0.3 * len(p["x"]) * (len(p["series"]) if p.get("kind", "barh") == "barh" else 1) + 1.2
               if p.get("kind", "barh") in ("barh", "ratio") else 3.5 for p in plots]
    fig, axes = plt.subplots(len(plots), 1, figsize=(9, sum(heights) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, p in zip(axes[:, 0], plots):
        kind = p.get("kind", "barh")
        n = len(p["series"])
        ticks = [str(x) for x in p["x"]]
        if kind == "ratio":
            values = p["series"]["ratio"]
            ax.barh(range(len(values)), [v - 1 for v in values], left=1,
                    color=["tab:green" if b else "tab:red" for b in p["better"]])
            ax.axvline(1, color="black", lw=0.8)
            ax.set_xscale("log")
            ax.set_yticks(range(len(values)), ticks)
            ax.invert_yaxis()
            ax.set_xlabel(p.get("ylabel", ""))
            ax.set_title(p["title"] + ": green where ours is better", fontsize=10)
        elif kind == "barh":
            width = 0.8 / n
            for i, (label, values) in enumerate(p["series"].items()):
                ax.barh([j + i * width for j in range(len(ticks))], [v if v is not None else 0 for v in values],
                        height=width, label=label)
            ax.set_yticks([j + (n - 1) * width / 2 for j in range(len(ticks))], ticks)
            ax.invert_yaxis()
            ax.set_xlabel(p.get("ylabel", ""))
        else:
            for label, values in p["series"].items():
                ax.plot(p["x"], values, marker="o", label=label)
            ax.set_xlabel(p.get("xlabel", ""))
            ax.set_ylabel(p.get("ylabel", ""))
        if p.get("log") and kind != "ratio":
            (ax.set_xscale if kind == "barh" else ax.set_yscale)("log")
        if kind != "ratio":
            ax.set_title(p["title"], fontsize=10)
            ax.legend(fontsize=8)
        ax.grid(axis="x" if kind in ("barh", "ratio") else "y", alpha=0.3)
    m = doc["machine"]
    fig.suptitle(f"{doc['title']}\n{doc['date'][:16].replace('T', ' ')} UTC, {m['cpu']}"
                 + (f", {m['cores']} cores" if m.get("cores") else "")
                 + (f", load average {m['load_start'][0]:.1f}" if m.get("load_start") else "")
                 + (", quick settings" if doc.get("quick") else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    return True
