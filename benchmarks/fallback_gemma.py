"""Gemma 3 270M through the fallback beside llama.cpp on the same GGUF (a section of ``benchmarks.fallback``).

Gemma 3 has no native implementation here: the engine serves it through PaddleFormers
(``model_impl="paddleformers"``), its decode steps captured on the fused CPU kernel
(``engine.fallback.captured``). The peer is llama.cpp's ``llama-server``
(`llama_server_peer`) on the very same GGUF file. Both get the same prompt ids and the
same thread count, and are measured round by round (each round runs both, in turn, so
they share whatever load the machine has then); every figure is the median over rounds:

* **prefill tok/s** -- a prompt of ``prefill_tokens`` ids of real text from an empty cache:
  ours ``len / time`` of a one-token ``generate`` with prefix caching off (the step, sampling
  and the engine's overhead included); llama.cpp's ``prompt_per_second``;
* **decode tok/s** -- ``tokens`` greedy tokens after a short prompt: ours the streamed tokens
  after the first over the time between the first and the last; llama.cpp's
  ``predicted_per_second`` (its first token costs it no step: a 1/N advantage).

The eager PaddleFormers path (``cpu_decode="paddle"``) is measured the same way after them.
``python -m benchmarks.fallback_gemma`` runs this section alone and writes
``benchmarks/results/fallback_gemma.json`` (the per-round ratios, targets and loads with it).
"""

from __future__ import annotations

import os
import statistics
import time

MODEL = "gemma3-270m"


def wait_quiet(below: float | None, timeout_s: float, log=print) -> float:
    """Wait (up to ``timeout_s``) until the 1-minute load average is under ``below``; the load then."""
    load = os.getloadavg()[0]
    if below is None:
        return load
    t0 = time.perf_counter()
    while load >= below and time.perf_counter() - t0 < timeout_s:
        time.sleep(5.0)
        load = os.getloadavg()[0]
    if load >= below:
        log(f"  load average still {load:.1f} after {timeout_s:.0f} s (wanted < {below}); measuring anyway")
    return load


class _Ours:
    """The engine on Gemma 3 (``benchmarks.engine.EngineSide``): prefill and decode as the peer's."""

    def __init__(self, cpu_decode: str, prompt: list[int]):
        from .engine import EngineSide

        self.side = EngineSide({"model": MODEL, "model_impl": "paddleformers", "dtype": "float32",
                                "device": "cpu", "kv_cache_memory": 256 * 1024**2}, cpu_decode, prompt)
        snapshot = self.side.llm.snapshot()
        self.decode_path, self.prefill_path = snapshot.decode_path, snapshot.prefill_path

    def prefill_tok_s(self, text: list[int]) -> float:
        return len(text) / self.side.prefill_s(text)

    def decode(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        gaps, out = self.side.decode(prompt, tokens)
        return len(gaps) / sum(gaps), out

    def close(self) -> None:
        self.side.close()


def run(tokens: int = 64, prefill_tokens: int = 256, repeats: int = 3, threads: int = 2,
        quiet_below: float | None = None, quiet_timeout_s: float = 600.0, log=print) -> dict:
    """Both sides, round by round; the eager path after them. Rows of median rates, per-round values and loads."""
    from engine.loader import load_checkpoint

    from .engine import prefill_text
    from .fallback import STORY
    from .llama_server_peer import LlamaServerPeer

    checkpoint = load_checkpoint(MODEL)
    tok = checkpoint.tokenizer
    prompt = tok.encode(STORY, add_special_tokens=True)
    text = tok.encode("", add_special_tokens=True) + prefill_text(tok, prefill_tokens)
    started = os.getloadavg()
    log(f"loading {MODEL}: llama-server -t {threads} -tb {threads} ...")
    peer = LlamaServerPeer(checkpoint.path, threads)
    version = peer.version()
    peer_name = f"llama.cpp llama-server {version}"
    rows = {}
    try:
        log(f"loading {MODEL}: the fallback, captured decode ...")
        t0 = time.perf_counter()
        sides = {"fallback (captured decode)": _Ours("fused", prompt)}
        load_s = time.perf_counter() - t0
        sides[peer_name] = peer
        rows = _rounds(sides, text, prompt, tokens, repeats, quiet_below, quiet_timeout_s, log)
        rows["fallback (captured decode)"]["decode_path"] = sides["fallback (captured decode)"].decode_path
        rows["fallback (captured decode)"]["prefill_path"] = sides["fallback (captured decode)"].prefill_path
        rows["fallback (captured decode)"]["load_s"] = load_s
        sides["fallback (captured decode)"].close()
    finally:
        peer.close()
    eager = _Ours("paddle", prompt)
    try:
        rows["fallback (eager PaddleFormers)"] = _rounds({"eager": eager}, text, prompt, tokens, repeats,
                                                         quiet_below, quiet_timeout_s, log)["eager"]
        rows["fallback (eager PaddleFormers)"]["decode_path"] = eager.decode_path
    finally:
        eager.close()
    import numba

    return {"model": MODEL, "gguf": os.path.basename(checkpoint.path), "threads": threads,
            "engine_threads": numba.get_num_threads(), "prefill_tokens": len(text), "decode_tokens": tokens,
            "peer": peer_name, "load_average": {"start": list(started), "end": list(os.getloadavg())},
            "rows": rows}


def _rounds(sides: dict, text, prompt, tokens, repeats, quiet_below, quiet_timeout_s, log) -> dict:
    prefill = {n: [] for n in sides}
    decode = {n: [] for n in sides}
    loads, out = [], {}
    for r in range(repeats):
        loads.append(wait_quiet(quiet_below, quiet_timeout_s, log))
        for name, side in sides.items():
            prefill[name].append(side.prefill_tok_s(text))
            rate, out[name] = side.decode(prompt, tokens)
            decode[name].append(rate)
            log(f"  round {r + 1}/{repeats} {name}: prefill {prefill[name][-1]:.1f} tok/s, "
                f"decode {rate:.1f} tok/s (load {os.getloadavg()[0]:.1f})")
    return {n: {"prefill_tok_s": statistics.median(prefill[n]), "decode_tok_s": statistics.median(decode[n]),
                "prefill_rounds": prefill[n], "decode_rounds": decode[n], "round_loads": loads,
                "tokens": out[n]} for n in sides}


def _ratio(ours: list[float], peer: list[float]) -> str:
    rounds = [a / b for a, b in zip(ours, peer)]
    return f"{statistics.median(rounds):.2f}x [{min(rounds):.2f}-{max(rounds):.2f}]"


def table(doc: dict) -> str:
    rows, peer_name = doc["rows"], doc["peer"]
    lines = [f"Gemma 3 270M ({doc['gguf']}) — the fallback beside {peer_name}, {doc['threads']} threads each "
             f"(engine: {doc['engine_threads']} Numba threads), greedy; prefill {doc['prefill_tokens']} tokens, "
             f"decode {doc['decode_tokens']} tokens; {len(rows[peer_name]['decode_rounds'])} interleaved rounds "
             f"(median [min-max]); load average {doc['load_average']['start'][0]:.1f} at the start, "
             f"{doc['load_average']['end'][0]:.1f} at the end",
             f"{'':<42}{'prefill tok/s':>22}{'decode tok/s':>22}"]
    for name, r in rows.items():
        spread = lambda v: f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]"
        lines.append(f"{name:<42}{spread(r['prefill_rounds']):>22}{spread(r['decode_rounds']):>22}")
    ours, peer = rows["fallback (captured decode)"], rows[peer_name]
    lines.append(f"{'fallback (captured) vs llama.cpp, per round':<42}"
                 f"{_ratio(ours['prefill_rounds'], peer['prefill_rounds']):>22}"
                 f"{_ratio(ours['decode_rounds'], peer['decode_rounds']):>22}   (targets >= 1.0x, >= 0.8x)")
    same = next((i for i, (a, b) in enumerate(zip(ours["tokens"], peer["tokens"])) if a != b),
                min(len(ours["tokens"]), len(peer["tokens"])))
    lines.append(f"captured decode path: {ours['decode_path']}; prefill path: {ours.get('prefill_path', 'paddle')}; load {ours.get('load_s', 0):.0f} s; greedy tokens "
                 f"identical to llama.cpp's for the first {same} of {doc['decode_tokens']}")
    return "\n".join(lines)


