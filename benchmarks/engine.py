"""``python -m benchmarks.engine``: engine throughput and latency, each beside its peer, in one run.

Sections (all on the same SmolLM2 GGUF, float32 activations, CPU):

1. **peer** (``--peer llama.cpp``) -- prefill of ~1,000 tokens of real text,
   single-stream decode and 16-stream aggregate decode of the engine
   (``cpu_decode="fused"``, the default, and ``"paddle"``) beside llama.cpp on
   the same file, token ids and thread count (`benchmarks.llama_cpp`);
   llama.cpp and the default engine alternate round by round (prefill,
   decode, the engine's 16 streams), so that both see the same load on a
   shared machine. The 16 streams are reported twice: end to end
   (``16 x N`` tokens over the whole ``generate``, their prompts' prefill
   included) and decode only (the tokens after each stream's first over the
   time from the last stream's first token to the last one's end), the
   measure like llama.cpp's single-stream number, which leaves its prompt out;
2. **model_impl** -- the native engine, the PaddleFormers backend and
   PaddleFormers' own ``generate``, each engine row with quantized and with
   float matmuls (`benchmarks.fallback`);
3. **concurrency** -- aggregate tok/s of the native engine with 1, 4 and 16
   concurrent requests (continuous batching), and the 16 : 1 ratio;
4. **prefix** -- TTFT of a new message on a long shared chat prefix, with
   prefix caching on vs off (the prefix and new-token counts are printed);
5. **tensor_parallel** (``--tensor-parallel 1,2``: only this section unless
   ``--sections`` names others) -- per-step time split into compute and
   communication at each tensor-parallel size beside TP=1
   (`benchmarks.tensor_parallel`).

Every run writes its numbers through `benchmarks.results`: ``benchmarks/results/engine.json``
(``tensor_parallel.json`` for that section alone), rendered into ``docs/benchmarks/``. Numbers depend on the machine and on whatever else runs on it:
compare the columns of one run, not runs on different machines.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time

from engine.config import FlagParser, add_engine_args, config_from_args

from . import llama_cpp as peer
from . import results as bench_results

# Paddle (through engine.LLM and benchmarks.fallback) is imported where it is used, after the
# arguments are parsed: --help and a wrong flag answer at once.

PEERS = ("llama.cpp",)


def concurrency(llm, tokens: int, levels=(1, 4, 16), repeats: int = 2) -> dict[int, float]:
    """Aggregate generated tok/s with ``n`` requests submitted together (best of ``repeats``)."""
    from engine import SamplingParams

    from . import fallback as bench_fallback

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate("warm up", SamplingParams(max_tokens=2))
    out = {}
    for n in levels:
        prompts = bench_fallback.poem_prompts(n)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            best = min(best, time.perf_counter() - t0)
        out[n] = n * tokens / best
    return out


def long_conversation(words: int = 700) -> list[dict]:
    from .fallback import TOPICS

    text = " ".join(f"{TOPICS[i % len(TOPICS)].split()[-1]}{i % 7}" for i in range(words))
    return [{"role": "system", "content": "You summarise notes. Notes: " + text},
            {"role": "user", "content": "Which topic comes first?"}]


NEW_MESSAGES = ("And which comes last?", "How many notes mention the sea?", "Is a clock among them?",
                "Name three topics.", "Which topic is most frequent?")


def new_message_ttft(engine_args: dict, enable_prefix_caching: bool, repeats: int = 3) -> dict:
    """TTFT of a *new* user message after a first turn on a long shared prefix.

    Turn one (system notes + a question) is answered first, so with prefix
    caching its blocks are cached; each measured turn appends a different new
    message, so only the shared prefix can come from the cache.
    """
    from engine import LLM, SamplingParams

    llm = LLM(**{**engine_args, "enable_prefix_caching": enable_prefix_caching, "max_num_batched_tokens": 2048})
    conv = long_conversation()
    first = llm.chat(conv, SamplingParams(max_tokens=8, temperature=0))[0]
    conv = conv + [{"role": "assistant", "content": first.outputs[0].text}]
    best, out = float("inf"), None
    for i in range(repeats):
        o = llm.chat(conv + [{"role": "user", "content": NEW_MESSAGES[i % len(NEW_MESSAGES)]}],
                     SamplingParams(max_tokens=1, temperature=0))[0]
        if o.metrics.ttft < best:
            best, out = o.metrics.ttft, o
    llm.shutdown()
    return {"ttft_s": best, "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
            "new_tokens": len(out.prompt_token_ids) - out.num_cached_tokens}


def prefill_text(tokenizer, n: int) -> list[int]:
    """``n`` token ids of real English text (the project's architecture notes)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "ARCHITECTURE.md")
    with open(path, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    return ids[:n]


def decode_only_tok_s(outs) -> float:
    """Aggregate decode rate of requests that ran together: the tokens after each one's first, over
    the time from the last request's first token to the last one's end (every step in that window
    decodes; the prompts' prefill lies before it)."""
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first)


class EngineSide:
    """A fresh ``LLM`` measured the same way as the peer: prefill, single-stream and multi-stream decode."""

    def __init__(self, engine_args: dict, cpu_decode: str, prompt: list[int]):
        from engine import LLM

        from . import fallback as bench_fallback

        self.llm = LLM(**{**engine_args, "cpu_decode": cpu_decode, "enable_prefix_caching": False,
                          "max_num_batched_tokens": 2048})
        self.runner = bench_fallback.EngineRunner(self.llm)
        self.runner.generate([prompt], 2)  # warm up: kernels compiled

    def prefill_s(self, text: list[int]) -> float:
        t0 = time.perf_counter()
        self.runner.generate([text], 1)
        return time.perf_counter() - t0

    def decode(self, prompt: list[int], tokens: int) -> tuple[list[float], list[int]]:
        return self.runner.token_intervals(prompt, tokens)

    def multi_tok_s(self, tokens: int, streams: int) -> tuple[float, float]:
        """``streams`` different prompts decoded together: (end-to-end tok/s, decode-only tok/s).

        End to end: ``streams * tokens`` over the whole ``generate`` (prefill included). Decode only:
        the tokens after each stream's first, over the time from the last first token to the last
        stream's end -- every step in that window is a decode step of the streams still running."""
        from engine import SamplingParams

        from . import fallback as bench_fallback

        prompts = bench_fallback.poem_prompts(streams)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        total = time.perf_counter() - t0
        return streams * tokens / total, decode_only_tok_s(outs)

    def close(self) -> str:
        path = self.llm.snapshot().decode_path
        self.llm.shutdown()
        return path


def interleaved(sides: dict, text: list[int], prompt: list[int], tokens: int, repeats: int,
                streams: int) -> dict:
    """Prefill, single-stream decode and (where a side has it) ``streams``-stream decode of every
    side, round by round (each round runs every side once, in turn), so that the sides share
    whatever load the machine has at the time."""
    best = {name: float("inf") for name in sides}
    gaps = {name: [] for name in sides}
    multi = {name: 0.0 for name in sides}
    multi_decode = {name: 0.0 for name in sides}
    out = {}
    for _ in range(repeats):
        for name, side in sides.items():
            best[name] = min(best[name], side.prefill_s(text))
        for name, side in sides.items():
            g, out[name] = side.decode(prompt, tokens)
            gaps[name] += g
        for name, side in sides.items():
            if hasattr(side, "multi_tok_s"):
                end_to_end, decode = side.multi_tok_s(tokens, streams)
                multi[name] = max(multi[name], end_to_end)
                multi_decode[name] = max(multi_decode[name], decode)
    return {name: {"prefill_tok_s": len(text) / best[name], "decode_tok_s": 1.0 / statistics.median(gaps[name]),
                   "multi_tok_s": multi[name] or None, "multi_decode_tok_s": multi_decode[name] or None,
                   "tokens": out[name]} for name in sides}


class PeerSide:
    """llama.cpp with the interface of `EngineSide` (its prefill: ``Llama.eval`` from an empty cache)."""

    def __init__(self, path: str, threads: int, prompt: list[int]):
        self.peer = peer.LlamaCppPeer(path, threads)
        self.peer.decode(prompt, 2)  # warm up

    def prefill_s(self, text: list[int]) -> float:
        return len(text) / self.peer.prefill_tok_s(text, 1)

    def decode(self, prompt: list[int], tokens: int) -> tuple[list[float], list[int]]:
        return self.peer.decode(prompt, tokens)

    def close(self) -> None:
        self.peer.close()


def peer_section(engine_args: dict, tokens: int, streams: int, repeats: int, prefill_tokens: int) -> dict:
    model = engine_args["model"]
    from engine.loader import load_checkpoint

    from . import fallback as bench_fallback

    checkpoint = load_checkpoint(model)
    text = prefill_text(checkpoint.tokenizer, prefill_tokens)
    prompt = checkpoint.tokenizer.encode(bench_fallback.STORY, add_special_tokens=True)
    threads = peer.threads()
    version = peer.available()
    lc_name = f"llama.cpp {version}"
    if version is None:
        print(f"llama.cpp column skipped: llama_cpp is not installed; install it with {peer.INSTALL}")
    load_start = os.getloadavg()[0]
    # llama.cpp and the default engine run round by round; the engine's Paddle decode path after them
    sides = {"engine, cpu_decode=fused": EngineSide(engine_args, "fused", prompt)}
    if version is not None:
        sides = {lc_name: PeerSide(checkpoint.path, threads, prompt), **sides}
    rows = interleaved(sides, text, prompt, tokens, repeats, streams)
    for name, side in sides.items():
        path = side.close()
        if path:
            rows[name]["decode_path"] = path
    paddle_side = EngineSide(engine_args, "paddle", prompt)
    rows["engine, cpu_decode=paddle"] = interleaved({"paddle": paddle_side}, text, prompt, tokens, repeats,
                                                    streams)["paddle"]
    rows["engine, cpu_decode=paddle"]["decode_path"] = paddle_side.close()
    load_end = os.getloadavg()[0]

    print(f"peer — {os.path.basename(checkpoint.path)}, {threads} threads, greedy; prefill: {len(text)} tokens "
          f"of real text, decode: {tokens} tokens; llama.cpp and the fused engine measured round by round; "
          f"load average {load_start:.1f} at the start, {load_end:.1f} at the end")
    print(f"{'':<30}{'prefill tok/s':>15}{'decode tok/s':>15}{f'{streams} streams tok/s':>18}"
          f"{f'{streams} streams, decode':>22}")
    for name, r in rows.items():
        multi = f"{r['multi_tok_s']:.1f}" if r["multi_tok_s"] else "-"
        multi_decode = f"{r['multi_decode_tok_s']:.1f}" if r["multi_decode_tok_s"] else "-"
        print(f"{name:<30}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>15.1f}{multi:>18}{multi_decode:>22}")
    lc_row = next((r for n, r in rows.items() if n.startswith("llama.cpp")), None)
    if lc_row:
        ours = rows["engine, cpu_decode=fused"]
        print(f"engine (fused) vs llama.cpp: prefill {ours['prefill_tok_s'] / lc_row['prefill_tok_s']:.2f}x "
              f"(target >= 1.0), decode {ours['decode_tok_s'] / lc_row['decode_tok_s']:.2f}x (target >= 1.0), "
              f"{streams} streams vs llama.cpp single {ours['multi_tok_s'] / lc_row['decode_tok_s']:.2f}x end to end, "
              f"{ours['multi_decode_tok_s'] / lc_row['decode_tok_s']:.2f}x decode only (target >= 3)")
        same = next((i for i, (a, b) in enumerate(zip(ours["tokens"], lc_row["tokens"])) if a != b),
                    min(len(ours["tokens"]), len(lc_row["tokens"])))
        print(f"greedy tokens identical to llama.cpp's for the first {same} of {tokens}")
    for r in rows.values():
        r.pop("tokens")
    return {"threads": threads, "prefill_tokens": len(text), "decode_tokens": tokens, "streams": streams,
            "load_average": [load_start, load_end], "rows": rows}


def environment() -> dict:
    """Date, machine and versions, stored with the numbers."""
    import numba
    import numpy
    import paddle

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpu": cpu, "cpus": os.cpu_count(), "threads": peer.threads(),
                        "load_average": os.getloadavg()},
            "versions": {"python": platform.python_version(), "paddle": paddle.__version__,
                         "numba": numba.__version__, "numpy": numpy.__version__,
                         "llama_cpp": peer.available(), "commit": commit}}


