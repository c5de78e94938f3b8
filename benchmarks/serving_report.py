"""The figures, tables and targets of ``benchmarks.serving`` (our number beside llama-server's, with
the ratio), written and rendered by `benchmarks.results`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PEER = "llama-server"
TARGETS = ("output tok/s at c=16 >= 1.2x llama-server (moonshot 1.5x); TTFT p99 at c=16 <= llama-server's; "
           "HTTP overhead at one stream <= 5% (issue 29)")


def _num(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _get(summary: dict, side: str, label: str, key: str):
    return summary.get(side, {}).get(label, {}).get(key)


def overhead(summary: dict) -> float | None:
    """``1 - (our HTTP tok/s at c=1) / (in-process tok/s at one stream)``."""
    http, local = _get(summary, "ours", "c=1", "output_tok_s"), _get(summary, "in-process", "c=1", "output_tok_s")
    return None if http is None or not local else 1.0 - http / local


def targets(summary: dict) -> list[tuple[str, str, bool | None]]:
    ours, peer = (_get(summary, s, "c=16", "output_tok_s") for s in ("ours", PEER))
    t_ours, t_peer = (_get(summary, s, "c=16", "ttft_ms_p99") for s in ("ours", PEER))
    ratio = ours / peer if ours is not None and peer else None
    over = overhead(summary)
    return [("output tok/s at c=16 >= 1.2x llama-server (moonshot 1.5x)", _ratio(ours, peer),
             None if ratio is None else ratio >= 1.2),
            ("TTFT p99 at c=16 <= llama-server's", f"{_num(t_ours, 0)} vs {_num(t_peer, 0)} ms",
             None if t_ours is None or t_peer is None else t_ours <= t_peer),
            ("HTTP overhead at one stream <= 5%", "-" if over is None else f"{over * 100:.1f}%",
             None if over is None else over <= 0.05)]


SETTING_FIGURES = (("output tok/s", "output_tok_s", "tok/s", "higher"), ("requests/s", "request_throughput", "req/s", "higher"),
                   ("TTFT p50", "ttft_ms_p50", "ms", "lower"), ("TTFT p99", "ttft_ms_p99", "ms", "lower"),
                   ("ITL p50", "itl_ms_p50", "ms", "lower"), ("ITL p99", "itl_ms_p99", "ms", "lower"))


def figures(plan: list[dict], summary: dict) -> list[dict]:
    """Every setting's figures, ours beside llama-server's; then the in-process stream at one stream."""
    from benchmarks.results import figure

    out = []
    for s in plan:
        for name, key, unit, better in SETTING_FIGURES:
            ours, peer = _get(summary, "ours", s["label"], key), _get(summary, PEER, s["label"], key)
            if ours is not None or peer is not None:
                out.append(figure(f"{s['label']}: {name}", unit, ours, peer, better=better))
    for name, key, unit, better in SETTING_FIGURES:
        local = _get(summary, "in-process", "c=1", key)
        if local is not None and key != "request_throughput":
            out.append(figure(f"in-process LLM.stream, one stream: {name}", unit, local, None, better=better))
    return out


def tables(plan: list[dict], summary: dict) -> list[dict]:
    g = lambda side, label, key: _get(summary, side, label, key)  # noqa: E731
    rows = [[s["label"], s["n"], f"{g('ours', s['label'], 'errors')} / {g(PEER, s['label'], 'errors')}",
             f"{_num(g('ours', s['label'], 'server_cores'), 2)} / {_num(g(PEER, s['label'], 'server_cores'), 2)}"]
            for s in plan]
    out = [{"title": "Requests, errors and the cores each server used (ours / llama-server)",
            "columns": ["setting", "requests per round", "errors", "server cores"], "rows": rows}]
    if "in-process" in summary:
        out.append({"title": "HTTP at one stream: our server at c=1 beside `engine.LLM.stream` in process, same chats",
                    "columns": ["path", "output tok/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms"],
                    "rows": [[name] + [g(side, "c=1", k) for k in ("output_tok_s", "ttft_ms_p50", "itl_ms_p50",
                                                                    "itl_ms_p99")]
                             for name, side in (("in-process `LLM.stream`", "in-process"), ("our server, HTTP", "ours"))]})
    return out


def notes(args, summary: dict, commands: dict | None) -> list[str]:
    out = [f"Model {args.model}, {args.max_tokens} output tokens per request (greedy, `ignore_eos`), {args.rounds} "
           "round(s), servers interleaved and started fresh each round. Each number is the median over rounds of that "
           "round's value (percentiles: over the round's requests). Metric definitions: `benchmarks/serving_load.py` "
           "(vLLM's `vllm bench serve`). Servers:"]
    out += [f"- {side}: `{cmd}`" for side, cmd in (commands or {}).items()]
    others = [m["others_cores_max"] for by in summary.values() for m in by.values() if "others_cores_max" in m]
    if others:
        out.append(f"Other processes on the machine used up to {max(others):.2f} cores during a setting "
                   "(0 on a quiet machine; `others_cores` in the JSON, per round).")
    over = overhead(summary)
    t_http, t_local = _get(summary, "ours", "c=1", "ttft_ms_p50"), _get(summary, "in-process", "c=1", "ttft_ms_p50")
    if over is not None:
        out.append(f"HTTP overhead `1 - HTTP tok/s / in-process tok/s`: {over * 100:.1f}%"
                   + ("" if t_http is None or t_local is None else
                      f"; TTFT p50 through HTTP {t_http - t_local:+.1f} ms ({_ratio(t_http, t_local)} the in-process one)"))
    return out


def shlex_argv() -> str:
    import shlex

    return shlex.join(["python", "-m", "benchmarks.serving", *sys.argv[1:]])


def llama_server_version(binary) -> str | None:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout + out.stderr).strip().splitlines()
    return next((line.strip() for line in text if line.startswith("version")), text[-1] if text else None)


def write(out: Path, args, plan, sides, raw, summary, commands: dict, *, started: dict | None = None,
          recorded: dict | None = None, command: str | None = None, llama_server: str | None = None) -> Path:
    """The run through `benchmarks.results`: ``out`` is the path stem (``benchmarks/results/serving``:
    the JSON there, its Markdown and plot in ``docs/benchmarks/``). ``started``: this run's
    `results.start()`; ``recorded``: the date, machine and commit of a run written earlier
    (``--from-json``)."""
    from benchmarks import results

    if PEER in commands and llama_server is None and recorded is None:
        llama_server = llama_server_version(args.llama_server)
    lean = {side: {label: [{k: v for k, v in r.items() if k not in ("ttft_s", "itl_s")} if isinstance(r, dict) else r
                           for r in rounds] for label, rounds in by.items()} for side, by in raw.items()}
    return results.write_run(
        out.name, figures(plan, summary), ours="ours", peer=PEER, command=command or shlex_argv(),
        title="Serving: our OpenAI server beside llama.cpp's llama-server",
        settings={"model": args.model, "output tokens per request": args.max_tokens, "rounds": args.rounds,
                  "llama-server": llama_server},
        quick=bool(getattr(args, "quick", False)), started=started, environment=recorded,
        targets=[{"target": n, "value": v, "met": ok} for n, v, ok in targets(summary)],
        tables=tables(plan, summary), notes=notes(args, summary, commands),
        raw={"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "servers": commands,
             "settings": plan, "sides": sides, "summary": summary, "rounds": lean},
        results_dir=out.parent)
