"""benchmarks.results: a run becomes a JSON file (date, machine, load, commit, command, every
figure beside the peer's) and, from that file alone, a Markdown table and a PNG."""

import json
import os

import pytest

from benchmarks import results


def _small_run(tmp_path):
    started = results.start()
    figures = [results.figure("greedy, µs per row", "µs", 12.34, 45.6, better="lower"),
               results.figure("decode, 4 streams", "tok/s", 88.7, 81.9),
               results.figure("decode, 16 streams", "tok/s", 266.8, None)]
    return results.write_run("demo", figures, ours="engine", peer="NumPy", title="Demo run",
                             command="python -m benchmarks.demo --quick", started=started, quick=True,
                             settings={"streams": 4}, tables=[{"title": "per round", "columns": ["round", "tok/s"],
                                                               "rows": [[1, 87.25], [2, 90.0]]}],
                             raw={"rounds": [87.25, 90.0]}, results_dir=tmp_path)


def test_a_run_is_written_as_json_with_the_machine_the_load_and_every_figure(tmp_path):
    path = _small_run(tmp_path)
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "demo" and doc["command"] == "python -m benchmarks.demo --quick"
    assert doc["quick"] is True and doc["settings"] == {"streams": 4}
    m = doc["machine"]
    assert m["cores"] == os.cpu_count() and m["cpu"]
    assert len(m["load_start"]) == 3 and len(m["load_end"]) == 3
    assert doc["date"].endswith("+00:00") and doc["commit"]
    greedy, four, sixteen = doc["figures"]
    assert (greedy["ours"], greedy["peer"], greedy["better"]) == (12.34, 45.6, "lower")
    assert four["ratio"] == pytest.approx(88.7 / 81.9, abs=1e-4)
    assert sixteen["peer"] is None and sixteen["ratio"] is None
    assert doc["raw"] == {"rounds": [87.25, 90.0]}


def test_the_markdown_and_the_png_are_rendered_from_the_json_alone(tmp_path):
    path = _small_run(tmp_path)
    md, png = tmp_path / "demo.md", tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "| decode, 4 streams | tok/s | 88.7 | 81.9 | 1.08x |" in text
    assert "| greedy, µs per row (lower is better) | µs | 12.3 | 45.6 | 0.27x |" in text
    assert "| decode, 16 streams | tok/s | 266.8 | - | - |" in text
    assert "| 1 | 87.2 |" in text and "Quick settings" in text and "![Demo run](demo.png)" in text
    assert "load average" in text
    # change a figure in the JSON: the rendering follows the file, not the run that wrote it
    doc = json.loads(path.read_text())
    doc["figures"][1]["ours"] = 99.9
    path.write_text(json.dumps(doc))
    md.unlink()
    png.unlink()
    written = results.render(path)
    assert set(written) == {md, png}
    assert "| decode, 4 streams | tok/s | 99.9 | 81.9 |" in md.read_text()


def test_bad_names_and_figures_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="plain file stem"):
        results.write_run("../escape", [], results_dir=tmp_path)
    with pytest.raises(ValueError, match="lacks"):
        results.write_run("demo", [{"figure": "x", "unit": "s"}], results_dir=tmp_path)
    with pytest.raises(ValueError, match="'higher' or 'lower'"):
        results.figure("x", "s", 1.0, better="faster")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="no results file"):
        results.render(tmp_path / "missing.json")


def test_numbers_print_as_the_docs_quote_them():
    assert [results.fmt(v) for v in (266.84, 12.34, 1.5, 0.2734, 49152, 7, None)] == \
        ["266.8", "12.3", "1.50", "0.273", "49,152", "7", "-"]
    assert results.ratio(1.8866) == "1.89x"


def test_the_serving_run_is_written_again_from_its_own_results_file(tmp_path):
    """benchmarks.serving writes through the same writer: --from-json recomputes every figure from
    the committed run's rounds and gives the committed figures back."""
    from benchmarks import serving

    committed = json.loads((results.RESULTS / "serving.json").read_text())
    assert serving.rewrite(results.RESULTS / "serving.json", tmp_path / "serving") == 0
    again = json.loads((tmp_path / "serving.json").read_text())
    assert again["figures"] == committed["figures"] and again["date"] == committed["date"]
    assert again["machine"] == committed["machine"] and again["peer"] == "llama-server"
    assert (tmp_path / "serving.md").exists() and (tmp_path / "serving.png").exists()