def figures(doc: dict) -> list[dict]:
    """Each fallback row's prefill and decode beside llama.cpp's (``benchmarks.results`` figures)."""
    from .results import figure

    peer = doc["rows"][doc["peer"]]
    out = []
    for name, r in doc["rows"].items():
        if name == doc["peer"]:
            continue
        for what in ("prefill", "decode"):
            out.append(figure(f"Gemma 3 270M, {name}: {what} (peer: llama.cpp, {doc['threads']} threads)", "tok/s",
                              round(r[f"{what}_tok_s"], 2), round(peer[f"{what}_tok_s"], 2)))
    return out


def _round_ratios(doc: dict, what: str) -> list[float]:
    ours, peer = doc["rows"]["fallback (captured decode)"], doc["rows"][doc["peer"]]
    return [a / b for a, b in zip(ours[f"{what}_rounds"], peer[f"{what}_rounds"])]


def main(argv=None) -> int:
    from engine.config import FlagParser

    from . import results

    parser = FlagParser(prog="python -m benchmarks.fallback_gemma",
                        description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded per round")
    parser.add_argument("--prefill-tokens", type=int, default=256, help="prompt length of the prefill rounds")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t/-tb")
    parser.add_argument("--quiet-below", type=float, default=None, metavar="LOAD",
                        help="before each round, wait (up to --quiet-timeout s) for a 1-minute load average below LOAD")
    parser.add_argument("--quiet-timeout", type=float, default=600.0, metavar="S")
    args = parser.parse_args(argv)
    started = results.start()
    doc = run(args.tokens, args.prefill_tokens, args.repeats, args.threads, args.quiet_below, args.quiet_timeout)
    text = table(doc)
    print(text)
    targets = []
    for what, goal in (("prefill", 1.0), ("decode", 0.8)):
        ratio = float(statistics.median(_round_ratios(doc, what)))  # a NumPy float where a rate was one
        targets.append({"target": f"{what} >= {goal}x llama.cpp (median of the rounds' ratios)",
                        "value": f"{ratio:.2f}x", "met": bool(ratio >= goal)})
    path = results.write_run(
        "fallback_gemma", figures(doc), ours="the fallback (PaddleFormers backend)", peer=doc["peer"],
        title="Gemma 3 270M through the fallback beside llama.cpp on the same GGUF", started=started,
        settings={"model": MODEL, "tokens": args.tokens, "prefill_tokens": doc["prefill_tokens"],
                  "rounds": args.repeats, "threads": args.threads},
        targets=targets, notes=[text.join(["```\n", "\n```"])], raw=doc)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
