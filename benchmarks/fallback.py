"""Benchmark section "fallback": the native engine vs the PaddleFormers backend vs PaddleFormers' ``generate``.

All run the same SmolLM2 weights (float32, CPU, one process, one run):

* **native engine** — ``LLM(model_impl="native")``; with the default
  ``quantization="auto"`` CPU matmuls run on the GGUF's
  own Q4_1/Q8_0 blocks (``engine.block_linear``), as the PaddleFormers backend's do;
* **native, float matmuls** — the same with ``quantization="none"``: every
  matmul on the dequantized float32 weights, like ``generate``;
* **PaddleFormers backend** — ``LLM(model_impl="paddleformers")``: PaddleFormers'
  ``LlamaForCausalLM`` on the engine's paged KV cache and kernels, Q/K/V and
  gate/up fused, decode steps *captured* (``engine.fallback.captured``: the
  borrowed layers' parameters run by the engine's fused CPU decode step); and
  the same with ``quantization="none"``;
* **PF backend, eager** — the same with ``cpu_decode="paddle"``: every step
  runs the library's eager Paddle forward (FastDeploy's plain backend);
* **PaddleFormers generate** — the same class with its own attention (``sdpa``)
  and its own KV cache, driven by its ``generate`` (greedy).

The engines run with quantized matmuls (the default) and with float matmuls
(``quantization="none"``), so that every comparison with ``generate`` (always
float) exists float against float. All are loaded at once and measured
*interleaved*, round by round (each round runs every one of them once, in
turn), so that a busy neighbour on a shared machine slows all of them alike
within a round; ratios are taken within each round and reported as the median
over rounds with their spread (min–max):

* **single-stream decode tok/s** — one request of N tokens; ``1 / median``
  of the intervals between consecutive generated tokens (the prefill is not
  an interval). For the engines an interval is the time between two streamed
  tokens; for ``generate`` the time between two calls of the model's forward
  (one per token), so both include everything done per token. The median
  shrugs off the steps a busy neighbour slowed down.
* **16-stream aggregate tok/s** — 16 different prompts submitted together
  (continuous batching for the engines, one left-padded batch for
  ``generate``): ``16 × N / T``.

Greedy decoding that does not stop at EOS, so every run generates exactly N tokens.

Then Gemma 3 270M, which only the fallback serves, beside llama.cpp's ``llama-server``
on the same GGUF file, prefill and decode (`fallback_gemma`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import paddle

STORY = "Tell me a story about a dragon who learns to read."
TOPICS = ("a lighthouse", "the moon", "a lost key", "winter", "a robot", "the sea", "a violin", "bread",
          "a mountain", "a library", "rain", "a garden", "a clock", "a train", "a fox", "a bridge")


def poem_prompts(n: int) -> list[str]:
    """``n`` different short prompts, the several-stream workload of every benchmark."""
    return [f"Write a short poem about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


@dataclass(frozen=True)
class Result:
    name: str
    single_tok_s: float             # median over rounds
    multi_tok_s: float              # median over rounds
    single_rounds: tuple = ()       # per round, in round order
    multi_rounds: tuple = ()


class EngineRunner:
    """An ``LLM`` driven with token-id prompts, greedy, ignoring EOS."""

    def __init__(self, llm):
        from engine import SamplingParams

        self.llm = llm
        self.params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params(n))
        return [o.outputs[0].token_ids for o in outs]

    def token_intervals(self, prompt: list[int], n: int) -> tuple[list[float], list[int]]:
        """Seconds between consecutive streamed tokens of one request, and its tokens."""
        times, tokens = [], []
        for delta in self.llm.stream({"prompt_token_ids": prompt}, self.params(n)):
            if delta.token_ids:
                times.append(time.perf_counter())
                tokens += delta.token_ids
        return list(np.diff(times)), tokens


class PaddleFormersGenerate:
    """PaddleFormers' own model and ``generate`` on the checkpoint's weights (the baseline)."""

    def __init__(self, checkpoint):
        from engine.fallback.hf_config import paddleformers_class, paddleformers_config
        from engine.fallback.weights import load_hf_weights

        cls = paddleformers_class(checkpoint.architecture)
        config = paddleformers_config(cls, checkpoint.config, "cpu", "sdpa")
        config.use_cache = True
        self.model = cls(config)
        load_hf_weights(self.model, checkpoint.weights(progress=False), num_heads=config.num_attention_heads,
                        num_kv_heads=config.num_key_value_heads)
        self.model.eval()
        self.pad = checkpoint.config.get("pad_token_id") or 0

    @paddle.no_grad()
    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = np.full((len(prompts), width), self.pad, dtype=np.int64)
        mask = np.zeros((len(prompts), width), dtype=np.int64)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
        out = self.model.generate(input_ids=paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask),
                                  max_new_tokens=n, min_new_tokens=n, decode_strategy="greedy_search",
                                  pad_token_id=self.pad)
        return out[0].numpy().tolist()

    def token_intervals(self, prompt: list[int], n: int) -> tuple[list[float], list[int]]:
        """Seconds between consecutive forward calls after the prefill (one call per token), and the tokens."""
        starts = []
        hook = self.model.register_forward_pre_hook(lambda layer, args: starts.append(time.perf_counter()))
        try:
            tokens = self.generate([prompt], n)[0]
        finally:
            hook.remove()
        return list(np.diff(starts)), tokens  # starts[0] is the prefill, each later one decodes a token


def run(model: str = "smollm2-135m-instruct", tokens: int = 64, streams: int = 16, repeats: int = 3,
        log=print, only: list[str] | None = None) -> tuple[list[Result], bool]:
    """Measure them all, interleaved round by round; returns the results and whether their
    single-stream greedy outputs agree."""
    from engine import LLM
    from engine.loader import load_checkpoint

    checkpoint = load_checkpoint(model)
    engine = lambda impl, quantization, cpu_decode="fused": lambda: EngineRunner(LLM(
        model=model, model_impl=impl, dtype="float32", device="cpu", quantization=quantization,
        cpu_decode=cpu_decode))
    factories = {
        "native engine": engine("native", "auto"),
        "native, float matmuls": engine("native", "none"),
        "PaddleFormers backend": engine("paddleformers", "auto"),
        "PF backend, eager": engine("paddleformers", "auto", "paddle"),
        "PF backend, float matmuls": engine("paddleformers", "none"),
        "PaddleFormers generate": lambda: PaddleFormersGenerate(checkpoint),
    }
    if only:  # a subset, e.g. to repeat the engines' rounds without generate's long ones
        factories = {name: f for name, f in factories.items() if name in only}
    encode = lambda text: checkpoint.tokenizer.encode(text, add_special_tokens=True)
    single = encode(STORY)
    multi = [encode(prompt) for prompt in poem_prompts(streams)]
    runners, outputs = {}, {}
    for name, factory in factories.items():
        log(f"loading {model}: {name} ...")
        runners[name] = factory()
        runners[name].generate([single], 2)  # warm up: kernels compiled, caches allocated
        if isinstance(runners[name], EngineRunner):
            log(f"  decode path: {runners[name].llm.snapshot().decode_path}")
    single_rounds = {name: [] for name in runners}
    multi_rounds = {name: [] for name in runners}
    for r in range(repeats):
        for name, runner in runners.items():
            gaps, outputs[name] = runner.token_intervals(single, tokens)
            t0 = time.perf_counter()
            runner.generate(multi, tokens)
            elapsed = time.perf_counter() - t0
            single_rounds[name].append(1.0 / statistics.median(gaps))
            multi_rounds[name].append(streams * tokens / elapsed)
            log(f"  round {r + 1}/{repeats} {name}: median {statistics.median(gaps) * 1000:.1f} ms/token "
                f"single-stream, {streams} streams {elapsed:.2f} s")
    for runner in runners.values():
        if isinstance(runner, EngineRunner):
            runner.llm.shutdown()
    results = [Result(name, statistics.median(single_rounds[name]), statistics.median(multi_rounds[name]),
                      tuple(single_rounds[name]), tuple(multi_rounds[name])) for name in runners]
    return results, _agree(list(outputs.values()), checkpoint.tokenizer.eos_token_ids)


def _agree(outputs: list[list[int]], eos_ids) -> bool:
    """Whether the single-stream greedy outputs agree up to the first EOS.

    ``generate(min_new_tokens=N)`` keeps going by suppressing EOS, where the
    engine's ``ignore_eos`` keeps going by sampling past it, so the
    continuations may part after an EOS; before it they must be equal.
    """
    first = outputs[0]
    end = next((i for i, t in enumerate(first) if t in eos_ids), len(first))
    return all(o[:end] == first[:end] for o in outputs)


def _ratio(who: Result, ref: Result, attr: str) -> str:
    """Median over rounds of the per-round ratio, with its min–max."""
    rounds = [a / b for a, b in zip(getattr(who, attr + "_rounds"), getattr(ref, attr + "_rounds"))]
    if not rounds:
        return f"{getattr(who, attr + '_tok_s') / getattr(ref, attr + '_tok_s'):.2f}x"
    return f"{statistics.median(rounds):.2f}x [{min(rounds):.2f}-{max(rounds):.2f}]"


def _spread(values) -> str:
    return f"[{min(values):.1f}-{max(values):.1f}]" if values else ""


def table(results: list[Result], agree: bool, tokens: int, streams: int) -> str:
    by = {r.name: r for r in results}
    native, generate = by.get("native engine"), by.get("PaddleFormers generate")
    lines = [f"fallback — SmolLM2 weights, float32, CPU, N={tokens} generated tokens per request, "
             f"{len(results[0].single_rounds)} interleaved rounds (median [min-max])",
             f"{'':<27}{'single-stream decode':>24}{f'{streams}-stream aggregate':>24}",
             f"{'':<27}{'tok/s':>24}{'tok/s':>24}"]
    for r in results:
        lines.append(f"{r.name:<27}{f'{r.single_tok_s:.1f} ' + _spread(r.single_rounds):>24}"
                     f"{f'{r.multi_tok_s:.1f} ' + _spread(r.multi_rounds):>24}")
    lines.append("quantized rows multiply on the GGUF's Q4_1/Q8_0 blocks; float rows (and generate) on float32")
    comparisons = [
        (native, "vs PF generate", generate, None),
        (by.get("native, float matmuls"), "vs PF generate", generate, 1.5),
        (by.get("PaddleFormers backend"), "vs native", native, 0.8),
        (by.get("PF backend, eager"), "vs native", native, None),
        (by.get("PF backend, float matmuls"), "vs native, float", by.get("native, float matmuls"), 0.8),
        (by.get("PF backend, float matmuls"), "vs PF generate", generate, 3.0),
    ]
    lines.append(f"{'ratio (per round)':<50}{'single-stream':>20}{f'{streams} streams':>22}")
    for who, label, ref, target in comparisons:
        if who is None or ref is None:
            continue
        goal = f"   (target >= {target}x)" if target else ""
        lines.append(f"{who.name + ' ' + label:<50}{_ratio(who, ref, 'single'):>20}{_ratio(who, ref, 'multi'):>22}{goal}")
    lines.append(f"single-stream greedy outputs all agree: {'yes' if agree else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    from engine.config import FlagParser

    parser = FlagParser(prog="python -m benchmarks.fallback",
                        description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="measure only this row (repeatable), e.g. --only 'native engine' "
                             "--only 'PaddleFormers backend'")
    parser.add_argument("--quick", action="store_true", help="16 tokens, 4 streams, 1 round")
    parser.add_argument("--gemma", action=argparse.BooleanOptionalAction, default=True,
                        help="Gemma 3 270M through the fallback beside llama-server (default: on)")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t/-tb for the Gemma rows")
    parser.add_argument("--quiet-below", type=float, default=None, metavar="LOAD",
                        help="before each Gemma round, wait (up to --quiet-timeout s) for a 1-minute load average "
                             "below LOAD")
    parser.add_argument("--quiet-timeout", type=float, default=600.0, metavar="S")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.streams, args.repeats = 16, 4, 1
    from . import engine_figures, fallback_gemma, results as bench_results

    started = bench_results.start()
    results, agree = run(args.model, args.tokens, args.streams, args.repeats, only=args.only)
    notes = [table(results, agree, args.tokens, args.streams)]
    print(notes[0])
    figures, gemma = engine_figures.fallback(results, agree), None
    if args.gemma:
        gemma = fallback_gemma.run(args.tokens, repeats=args.repeats, threads=args.threads,
                                   quiet_below=args.quiet_below, quiet_timeout_s=args.quiet_timeout)
        notes.append(fallback_gemma.table(gemma))
        print(notes[-1])
        figures += fallback_gemma.figures(gemma)
    bench_results.write_run("fallback", figures, ours="engine",
                            peer=engine_figures.GENERATE, started=started, quick=args.quick,
                            title="Model implementations: native, the PaddleFormers backend, PaddleFormers generate"
                                  + ("; Gemma 3 270M beside llama.cpp" if gemma else ""),
                            settings={"model": args.model, "tokens": args.tokens, "streams": args.streams,
                                      "rounds": args.repeats, "gemma_threads": args.threads if gemma else None},
                            notes=[n.join(["```\n", "\n```"]) for n in notes],
                            raw=[r.__dict__ for r in results] + ([{"gemma3": gemma}] if gemma else []))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
