"""Results written by the benchmarks: one JSON per run, rendered into Markdown and a PNG.

Every benchmark ends with ``write_run(name, figures, ...)``:

* ``benchmarks/results/NAME.json`` -- the date, the machine (CPU model, cores, load average at
  the start and at the end), the commit, the command as typed, the settings and every figure,
  ours beside the peer's from the same run with their ratio;
* ``docs/benchmarks/NAME.md`` and ``NAME.png`` -- its tables and a plot, rendered from that JSON
  only (``render(name)``, with `benchmarks.results_render`; ``python -m benchmarks.results`` renders every results file again and
  the index ``docs/benchmarks/README.md``).

A figure is a dict: ``figure`` (what was measured, with its setting), ``unit``, ``ours``,
``peer`` (``None`` where the peer has no such number), ``better`` (``"higher"`` or ``"lower"``)
and, computed here, ``ratio`` (ours / peer). Extra ``tables`` (``title``, ``columns``, ``rows``),
``plots`` (``title``, ``x``, ``xlabel``, ``ylabel``, ``series``: label -> values) and ``notes``
render as they are; ``raw`` keeps whatever else the benchmark wants on record.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from engine.config import FlagParser

from .results_render import fmt, markdown, plot, ratio  # noqa: F401  (the page and plot of a results file)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "benchmarks"
PACKAGES = ("paddlepaddle", "paddleformers", "numba", "numpy", "torch", "numba-cuda", "llama-cpp-python")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (``/proc/loadavg``)."""
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def start() -> dict:
    """What a run records before it measures: the date and the machine's load. Pass it to
    ``write_run(started=...)`` so that the load beside the numbers covers the whole run."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_start": load_average()}


def machine(started: dict | None = None) -> dict:
    started = started or start()
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "load_start": started["load_start"],
            "load_end": load_average(), "python": platform.python_version()}


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def command_line(prog: str | None = None, argv: list[str] | None = None) -> str:
    """The command as a reader types it: ``python -m benchmarks.NAME ARGS``."""
    if prog is None:
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        prog = f"python -m {spec.name}" if spec and spec.name else "python " + os.path.basename(sys.argv[0])
    return " ".join([prog, shlex.join(sys.argv[1:] if argv is None else argv)]).strip()


def figure(name: str, unit: str, ours, peer=None, better: str = "higher", **more) -> dict:
    """One figure, ours beside the peer's (``ratio``: ours / peer)."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better={better!r}: 'higher' or 'lower'")
    out = {"figure": name, "unit": unit, "ours": ours, "peer": peer, "better": better}
    out["ratio"] = (round(ours / peer, 4) if isinstance(ours, (int, float)) and isinstance(peer, (int, float))
                    and peer else None)
    out.update(more)
    return out


