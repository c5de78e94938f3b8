"""``python -m benchmarks.engine``: engine throughput and latency, each beside its peer, in one run.

Sections (all on the same SmolLM2 weights, float32):

1. **model_impl** — single-stream decode and 16-stream aggregate tok/s of the
   native engine, the PaddleFormers backend and PaddleFormers' own
   ``LlamaForCausalLM.generate`` (see ``benchmarks.fallback``);
2. **concurrency** — aggregate tok/s of the native engine with 1, 4 and 16
   concurrent requests (continuous batching), and the 16 : 1 ratio;
3. **prefix caching** — TTFT of a second chat turn that shares a ~1,000-token
   prefix with the first, with prefix caching on vs off.

Numbers depend on the machine (and on anything else running on it): compare
the columns of one run, not runs on different machines.
"""

from __future__ import annotations

import argparse
import platform
import time

from engine import LLM, SamplingParams

from . import fallback as bench_fallback

TOPICS = bench_fallback.TOPICS


def concurrency(llm: LLM, tokens: int, levels=(1, 4, 16), repeats: int = 2) -> dict[int, float]:
    """Aggregate generated tok/s with ``n`` requests submitted together (best of ``repeats``)."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate("warm up", SamplingParams(max_tokens=2))
    out = {}
    for n in levels:
        prompts = [f"Write a short poem about {TOPICS[i % len(TOPICS)]}." for i in range(n)]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            best = min(best, time.perf_counter() - t0)
        out[n] = n * tokens / best
    return out


def long_conversation(words: int = 700) -> list[dict]:
    text = " ".join(f"{TOPICS[i % len(TOPICS)].split()[-1]}{i % 7}" for i in range(words))
    return [{"role": "system", "content": "You summarise notes. Notes: " + text},
            {"role": "user", "content": "Which topic comes first?"}]


def second_turn_ttft(model: str, enable_prefix_caching: bool, repeats: int = 3) -> tuple[float, int, int]:
    """TTFT (s) of turn two, prompt length and cached tokens; turn one shares the long prefix."""
    llm = LLM(model=model, enable_prefix_caching=enable_prefix_caching, max_num_batched_tokens=2048)
    conv = long_conversation()
    one = SamplingParams(max_tokens=1, temperature=0)
    first = llm.chat(conv, SamplingParams(max_tokens=8, temperature=0))[0]
    conv = conv + [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": "And last?"}]
    best, out = float("inf"), None
    for _ in range(repeats):
        out = llm.chat(conv, one)[0]
        best = min(best, out.metrics.ttft)
    llm.shutdown()
    return best, len(out.prompt_token_ids), out.num_cached_tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default="model_impl,concurrency,prefix",
                        help="comma-separated subset of: model_impl, concurrency, prefix")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    print(f"machine: {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} CPUs, "
          f"Python {platform.python_version()}")

    if "model_impl" in sections:
        results, agree = bench_fallback.run(args.model, args.tokens, 16, args.repeats)
        print(bench_fallback.table(results, agree, args.tokens, 16) + "\n")

    if "concurrency" in sections:
        llm = LLM(model=args.model)
        agg = concurrency(llm, args.tokens, repeats=args.repeats)
        llm.shutdown()
        print(f"concurrency — native engine, {args.tokens} tokens per request")
        for n, tps in agg.items():
            print(f"  {n:>2} concurrent requests: {tps:8.1f} tok/s aggregate")
        print(f"  16 streams vs 1 stream: {agg[16] / agg[1]:.2f}x (target >= 5x)\n")

    if "prefix" in sections:
        on = second_turn_ttft(args.model, True)
        off = second_turn_ttft(args.model, False)
        print(f"prefix caching — second chat turn, {on[1]} prompt tokens")
        print(f"  cache on : TTFT {on[0] * 1000:8.1f} ms ({on[2]} tokens from the prefix cache)")
        print(f"  cache off: TTFT {off[0] * 1000:8.1f} ms ({off[2]} tokens from the prefix cache)")
        print(f"  on / off : {on[0] / off[0]:.3f} (target <= 0.2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
