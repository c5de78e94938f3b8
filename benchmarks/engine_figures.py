"""The figures of ``benchmarks.engine``'s sections for `benchmarks.results`: ours beside the
section's peer (llama.cpp, PaddleFormers' ``generate``, caching off, TP=1), the same numbers the
section prints. ``benchmarks.fallback`` and ``benchmarks.tensor_parallel`` run on their own use
them too."""

from __future__ import annotations

from .results import figure

GENERATE = "PaddleFormers generate"


def peer(section: dict) -> list[dict]:
    """The engine's prefill, decode and streams beside llama.cpp's (the ``peer`` section)."""
    rows = section["rows"]
    lc = next((r for n, r in rows.items() if n.startswith("llama.cpp")), {})
    streams = section["streams"]
    out = []
    for name, r in rows.items():
        if name.startswith("llama.cpp"):
            continue
        out += [figure(f"{name}: prefill {section['prefill_tokens']} tokens", "tok/s", r["prefill_tok_s"],
                       lc.get("prefill_tok_s")),
                figure(f"{name}: decode, 1 stream", "tok/s", r["decode_tok_s"], lc.get("decode_tok_s"))]
        if r.get("multi_tok_s"):
            out += [figure(f"{name}: {streams} streams end to end (peer: its 1 stream)", "tok/s", r["multi_tok_s"],
                           lc.get("decode_tok_s")),
                    figure(f"{name}: {streams} streams, decode only (peer: its 1 stream)", "tok/s",
                           r["multi_decode_tok_s"], lc.get("decode_tok_s"))]
    return out


def fallback(rows, agree: bool) -> list[dict]:
    """Every model implementation's single-stream and several-stream tok/s beside PaddleFormers'
    own ``generate`` (the ``model_impl`` section, ``benchmarks.fallback``)."""
    rows = [r if isinstance(r, dict) else r.__dict__ for r in rows]
    gen = next((r for r in rows if r["name"] == GENERATE), None)
    out = []
    for r in rows:
        if r["name"] == GENERATE:
            continue
        out += [figure(f"{r['name']}: 1 stream", "tok/s", round(r["single_tok_s"], 2),
                       gen and round(gen["single_tok_s"], 2)),
                figure(f"{r['name']}: several streams", "tok/s", round(r["multi_tok_s"], 2),
                       gen and round(gen["multi_tok_s"], 2))]
    if gen:
        out += [figure(f"{GENERATE}: 1 stream", "tok/s", round(gen["single_tok_s"], 2)),
                figure(f"{GENERATE}: several streams", "tok/s", round(gen["multi_tok_s"], 2))]
    out.append(figure("single-stream greedy outputs agree", "yes/no", "yes" if agree else "no"))
    return out


def concurrency(agg: dict) -> list[dict]:
    """Aggregate tok/s at each concurrency beside one request's."""
    one = agg.get(1) or agg.get("1")
    return [figure(f"{n} concurrent requests (peer: 1 request)", "tok/s", v, one) for n, v in agg.items()]


def prefix(on: dict, off: dict) -> list[dict]:
    """TTFT of a new message on a shared prefix, caching on beside caching off."""
    return [figure(f"TTFT, new message on a {on['prompt_tokens']}-token chat (peer: prefix caching off)", "ms",
                   round(on["ttft_s"] * 1e3, 2), round(off["ttft_s"] * 1e3, 2), better="lower")]


def tensor_parallel(result: dict) -> list[dict]:
    """Each row's step (compute + communication) beside TP=1's fused decode, and its
    communication alone."""
    rows = result["rows"]
    base = rows.get("TP=1, fused decode", {})
    out = []
    for name, row in rows.items():
        for work, split in row.items():
            step = (split["compute_s"] + split["comm_s"]) * 1e3
            ref = base.get(work) if row is not base else None
            out.append(figure(f"{name}, {work}: ms a step (peer: TP=1, fused decode)", "ms", round(step, 1),
                              ref and round((ref["compute_s"] + ref["comm_s"]) * 1e3, 1), better="lower"))
            if split["comm_s"]:
                out += [figure(f"{name}, {work}: communication", "ms", round(split["comm_s"] * 1e3, 1),
                               better="lower"),
                        figure(f"{name}, {work}: communication's share of a step", "%",
                               round(100 * split["comm_s"] * 1e3 / step, 1), better="lower")]
    n = result.get("collectives_per_step")
    for name, seconds in result.get("bare_all_reduce_s", {}).items():
        out.append(figure(f"{name}: a bare all-reduce of one hidden row", "ms", round(seconds * 1e3, 2),
                          better="lower"))
        if n:
            out.append(figure(f"{name}: {n} collectives a step at that latency (a floor of communication)", "ms",
                              round(n * seconds * 1e3, 1), better="lower"))
    return out


def tensor_parallel_table(result: dict) -> dict:
    """The section's table: ms a step as compute + communication (share)."""
    works = list(dict.fromkeys(w for row in result["rows"].values() for w in row))
    rows = []
    for name, row in result["rows"].items():
        cells = []
        for w in works:
            if w not in row:
                cells.append("-")
                continue
            c, m = row[w]["compute_s"] * 1e3, row[w]["comm_s"] * 1e3
            cells.append(f"{c:.1f} + {m:.1f} = {c + m:.1f} ({100 * m / (c + m):.0f} %)" if m else f"{c:.1f} + 0")
        rows.append([name, *cells])
    return {"title": f"ms a step, compute + communication: {result['model']}", "columns": ["", *works], "rows": rows}