def main(argv=None) -> int:
    parser = FlagParser(prog="python -m benchmarks.engine",
                        description=__doc__.split("\n\n")[0].replace("``", ""))
    add_engine_args(parser)   # the engine's own flags (FastDeploy's names too); sections override what they compare
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", choices=PEERS, default=None, help="run the peer section against this engine")
    parser.add_argument("--prefill-tokens", type=int, default=1000)
    parser.add_argument("--sections", default=None,
                        help="comma-separated subset of: peer, model_impl, concurrency, prefix, tensor_parallel "
                             "(default: model_impl,concurrency,prefix; with --tensor-parallel: tensor_parallel)")
    parser.add_argument("--tensor-parallel", default=None, metavar="SIZES",
                        help="run the tensor_parallel section at these sizes, e.g. 1,2 (benchmarks.tensor_parallel)")
    parser.add_argument("--quick", action="store_true", help="16 tokens, 1 round, a 256-token prefill")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats, args.prefill_tokens = 16, 1, 256
    engine_args = vars(config_from_args(args))
    default = "tensor_parallel" if args.tensor_parallel else "model_impl,concurrency,prefix"
    sections = set((args.sections or default).split(","))
    if args.peer:
        sections.add("peer")
    if args.tensor_parallel:
        sections.add("tensor_parallel")
    started = bench_results.start()
    env = environment()
    results = {"environment": env, "model": args.model}
    print(f"{env['date']}  {env['machine']['cpu']}, {env['machine']['cpus']} CPUs, load "
          f"{env['machine']['load_average'][0]:.1f}; Python {env['versions']['python']}, "
          f"Paddle {env['versions']['paddle']}, commit {env['versions']['commit']}\n")

    if "peer" in sections:
        results["peer"] = peer_section(engine_args, args.tokens, 16, args.repeats, args.prefill_tokens)
        print()

    if "model_impl" in sections:
        from . import fallback as bench_fallback

        rows, agree = bench_fallback.run(args.model, args.tokens, 16, args.repeats)
        print(bench_fallback.table(rows, agree, args.tokens, 16) + "\n")
        results["model_impl"] = {"rows": [r.__dict__ for r in rows], "outputs_agree": agree}

    if "concurrency" in sections:
        from engine import LLM

        llm = LLM(**engine_args)
        agg = concurrency(llm, args.tokens, repeats=args.repeats)
        llm.shutdown()
        print(f"concurrency — native engine, {args.tokens} tokens per request")
        for n, tps in agg.items():
            print(f"  {n:>2} concurrent requests: {tps:8.1f} tok/s aggregate")
        print(f"  16 streams vs 1 stream: {agg[16] / agg[1]:.2f}x (target >= 5x)\n")
        results["concurrency"] = {str(n): v for n, v in agg.items()}

    if "prefix" in sections:
        on = new_message_ttft(engine_args, True)
        off = new_message_ttft(engine_args, False)
        print(f"prefix caching — a new message on a shared chat prefix ({on['prompt_tokens']} prompt tokens)")
        for label, r in (("cache on ", on), ("cache off", off)):
            print(f"  {label}: TTFT {r['ttft_s'] * 1000:8.1f} ms ({r['cached_tokens']} shared-prefix tokens from "
                  f"the cache, {r['new_tokens']} new tokens computed)")
        print(f"  on / off : {on['ttft_s'] / off['ttft_s']:.3f} (target <= 0.2)")
        results["prefix"] = {"on": on, "off": off}

    if "tensor_parallel" in sections:
        from . import tensor_parallel as bench_tp

        sizes = sorted({int(n) for n in (args.tensor_parallel or "1,2").split(",")} | {1})
        results["tensor_parallel"] = bench_tp.run(engine_args, sizes, args.tokens, args.prefill_tokens, args.repeats)
        print(bench_tp.table(results["tensor_parallel"]) + "\n")

    write(results, args, started)
    return 0


