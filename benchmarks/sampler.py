"""``python -m benchmarks.sampler``: the engine's sampler beside the same rule in NumPy, one run.

1. **Per row**: µs to sample one row of the model's logits (SmolLM2: 49,152, float32) and report
   its 5 top logprobs, greedy and at the playground's defaults (temperature 0.7, top-p 0.9), by
   the engine's compiled passes (``engine.sampler.Sampler``) and by
   ``engine.sampling_reference.NumpySampler`` (argmax / ``rng.choice``, ``argpartition``) on the
   same rows: the rows the engine sampled while decoding the chats below at those settings (how
   peaked a row is decides how many tokens top-p sorts). The two pick the same tokens
   (``tests/test_sampling.py``).
2. **Decode**: tok/s of ``--streams`` chats decoded together by one engine, with either sampler in
   its place, alternating, the same settings.

Results: ``benchmarks/results/sampler.json``, rendered into ``docs/benchmarks/sampler.md``.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

from engine.config import FlagParser, add_engine_args, config_from_args

from . import results

if TYPE_CHECKING:
    from engine import SamplingParams

SETTINGS = {"greedy": dict(temperature=0.0), "T 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9)}
PROMPTS = ["Tell me about the ocean.", "Describe a forest at night.", "Explain how a bicycle works.",
           "Describe the moon.", "Tell me about trains.", "Explain what clouds are."]


class Recorder:
    """Wraps a sampler; keeps a copy of every row it samples."""

    def __init__(self, sampler):
        self.sampler, self.rows = sampler, []

    def sample(self, row, params, rng, adjust=None):
        self.rows.append(np.array(row))
        return self.sampler.sample(row, params, rng, adjust)


def per_row_us(sampler, rows: np.ndarray, params: SamplingParams) -> float:
    rng = np.random.default_rng(0)
    sampler.sample(rows[0], params, rng)
    t0 = time.perf_counter()
    for row in rows:
        sampler.sample(row, params, rng)
    return (time.perf_counter() - t0) / len(rows) * 1e6


def decode_tok_s(llm, prompts: list[str], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    parser = FlagParser(prog="python -m benchmarks.sampler",
                        description=__doc__.splitlines()[0].replace("``", ""))
    add_engine_args(parser)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 streams, 16 tokens, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.tokens, args.repeats = 2, 16, 2
    from engine import LLM, SamplingParams     # Paddle, after the arguments: --help answers at once
    from engine.sampling_reference import NumpySampler

    started = results.start()
    llm = LLM(**vars(config_from_args(args)))
    compiled = llm.engine.sampler
    numpy_sampler = NumpySampler(compiled.decode_token)
    pair = (("compiled", compiled), ("NumPy", numpy_sampler))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.streams)]
    result = {}
    try:
        for name, setting in SETTINGS.items():
            params = SamplingParams(logprobs=5, **setting)
            recorder = llm.engine.sampler = Recorder(compiled)
            llm.generate(prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=1, logprobs=5,
                                                 **setting), use_tqdm=False)
            llm.engine.sampler = compiled
            rows = np.stack(recorder.rows)
            result[f"{name}: µs per row"] = {k: round(per_row_us(s, rows, params), 1) for k, s in pair}
        for name, setting in SETTINGS.items():
            params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, seed=1, logprobs=5, **setting)
            runs = {k: [] for k, _ in pair}
            for r in range(args.repeats):            # alternating: the machine's drift hits both
                for k, s in pair if r % 2 == 0 else pair[::-1]:
                    llm.engine.sampler = s
                    runs[k].append(decode_tok_s(llm, prompts, params))
            result[f"{name}: tok/s, {args.streams} streams"] = {k: round(statistics.median(v), 1)
                                                              for k, v in runs.items()}
    finally:
        llm.engine.sampler = compiled
        llm.shutdown()
    for key, value in result.items():
        print(f"{key:>40}: {'   '.join(f'{k} {v}' for k, v in value.items())}")
    results.write_run("sampler", [results.figure(key, key.split(": ")[1].split(",")[0], v["compiled"], v["NumPy"],
                                                 better="lower" if "µs" in key else "higher")
                                  for key, v in result.items()],
                      ours="compiled", peer="NumPy", title="Sampler: the engine's compiled passes beside NumPy",
                      started=started, quick=args.quick, settings={"model": args.model, "streams": args.streams,
                                                                   "tokens": args.tokens, "repeats": args.repeats})
    return result


if __name__ == "__main__":
    main()
