"""The Gemma 3 section of ``python -m benchmarks.fallback``: its figures and table from a run's rows."""

from benchmarks import fallback_gemma

PEER = "llama.cpp llama-server b1-test"


def run_doc():
    rows = {
        "fallback (captured decode)": {"prefill_tok_s": 300.0, "decode_tok_s": 40.0, "prefill_rounds": [300.0, 280.0],
                                       "decode_rounds": [40.0, 44.0], "tokens": [5, 6, 7], "decode_path": "fused",
                                       "load_s": 12.0},
        PEER: {"prefill_tok_s": 200.0, "decode_tok_s": 50.0, "prefill_rounds": [200.0, 350.0],
               "decode_rounds": [50.0, 40.0], "tokens": [5, 6, 9]},
        "fallback (eager PaddleFormers)": {"prefill_tok_s": 250.0, "decode_tok_s": 10.0, "prefill_rounds": [250.0],
                                           "decode_rounds": [10.0], "tokens": [5, 6, 7], "decode_path": "paddle"},
    }
    return {"gguf": "g.gguf", "threads": 2, "engine_threads": 2, "prefill_tokens": 257, "decode_tokens": 3,
            "peer": PEER, "load_average": {"start": [1.0, 1, 1], "end": [2.0, 2, 2]}, "rows": rows}


def test_every_fallback_row_stands_beside_llama_cpp():
    figures = {f["figure"]: f for f in fallback_gemma.figures(run_doc())}
    assert len(figures) == 4  # captured and eager, prefill and decode; the peer is no row of its own
    decode = figures["Gemma 3 270M, fallback (captured decode): decode (peer: llama.cpp, 2 threads)"]
    assert (decode["ours"], decode["peer"], decode["ratio"]) == (40.0, 50.0, 0.8)
    eager = figures["Gemma 3 270M, fallback (eager PaddleFormers): prefill (peer: llama.cpp, 2 threads)"]
    assert (eager["ours"], eager["peer"]) == (250.0, 200.0)


def test_the_table_takes_ratios_within_rounds_and_counts_agreeing_tokens():
    text = fallback_gemma.table(run_doc())
    # prefill per round: 1.50 and 0.80 -> median 1.15; decode: 0.80 and 1.10 -> 0.95
    assert "1.15x [0.80-1.50]" in text and "0.95x [0.80-1.10]" in text
    assert "identical to llama.cpp's for the first 2 of 3" in text
    assert "load average 1.0 at the start, 2.0 at the end" in text
