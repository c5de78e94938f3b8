"""Backend consistency between two model implementations of the same checkpoint, and the
independent check against HF transformers.

    python -m engine.align --model smollm2-135m-instruct --impls native,paddleformers [--prompts FILE]
    python -m engine.align --reference transformers      # the native engine vs transformers (torch)

or, from Python (the playground calls this)::

    report = compare_backends(llm_a, llm_b, prompts)    # two loaded LLMs
    report = compare_models("smollm2-135m-instruct")    # loads both implementations
    print(report.table()); report.rows[0].top1_agreement

The native and PaddleFormers backends share the engine's kernels, block
weights, linears and logprob code, so their agreement says the two model
definitions are consistent, not that either is accurate. ``--reference
transformers`` compares the engine with transformers reading the same GGUF
with its own loader, dequantization, attention and softmax
(`engine.transformers_reference`; needs torch and transformers).

Everything goes through the engine's public API: one greedy request per
prompt with ``prompt_logprobs=k`` and ``logprobs=k``. Per prompt it reports

* **top-1 agreement** — the share of compared positions where both pick the
  same most likely next token;
* **max |Δ logprob|** — the largest difference between the two logprobs of any
  token in both top-k lists at any compared position;
* **mean KL** — KL(a ‖ b) averaged over positions, computed on the top-k
  tokens the two share with the rest of the vocabulary lumped into one
  "other" bucket (a lower bound on the full KL, exact when the shared top-k
  hold all the mass);
* **greedy identical** — whether the N-token greedy continuations are equal
  (and where they first differ).

Compared positions are every prompt position (teacher-forced) plus the
generated positions up to the first greedy divergence (after it the two see
different contexts).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .sampling_params import MAX_LOGPROBS, SamplingParams

DEFAULT_PROMPTS = (
    "Question: What is 2+3?\nAnswer:",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains,",
)


@dataclass(frozen=True)
class ConsistencyRow:
    prompt: str
    positions: int               # positions compared (prompt + agreeing generated ones)
    top1_agreement: float        # in [0, 1]
    max_abs_logprob_diff: float
    mean_kl: float
    greedy_identical: bool
    greedy_tokens: int           # N
    first_divergence: int | None  # index of the first differing generated token
    text_a: str
    text_b: str


@dataclass(frozen=True)
class ConsistencyReport:
    model: str
    impl_a: str
    impl_b: str
    rows: tuple[ConsistencyRow, ...]

    @property
    def top1_agreement(self) -> float:
        total = sum(r.positions for r in self.rows)
        return sum(r.top1_agreement * r.positions for r in self.rows) / max(total, 1)

    @property
    def max_abs_logprob_diff(self) -> float:
        return max((r.max_abs_logprob_diff for r in self.rows), default=0.0)

    @property
    def all_greedy_identical(self) -> bool:
        return all(r.greedy_identical for r in self.rows)

    def to_dict(self) -> dict:
        return {"model": self.model, "impl_a": self.impl_a, "impl_b": self.impl_b,
                "rows": [asdict(r) for r in self.rows]}

    def table(self) -> str:
        """A plain-text table, one line per prompt plus a summary line."""
        head = f"{'prompt':<34} {'pos':>4} {'top-1':>7} {'max|Δlp|':>9} {'mean KL':>9}  greedy"
        lines = [f"backend consistency — {self.model}: {self.impl_a} vs {self.impl_b}", head, "-" * len(head)]
        for r in self.rows:
            prompt = r.prompt.replace("\n", "\\n")
            prompt = prompt if len(prompt) <= 34 else prompt[:31] + "..."
            greedy = (f"identical ({r.greedy_tokens})" if r.greedy_identical
                      else f"differs at {r.first_divergence}/{r.greedy_tokens}")
            lines.append(f"{prompt:<34} {r.positions:>4} {r.top1_agreement:>7.1%} "
                         f"{r.max_abs_logprob_diff:>9.2e} {r.mean_kl:>9.2e}  {greedy}")
        lines.append("-" * len(head))
        lines.append(f"{'all':<34} {sum(r.positions for r in self.rows):>4} {self.top1_agreement:>7.1%} "
                     f"{self.max_abs_logprob_diff:>9.2e} {'':>9}  "
                     f"{'all identical' if self.all_greedy_identical else 'NOT all identical'}")
        return "\n".join(lines)


def _compare(a: dict, b: dict) -> tuple[bool, float, float]:
    """(same top-1, max |Δ logprob| over shared tokens, KL(a‖b) with an 'other' bucket) at one position."""
    top_a = min(a.items(), key=lambda kv: kv[1].rank)[0]
    top_b = min(b.items(), key=lambda kv: kv[1].rank)[0]
    shared = a.keys() & b.keys()
    max_diff = max((abs(a[t].logprob - b[t].logprob) for t in shared), default=math.inf)
    pa = {t: math.exp(a[t].logprob) for t in shared}
    pb = {t: math.exp(b[t].logprob) for t in shared}
    kl = sum(pa[t] * (a[t].logprob - b[t].logprob) for t in shared)
    rest_a, rest_b = max(1.0 - sum(pa.values()), 0.0), max(1.0 - sum(pb.values()), 0.0)
    if rest_a > 1e-12:
        kl += rest_a * (math.log(rest_a) - math.log(max(rest_b, 1e-30)))
    return top_a == top_b, max_diff, max(kl, 0.0)


def _row(prompt: str, out_a, out_b) -> ConsistencyRow:
    positions = [(x, y) for x, y in zip(out_a.prompt_logprobs[1:], out_b.prompt_logprobs[1:])]
    ca, cb = out_a.outputs[0], out_b.outputs[0]
    diverge = next((i for i, (x, y) in enumerate(zip(ca.token_ids, cb.token_ids)) if x != y), None)
    agreeing = len(ca.token_ids) if diverge is None else diverge + 1  # the diverging step still shares context
    positions += list(zip(ca.logprobs[:agreeing], cb.logprobs[:agreeing]))
    stats = [_compare(x, y) for x, y in positions]
    n = len(stats)
    return ConsistencyRow(
        prompt=prompt,
        positions=n,
        top1_agreement=sum(s[0] for s in stats) / max(n, 1),
        max_abs_logprob_diff=max((s[1] for s in stats), default=0.0),
        mean_kl=sum(s[2] for s in stats) / max(n, 1),
        greedy_identical=diverge is None and len(ca.token_ids) == len(cb.token_ids),
        greedy_tokens=len(ca.token_ids),
        first_divergence=diverge,
        text_a=ca.text,
        text_b=cb.text,
    )


def compare_backends(llm_a, llm_b, prompts=DEFAULT_PROMPTS, *, max_tokens: int = 32,
                     top_k: int = MAX_LOGPROBS, model: str | None = None) -> ConsistencyReport:
    """Compare two loaded ``LLM``s (same checkpoint, different ``model_impl``) on ``prompts``."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ValueError("compare_backends needs at least one prompt")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=top_k,
                            prompt_logprobs=top_k)
    outs_a = llm_a.generate(prompts, params)
    outs_b = llm_b.generate(prompts, params)
    rows = tuple(_row(p, a, b) for p, a, b in zip(prompts, outs_a, outs_b))
    return ConsistencyReport(model or llm_a.model_name, llm_a.model_impl, llm_b.model_impl, rows)