def test_the_engine_sections_become_figures_beside_their_peers():
    from benchmarks import engine_figures as ef

    rows = [{"name": "native engine", "single_tok_s": 40.0, "multi_tok_s": 160.0},
            {"name": "PaddleFormers generate", "single_tok_s": 10.0, "multi_tok_s": 20.0}]
    from benchmarks.fallback import Result

    assert ef.fallback([Result(r["name"], r["single_tok_s"], r["multi_tok_s"], (1.0,), (2.0,)) for r in rows],
                       True) == ef.fallback(rows, True)   # the benchmark's own rows, as the section keeps them
    figs = {f["figure"]: f for f in ef.fallback(rows, True)}
    assert figs["native engine: 1 stream"]["ratio"] == 4.0 and figs["native engine: several streams"]["ratio"] == 8.0
    assert figs["single-stream greedy outputs agree"]["ours"] == "yes"
    tp = {"model": "m", "rows": {"TP=1, fused decode": {"decode, 1 stream": {"compute_s": 0.044, "comm_s": 0.0}},
                                 "TP=2": {"decode, 1 stream": {"compute_s": 0.1124, "comm_s": 0.1932}}},
          "bare_all_reduce_s": {"TP=2": 0.00166}}
    figs = {f["figure"]: f for f in ef.tensor_parallel(tp)}
    step = figs["TP=2, decode, 1 stream: ms a step (peer: TP=1, fused decode)"]
    assert (step["ours"], step["peer"], step["better"]) == (305.6, 44.0, "lower")
    assert figs["TP=2, decode, 1 stream: communication's share of a step"]["ours"] == 63.2
    assert figs["TP=2: a bare all-reduce of one hidden row"]["ours"] == 1.66
    assert ef.tensor_parallel_table(tp)["rows"][1] == ["TP=2", "112.4 + 193.2 = 305.6 (63 %)"]
    ttft = ef.prefix({"prompt_tokens": 900, "ttft_s": 0.05}, {"ttft_s": 0.5})[0]
    assert (ttft["ours"], ttft["peer"], ttft["ratio"]) == (50.0, 500.0, 0.1)


def test_every_benchmark_names_itself_as_it_is_run():
    """--help says `python -m benchmarks.NAME`, not `NAME.py` (argparse's default prog)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(results.__file__).parent
    for path in sorted(root.glob("*.py")):
        text = path.read_text()
        if "__main__" not in text:
            continue
        progs = re.findall(r'(?:ArgumentParser|FlagParser)\(prog="([^"]+)"', text)
        assert progs == [f"python -m benchmarks.{path.stem}"], f"{path.name}: the parser's prog is {progs}"
    out = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--help"], capture_output=True, text=True,
                         cwd=root.parent, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m benchmarks.kernels "), out.stdout[:200]


def test_the_committed_pages_are_rendered_from_the_committed_results():
    """docs/benchmarks/NAME.md is what `python -m benchmarks.results NAME` renders from
    benchmarks/results/NAME.json now, and every results file has its page, its plot and a row in the index."""
    index = (results.DOCS / "README.md").read_text()
    names = sorted(p.stem for p in results.RESULTS.glob("*.json"))
    assert names, "no results files"
    for name in names:
        doc = json.loads((results.RESULTS / f"{name}.json").read_text())
        page = results.DOCS / f"{name}.md"
        assert page.exists() and (results.DOCS / f"{name}.png").exists(), f"{name}: run python -m benchmarks.results"
        assert page.read_text() == results.markdown({**doc, "_default_dirs": True, "has_plot": True}), \
            f"docs/benchmarks/{name}.md is not rendered from its results file: run python -m benchmarks.results {name}"
        assert f"| [{name}]({name}.md) |" in index
        assert doc["machine"]["cpu"] and "load_start" in doc["machine"] and doc["date"] and doc["command"]
