"""Benchmark section "fallback": the native engine vs the PaddleFormers backend vs PaddleFormers' ``generate``.

All run the same SmolLM2 weights (float32, CPU, one process, one run):

* **native engine** — ``LLM(model_impl="native")``; with the default
  ``quantization="auto"`` CPU matmuls run on the GGUF's
  own Q4_1/Q8_0 blocks (``engine.block_linear``), as the PaddleFormers backend's do;
* **native, float matmuls** — the same with ``quantization="none"``: every
  matmul on the dequantized float32 weights, like ``generate``;
* **PaddleFormers backend** — ``LLM(model_impl="paddleformers")``: PaddleFormers'
  ``LlamaForCausalLM`` on the engine's paged KV cache and kernels (and the same
  with ``quantization="none"``);
* **PaddleFormers generate** — the same class with its own attention (``sdpa``)
  and its own KV cache, driven by its ``generate`` (greedy).

Each engine runs twice, with quantized matmuls (the default) and with float
matmuls (``quantization="none"``), so that every comparison with ``generate``
(always float) exists float against float. Each is loaded, measured over
``repeats`` rounds and released before the next (five models at once would
not fit in a small machine's memory):

* **single-stream decode tok/s** — one request of N tokens; ``1 / median``
  of the intervals between consecutive generated tokens (the prefill is not
  an interval). For the engines an interval is the time between two streamed
  tokens; for ``generate`` the time between two calls of the model's forward
  (one per token), so both include everything done per token. The median
  shrugs off the steps a busy neighbour on a shared machine slowed down.
* **16-stream aggregate tok/s** — 16 different prompts submitted together
  (continuous batching for the engines, one left-padded batch for
  ``generate``): ``16 × N / T``, best round.

Greedy decoding that does not stop at EOS, so every run generates exactly N tokens.
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
    single_tok_s: float
    multi_tok_s: float


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
        log=print) -> tuple[list[Result], bool]:
    """Measure them all; returns the results and whether their single-stream greedy outputs agree."""
    from engine import LLM
    from engine.loader import load_checkpoint

    checkpoint = load_checkpoint(model)
    engine = lambda impl, quantization: lambda: EngineRunner(LLM(
        model=model, model_impl=impl, dtype="float32", device="cpu", quantization=quantization))
    factories = {
        "native engine": engine("native", "auto"),
        "native, float matmuls": engine("native", "none"),
        "PaddleFormers backend": engine("paddleformers", "auto"),
        "PF backend, float matmuls": engine("paddleformers", "none"),
        "PaddleFormers generate": lambda: PaddleFormersGenerate(checkpoint),
    }
    encode = lambda text: checkpoint.tokenizer.encode(text, add_special_tokens=True)
    single = encode(STORY)
    multi = [encode(prompt) for prompt in poem_prompts(streams)]
    results, outputs = [], {}
    for name, factory in factories.items():  # one at a time: five models at once would not fit in memory
        log(f"loading {model}: {name} ...")
        runner = factory()
        runner.generate([single], 2)  # warm up: kernels compiled, caches allocated
        intervals, multi_s = [], []
        for r in range(repeats):
            gaps, outputs[name] = runner.token_intervals(single, tokens)
            intervals += gaps
            t0 = time.perf_counter()
            runner.generate(multi, tokens)
            multi_s.append(time.perf_counter() - t0)
            log(f"  round {r + 1}/{repeats} {name}: median {statistics.median(gaps) * 1000:.1f} ms/token "
                f"single-stream, {streams} streams {multi_s[-1]:.2f} s")
        if isinstance(runner, EngineRunner):
            runner.llm.shutdown()
        del runner
        results.append(Result(name, 1.0 / statistics.median(intervals), streams * tokens / min(multi_s)))
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


def table(results: list[Result], agree: bool, tokens: int, streams: int) -> str:
    by = {r.name: r for r in results}
    native, backend, generate = by["native engine"], by["PaddleFormers backend"], by["PaddleFormers generate"]
    lines = [f"fallback — SmolLM2 weights, float32, CPU, N={tokens} generated tokens per request",
             f"{'':<24}{'single-stream decode':>22}{f'{streams}-stream aggregate':>22}",
             f"{'':<24}{'tok/s (median)':>22}{'tok/s (best)':>22}"]
    for r in results:
        lines.append(f"{r.name:<24}{r.single_tok_s:>22.1f}{r.multi_tok_s:>22.1f}")
    lines.append("quantized rows multiply on the GGUF's Q4_1/Q8_0 blocks; float rows (and generate) on float32")
    for who, label, ref, target in (
        (native, "vs PF generate", generate, None),
        (by["native, float matmuls"], "vs PF generate", generate, 1.5),
        (backend, "vs native", native, 0.85),
        (by["PF backend, float matmuls"], "vs PF generate", generate, 1.5),
    ):
        s, m = who.single_tok_s / ref.single_tok_s, who.multi_tok_s / ref.multi_tok_s
        goal = f"   (target >= {target}x)" if target else ""
        lines.append(f"{who.name + ' ' + label:<44}{s:>5.2f}x{m:>21.2f}x{goal}")
    lines.append(f"single-stream greedy outputs all agree: {'yes' if agree else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.fallback", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results, agree = run(args.model, args.tokens, args.streams, args.repeats)
    print(table(results, agree, args.tokens, args.streams))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