def write_run(name: str, figures: list[dict], *, ours: str = "ours", peer: str | None = None,
              title: str | None = None, command: str | None = None, started: dict | None = None,
              settings: dict | None = None, quick: bool = False, targets: list[dict] | None = None,
              tables: list[dict] | None = None, plots: list[dict] | None = None, notes: list[str] | None = None,
              raw=None, source: str | None = None, environment: dict | None = None, results_dir: Path | str | None = None, docs_dir: Path | str | None = None) -> Path:
    """Write ``NAME.json`` into ``results_dir`` (default ``benchmarks/results``) and render its
    Markdown and PNG into ``docs_dir`` (default ``docs/benchmarks`` for the default results
    directory, else the results directory itself). ``environment`` (``date``, ``machine``,
    ``commit``, ``versions``) is for a run recorded earlier, written again in this form; by
    default they are this run's. Returns the JSON's path."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"results name {name!r}: a plain file stem such as 'sampler'")
    for f in figures:
        missing = {"figure", "unit", "ours"} - set(f)
        if missing:
            raise ValueError(f"figure {f!r} lacks {sorted(missing)}")
    figs = [f if "ratio" in f else figure(f["figure"], f["unit"], f["ours"], f.get("peer"), f.get("better", "higher"),
                                         **{k: v for k, v in f.items()
                                            if k not in ("figure", "unit", "ours", "peer", "better")})
            for f in figures]
    if environment is None:
        started = started or start()
        environment = {"date": started["date"], "machine": machine(started),
                       "commit": _git("rev-parse", "--short", "HEAD"),
                       "uncommitted_changes": bool(_git("status", "--porcelain", "--", "engine", "gpu_kernels",
                                                        "playground", "benchmarks")),
                       "versions": versions()}
    doc = {"benchmark": name, "title": title or name, **environment, "command": command or command_line(), "quick": quick,
           "ours": ours, "peer": peer, "settings": settings or {}, "figures": figs, "targets": targets or [],
           "tables": tables or [], "plots": plots or [], "notes": notes or [], "raw": raw}
    if source:
        doc["source"] = source
    results_dir = Path(results_dir) if results_dir is not None else RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False, default=str) + "\n")
    if docs_dir is None:
        docs_dir = DOCS if results_dir.resolve() == RESULTS.resolve() else results_dir
    written = render(path, docs_dir)
    print(f"results: {path} -> {', '.join(str(p) for p in written)}", flush=True)
    return path


def render(name_or_path: str | Path, docs_dir: Path | str | None = None) -> list[Path]:
    """``NAME.md`` and ``NAME.png`` from ``benchmarks/results/NAME.json`` (or the JSON at a path)."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = RESULTS / f"{name_or_path}.json"
    if not path.exists():
        known = sorted(p.stem for p in RESULTS.glob("*.json"))
        raise FileNotFoundError(f"no results file {path}; written so far: {', '.join(known) or 'none'}")
    doc = json.loads(path.read_text())
    default = path.resolve().parent == RESULTS.resolve()
    docs_dir = Path(docs_dir) if docs_dir is not None else DOCS if default else path.parent
    docs_dir.mkdir(parents=True, exist_ok=True)
    doc["_default_dirs"] = default and docs_dir.resolve() == DOCS.resolve()
    written = []
    png = docs_dir / f"{doc['benchmark']}.png"
    try:
        doc["has_plot"] = plot(doc, png)
    except ImportError:
        doc["has_plot"] = False
        print('results: no PNG without matplotlib (pip install -e ".[bench]"); '
              f"python -m benchmarks.results {doc['benchmark']} renders it later", file=sys.stderr)
    if doc["has_plot"]:
        written.append(png)
    md = docs_dir / f"{doc['benchmark']}.md"
    md.write_text(markdown(doc))
    written.insert(0, md)
    if doc["_default_dirs"]:
        written.append(index())
    return written


def index() -> Path:
    """``docs/benchmarks/README.md``: the latest run of every benchmark, with its date and load."""
    lines = ["# Benchmark results", "",
             "The latest run of each benchmark, written by the benchmark itself "
             "(`benchmarks/results/NAME.json`) and rendered from that file; how to run each one: "
             "[docs/benchmarks.md](../benchmarks.md). The load average beside each run is the machine's "
             "(2 cores shared with other work unless it says otherwise): compare the columns of one run, "
             "not runs with each other.", "",
             "| results | what | date (UTC) | machine | load average at start / end | settings |",
             "|---|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        m = doc["machine"]
        load = "not recorded" if not m.get("load_start") else f"{m['load_start'][0]:.2f} / " + (
            f"{m['load_end'][0]:.2f}" if m.get("load_end") else "-")
        lines.append(f"| [{doc['benchmark']}]({doc['benchmark']}.md) | {doc['title']} | "
                     f"{doc['date'][:16].replace('T', ' ')} | {m['cpu']}" + (f", {m['cores']} cores" if m.get("cores") else "")
                     + f" | {load} | "
                     f"{'quick' if doc.get('quick') else 'full'}{' (recorded)' if doc.get('source') else ''} |")
    DOCS.mkdir(parents=True, exist_ok=True)
    out = DOCS / "README.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv=None) -> int:
    parser = FlagParser(prog="python -m benchmarks.results",
                        description="Render benchmark results files into docs/benchmarks/ "
                                    "(Markdown, PNG, the index).")
    parser.add_argument("names", nargs="*", help="results to render (default: every benchmarks/results/*.json)")
    args = parser.parse_args(argv)
    for name in args.names or sorted(p.stem for p in RESULTS.glob("*.json")):
        for p in render(name):
            print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