def compare_models(model: str, impls=("native", "paddleformers"), prompts=DEFAULT_PROMPTS, *,
                   max_tokens: int = 32, **engine_args) -> ConsistencyReport:
    """Load ``model`` once per implementation in ``impls`` (two of them) and compare them."""
    from .llm import LLM

    impl_a, impl_b = impls
    engine_args.setdefault("dtype", "float32")
    llm_a = LLM(model=model, model_impl=impl_a, **engine_args)
    llm_b = LLM(model=model, model_impl=impl_b, **engine_args)
    return compare_backends(llm_a, llm_b, prompts, max_tokens=max_tokens, model=model)


def compare_with_transformers(model: str, prompts=DEFAULT_PROMPTS, *, max_tokens: int = 32,
                              top_k: int = 5, **engine_args) -> ConsistencyReport:
    """The engine (``model_impl="native"`` unless given) vs HF transformers on the same GGUF file."""
    from .llm import LLM
    from .loader import load_checkpoint
    from .transformers_reference import TransformersReference

    checkpoint = load_checkpoint(model)
    if not str(checkpoint.path).endswith(".gguf"):
        raise ValueError(f"--reference transformers reads GGUF files; {model} is {checkpoint.path}")
    reference = TransformersReference(checkpoint.path, checkpoint.tokenizer, model)  # before PaddleFormers
    engine_args.setdefault("dtype", "float32")
    engine_args.setdefault("model_impl", "native")
    llm = LLM(model=model, **engine_args)
    return compare_backends(llm, reference, prompts, max_tokens=max_tokens, top_k=top_k, model=model)


# The names this module had before it said what it measures; playground/ still uses them.


def read_prompts(path: str) -> list[str]:
    """Prompts from a file: one per line, ``\\n`` inside a line stands for a newline; blank lines skipped."""
    with open(path, encoding="utf-8") as fh:
        return [line.rstrip("\n").replace("\\n", "\n") for line in fh if line.strip()]


def main(argv=None) -> int:
    from .config import FlagParser

    parser = FlagParser(prog="python -m engine.align", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="zoo name, .gguf path or HF model dir")
    parser.add_argument("--impls", default="native,paddleformers", help="two model_impl values, comma-separated")
    parser.add_argument("--prompts", help="file with one prompt per line (default: a built-in set)")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy continuation length N")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--reference", choices=("transformers",),
                        help="compare the engine with an independent implementation instead of --impls")
    args = parser.parse_args(argv)
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    if len(impls) != 2:
        parser.error(f"--impls needs exactly two implementations, got {impls}")
    prompts = read_prompts(args.prompts) if args.prompts else DEFAULT_PROMPTS
    if args.reference == "transformers":
        report = compare_with_transformers(args.model, prompts, max_tokens=args.max_tokens, device=args.device)
        print("independent check: HF transformers reads the same GGUF with its own loader and kernels")
    else:
        report = compare_models(args.model, impls, prompts, max_tokens=args.max_tokens, device=args.device)
    print(report.table())
    return 0 if report.all_greedy_identical and report.top1_agreement == 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
