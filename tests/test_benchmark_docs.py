"""Every measured number in the docs traces to a benchmark's results file.

A measured number is one with a unit of time, rate, throughput or ratio (``12.3 ms``,
``88.7 tok/s``, ``1.89x``, ``63 %``). Each must stand in a section (heading to heading) that links
a results file -- ``docs/benchmarks/NAME.md`` or ``benchmarks/results/NAME.json`` -- and be one of
the values in those files, as the benchmark printed it (to the decimals the doc quotes). A few
numbers with such units are settings, not measurements; they are listed here with the setting
they name."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "gpu_kernels" / "README.md"]

UNIT = (r"(?:\s?(?:µs|us|ms|s|seconds?|minutes?|min|tok/s|tokens/s|req/s|GB/s|TB/s|MB/s|GFLOP/s|TFLOP/s|%)|x|×)"
        r"(?![\w/])")
NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
MEASURED = re.compile(rf"(?<![\w.^/-])({NUMBER})(?:\s*(?:-|–|to)\s*({NUMBER}))?{UNIT}")
LINK = re.compile(r"(?:docs/)?benchmarks/(?:results/)?([\w-]+)\.(?:md|json)")

# (document, the text around the number): settings and definitions, not measurements
SETTINGS = {
    ("docs/ARCHITECTURE.md", "every 20 ms"): "playground/app.py QUEUE_POLL_S",
    ("docs/ARCHITECTURE.md", "in the last 2 s"): "the views' snapshot window (playground/monitor.py)",
    ("docs/ARCHITECTURE.md", "over 30 s on two cores"): "the definition of the `slow` marker (pyproject.toml)",
    ("docs/RELIABILITY.md", "30 by default"): "LLMProcess heartbeat_timeout",
    ("docs/benchmarks.md", "at most 5% slower"): "the goal benchmarks.playground checks (--check)",
    ("docs/DISTRIBUTED.md", "communication <= 20 %"): "the goal of tensor parallelism (issue 34)",
}


def sections(text: str):
    """(heading, body) pairs, fenced code left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    parts = re.split(r"^(#+ .*)$", text, flags=re.M)
    yield "", parts[0]
    for i in range(1, len(parts), 2):
        yield parts[i], parts[i + 1]


def values(name: str) -> set[float]:
    """Every number in results file NAME: figures, table cells, settings, notes."""
    path = ROOT / "benchmarks" / "results" / f"{name}.json"
    assert path.exists(), f"the docs link {name}, which no benchmark has written (benchmarks/results/{name}.json)"
    found: set[float] = set()

    def walk(x):
        if isinstance(x, bool) or x is None:
            return
        if isinstance(x, (int, float)):
            found.add(float(x))
        elif isinstance(x, str):
            found.update(float(n.replace(",", "")) for n in re.findall(NUMBER, x))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads(path.read_text()))
    return found


def quoted(number: str, found: set[float]) -> bool:
    """``number`` as the doc prints it is one of ``found`` rounded to the doc's decimals (or a
    ratio, a fraction, printed as a percentage)."""
    d = float(number.replace(",", ""))
    decimals = len(number.split(".")[1]) if "." in number else 0
    return any(round(v, decimals) == d or round(v * 100, decimals) == d for v in found)


def untraced(text: str, rel: str) -> list[str]:
    """The measured numbers of document ``rel`` (its ``text``) that no linked results file holds."""
    problems = []
    for heading, body in sections(text):
        # docs/benchmarks/README.md is the index; NAME the placeholder of docs/benchmarks.md
        linked = sorted(set(LINK.findall(body)) - {"README", "NAME"})
        known = set().union(*(values(n) for n in linked)) if linked else set()
        for m in MEASURED.finditer(body):
            around = body[max(0, m.start() - 40): m.end() + 40]
            if any(d == rel and s in around for d, s in SETTINGS):
                continue
            for number in filter(None, m.groups()):
                if not linked:
                    problems.append(f"{rel} {heading or '(top)'}: {m.group(0)!r} -- no results file linked here "
                                    f"(...{' '.join(around.split())}...)")
                elif not quoted(number, known):
                    problems.append(f"{rel} {heading}: {number} (in {m.group(0)!r}) is in none of {linked}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_measured_number_in_the_docs_is_in_a_linked_results_file(doc):
    problems = untraced(doc.read_text(), doc.relative_to(ROOT).as_posix())
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_number_no_benchmark_printed():
    text = ("# Serving\n\nOurs: 266.8 tok/s at c=16, 1.89x llama-server's ([run](benchmarks/serving.md)).\n\n"
            "# Elsewhere\n\nA step takes 46-57 ms.\n\n# Wrong\n\n[run](benchmarks/serving.md): 999.9 tok/s.\n")
    problems = untraced(text, "x.md")
    assert any("# Elsewhere" in p and "no results file" in p for p in problems)
    assert any("999.9" in p for p in problems)
    assert not any("266.8" in p or "1.89" in p for p in problems)
    assert len(problems) == 3      # 46 and 57, 999.9
