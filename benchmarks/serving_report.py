"""The JSON and markdown of ``benchmarks.serving``: our number beside llama-server's, with the ratio."""

from __future__ import annotations

import json
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


def markdown(args, plan: list[dict], summary: dict, env: dict | None = None, commands: dict | None = None,
             command: str | None = None) -> str:
    lines = ["# Serving benchmark: our OpenAI server beside llama.cpp's llama-server", ""]
    if env:
        m, v = env["machine"], env["versions"]
        lines += [f"{env['date']} · {m['cpu']}, {m['cpus']} CPUs, load average {m['load_average'][0]:.1f} at the start"
                  f" · commit {v['commit']} · Python {v['python']}, Paddle {v['paddle']}"
                  + (f" · llama-server {env['llama_server']}" if env.get("llama_server") else ""), ""]
    lines += [f"`{command or shlex_argv()}`: model {args.model}, {args.max_tokens} output tokens per request (greedy, "
              f"`ignore_eos`), {args.rounds} round(s), servers interleaved and started fresh each round. "
              "Each number is the median over rounds of that round's value (percentiles: over the round's requests). "
              "Metric definitions: `benchmarks/serving_load.py` (vLLM's `vllm bench serve`).", ""]
    for side, cmd in (commands or {}).items():
        lines.append(f"- {side}: `{cmd}`")
    lines += ["", "| setting | requests per round | req/s ours | req/s llama-server | output tok/s ours | output tok/s llama-server "
              "| ours / llama-server | errors ours / llama-server | server cores ours / llama-server |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in plan:
        g = lambda side, key: _get(summary, side, s["label"], key)  # noqa: E731
        lines.append(f"| {s['label']} | {s['n']} | {_num(g('ours', 'request_throughput'), 2)} | "
                     f"{_num(g(PEER, 'request_throughput'), 2)} | {_num(g('ours', 'output_tok_s'))} | "
                     f"{_num(g(PEER, 'output_tok_s'))} | {_ratio(g('ours', 'output_tok_s'), g(PEER, 'output_tok_s'))} | "
                     f"{g('ours', 'errors') if g('ours', 'errors') is not None else '-'} / "
                     f"{g(PEER, 'errors') if g(PEER, 'errors') is not None else '-'} | "
                     f"{_num(g('ours', 'server_cores'), 2)} / {_num(g(PEER, 'server_cores'), 2)} |")
    others = [m["others_cores_max"] for by in summary.values() for m in by.values()]
    if others:
        lines += ["", f"Other processes on the machine used up to {max(others):.2f} cores during a setting "
                  "(0 on a quiet machine; `others_cores` in the JSON, per round)."]
    lines += ["", "Latency (ms; lower is better; the ratio is ours / llama-server):", "",
              "| setting | TTFT p50 ours | llama-server | TTFT p99 ours | llama-server | ratio p99 "
              "| ITL p50 ours | llama-server | ITL p99 ours | llama-server |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in plan:
        g = lambda side, key: _get(summary, side, s["label"], key)  # noqa: E731
        lines.append(f"| {s['label']} | {_num(g('ours', 'ttft_ms_p50'))} | {_num(g(PEER, 'ttft_ms_p50'))} | "
                     f"{_num(g('ours', 'ttft_ms_p99'))} | {_num(g(PEER, 'ttft_ms_p99'))} | "
                     f"{_ratio(g('ours', 'ttft_ms_p99'), g(PEER, 'ttft_ms_p99'))} | {_num(g('ours', 'itl_ms_p50'))} | "
                     f"{_num(g(PEER, 'itl_ms_p50'))} | {_num(g('ours', 'itl_ms_p99'))} | {_num(g(PEER, 'itl_ms_p99'))} |")
    if "in-process" in summary:
        lines += ["", "HTTP overhead at one stream (our server at c=1 vs `engine.LLM.stream` in process, same chats):", "",
                  "| path | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms |", "|---|---|---|---|---|"]
        for name, side in (("in-process `LLM.stream`", "in-process"), ("our server, HTTP", "ours")):
            g = lambda key: _get(summary, side, "c=1", key)  # noqa: E731
            lines.append(f"| {name} | {_num(g('output_tok_s'))} | {_num(g('ttft_ms_p50'))} | {_num(g('itl_ms_p50'))} | "
                         f"{_num(g('itl_ms_p99'))} |")
        over = overhead(summary)
        t_http, t_local = _get(summary, "ours", "c=1", "ttft_ms_p50"), _get(summary, "in-process", "c=1", "ttft_ms_p50")
        lines += ["", f"Overhead `1 - HTTP tok/s / in-process tok/s`: {'-' if over is None else f'{over * 100:.1f}%'}"
                  + ("" if t_http is None or t_local is None else
                     f"; TTFT p50 through HTTP {t_http - t_local:+.1f} ms ({_ratio(t_http, t_local)} the in-process one)")]
    lines += ["", "Targets (issue 29):", ""]
    for name, value, ok in targets(summary):
        lines.append(f"- {name}: {value} — {'met' if ok else 'not met' if ok is False else 'not measured'}")
    return "\n".join(lines) + "\n"


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


def write(out: Path, args, plan, sides, raw, summary, commands: dict, env: dict, command: str | None = None) -> None:
    if PEER in commands and "llama_server" not in env:
        env["llama_server"] = llama_server_version(args.llama_server)
    lean = {side: {label: [{k: v for k, v in r.items() if k not in ("ttft_s", "itl_s")} if isinstance(r, dict) else r
                           for r in rounds] for label, rounds in by.items()} for side, by in raw.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    command = command or shlex_argv()
    doc = {"environment": env, "command": command, "args": {k: str(v) if isinstance(v, Path) else v
                                                                for k, v in vars(args).items()},
           "servers": commands, "settings": plan, "sides": sides, "summary": summary, "rounds": lean,
           "targets": [{"target": n, "value": v, "met": ok} for n, v, ok in targets(summary)]}
    Path(f"{out}.json").write_text(json.dumps(doc, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(args, plan, summary, env, commands, command))