def write(results: dict, args, started: dict) -> None:
    """The run's figures through `benchmarks.results` (``tensor_parallel`` alone: its own file)."""
    from . import engine_figures as ef

    figures, tables = [], []
    if "peer" in results:
        figures += ef.peer(results["peer"])
    if "model_impl" in results:
        figures += ef.fallback(results["model_impl"]["rows"], results["model_impl"]["outputs_agree"])
    if "concurrency" in results:
        figures += ef.concurrency(results["concurrency"])
    if "prefix" in results:
        figures += ef.prefix(results["prefix"]["on"], results["prefix"]["off"])
    if "tensor_parallel" in results:
        figures += ef.tensor_parallel(results["tensor_parallel"])
        tables.append(ef.tensor_parallel_table(results["tensor_parallel"]))
    sections = [k for k in ("peer", "model_impl", "concurrency", "prefix", "tensor_parallel") if k in results]
    name = "tensor_parallel" if sections == ["tensor_parallel"] else "engine"
    bench_results.write_run(name, figures, ours="engine", peer="peer", started=started, quick=args.quick,
                            title=("Tensor parallelism: a step's compute and communication beside TP=1"
                                   if name == "tensor_parallel" else f"Engine: {', '.join(sections)}, each beside its peer"),
                            settings={"model": args.model, "tokens": args.tokens, "rounds": args.repeats,
                                      "prefill tokens": args.prefill_tokens},
                            notes=["Peers: llama.cpp on the same GGUF (peer), PaddleFormers' own generate "
                                   "(model_impl), one request (concurrency), prefix caching off (prefix), TP=1 with "
                                   "the fused decode (tensor_parallel)."],
                            tables=tables, raw={k: v for k, v in results.items() if k != "environment"})


if __name__ == "__main__":
    raise SystemExit(main())
