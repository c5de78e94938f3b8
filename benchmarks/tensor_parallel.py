"""Benchmark section "tensor_parallel" (``python -m benchmarks.engine --tensor-parallel 1,2``): the
time of one engine step split into compute and communication, at each tensor-parallel size, in
one run.

Rows: ``TP=1`` twice (the fused CPU decode step, the engine's default, and the Paddle layers,
which is the path every rank runs under tensor parallelism), then one row per size ``N > 1``.
Every row computes on float32 weights (``quantization="none"``: ranks do not keep a GGUF's
blocks) with prefix caching off. Three workloads, each step timed inside the model runner:

* **decode, 1 stream** and **decode, 8 streams** -- the median decode step;
* **prefill** -- one prompt of ``--prefill-tokens`` tokens (capped at 512) in one step.

*Communication* is what rank 0 spends sending the step's record to the other ranks and inside
the collectives (an all-reduce after each row-parallel layer and the embedding, a gather on rank 0 of
the logits), waiting for the slowest rank included; *compute* is the rest of the step. The rows
are loaded together and measured round by round, so a busy neighbour slows all of them alike.

The model is ``--model`` when every size splits its heads; otherwise (SmolLM2's 9 query heads
and 3 KV heads split only 1, 3 and 9 ways) a stand-in of the same size and layout with random
weights, whose head counts every size splits, is written to a temporary directory (random
weights time like trained ones; its tokens mean nothing).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time

import numpy as np

from engine import LLM, SamplingParams

WORKLOADS = ("decode, 1 stream", "decode, 8 streams", "prefill")


def splits(cfg: dict, n: int) -> bool:
    heads, kv, inter = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"], \
        cfg["intermediate_size"]
    return heads % n == 0 and (kv % n == 0 or n % kv == 0) and inter % n == 0


def stand_in_shape(cfg: dict, sizes: list[int]) -> tuple[int, int, int]:
    """(query heads, KV heads, MLP width) of the stand-in for ``cfg`` at ``sizes`` (see `stand_in`)."""
    step = math.lcm(*sizes)
    hidden = cfg["hidden_size"]
    heads = next(h for h in range(step, hidden + 1, step) if h >= cfg["num_attention_heads"] and hidden % h == 0)
    kv0 = min(cfg.get("num_key_value_heads") or heads, heads)
    kv = next(k for k in range(kv0, heads + 1) if heads % k == 0 and all(k % n == 0 or n % k == 0 for n in sizes))
    return heads, kv, cfg["intermediate_size"] // step * step


def stand_in(cfg: dict, sizes: list[int], directory: str) -> str:
    """An HF directory of a Llama like ``cfg`` (layers, hidden, MLP, vocab), random float16 weights,
    with the fewest query heads >= ``cfg``'s that every size divides and that divide the hidden size,
    and the fewest KV heads >= ``cfg``'s that every size splits or divides."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv, inter = stand_in_shape(cfg, sizes)
    d = hidden // heads
    os.makedirs(directory, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "rms_norm_eps": 1e-5,
              "rope_theta": cfg.get("rope_theta", 10000.0), "max_position_embeddings": 2048,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": w(heads * d, hidden),
                        p + "self_attn.k_proj.weight": w(kv * d, hidden),
                        p + "self_attn.v_proj.weight": w(kv * d, hidden),
                        p + "self_attn.o_proj.weight": w(hidden, heads * d),
                        p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                        p + "mlp.down_proj.weight": w(hidden, inter),
                        p + "input_layernorm.weight": np.ones(hidden, np.float16),
                        p + "post_attention_layernorm.weight": np.ones(hidden, np.float16)})
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config, fh)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, fh)
    return directory


class Row:
    """One LLM and the split of every step its runner runs (``record``: the workload being measured)."""

    def __init__(self, name: str, **engine_args):
        self.name = name
        self.llm = LLM(**engine_args)
        runner = self.llm.engine.runner
        self.split: dict[str, list[tuple[float, float]]] = {w: [] for w in WORKLOADS}
        self.recording: str | None = None
        run = runner.run

        def timed(record, *rest):
            t0 = time.perf_counter()
            out = run(record, *rest)
            total = time.perf_counter() - t0
            comm = runner.last_times["comm_s"] if hasattr(runner, "last_times") else 0.0
            want = self.recording
            if want is not None and (record.decode_only == want.startswith("decode")):
                self.split[want].append((total - comm, comm))
            return out

        runner.run = timed

    def measure(self, workload: str, prompts: list[list[int]], tokens: int) -> None:
        self.recording = workload
        try:
            self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        finally:
            self.recording = None

    def medians(self) -> dict[str, tuple[float, float]]:
        out = {}
        for w, steps in self.split.items():
            if steps:
                totals = [c + m for c, m in steps]
                i = totals.index(statistics.median_low(totals))
                out[w] = steps[i]
        return out

    def close(self) -> None:
        tp = self.llm.engine.tensor_parallel
        if tp is not None:
            tp.close()


def run(engine_args: dict, sizes: list[int], tokens: int, prefill_tokens: int, repeats: int) -> dict:
    from engine.loader import load_checkpoint

    checkpoint = load_checkpoint(engine_args["model"])
    cfg = checkpoint.config
    model, note = engine_args["model"], engine_args["model"]
    tmp = None
    if not all(splits(cfg, n) for n in sizes if n > 1):
        tmp = tempfile.TemporaryDirectory(prefix="tp-stand-in-")
        model = stand_in(cfg, sizes, tmp.name)
        with open(os.path.join(model, "config.json")) as fh:
            c = json.load(fh)
        note = (f"stand-in for {engine_args['model']} ({cfg['num_attention_heads']} query / "
                f"{cfg.get('num_key_value_heads')} KV heads do not split {sizes} ways): the same layers, hidden "
                f"size, MLP and vocab with {c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads "
                f"of {c['head_dim']}, random weights")
    prefill_tokens = min(prefill_tokens, 512)
    base = {**engine_args, "model": model, "quantization": "none", "enable_prefix_caching": False,
            "max_num_batched_tokens": 512, "kv_cache_memory": 64 * 2**20}
    rows = []
    try:
        rows.append(Row("TP=1, fused decode", **{**base, "tensor_parallel_size": 1, "cpu_decode": "fused"}))
        rows.append(Row("TP=1, Paddle layers", **{**base, "tensor_parallel_size": 1, "cpu_decode": "paddle"}))
        for n in sizes:
            if n > 1:
                rows.append(Row(f"TP={n}", **{**base, "tensor_parallel_size": n}))
        vocab = cfg["vocab_size"]
        rng = np.random.default_rng(0)
        short = [rng.integers(3, vocab, 32).tolist() for _ in range(8)]
        long = [rng.integers(3, vocab, prefill_tokens).tolist()]
        for row in rows:
            row.measure("decode, 1 stream", short[:1], 4)   # warm-up, not kept
            row.split = {w: [] for w in WORKLOADS}
        for _ in range(repeats):
            for row in rows:
                row.measure("decode, 1 stream", short[:1], tokens)
                row.measure("decode, 8 streams", short, tokens // 2)
                row.measure("prefill", long, 1)
        results = {row.name: row.medians() for row in rows}
        ranks = {row.name: row.llm.engine.tensor_parallel.stats() for row in rows if row.llm.engine.tensor_parallel}
        bare = {row.name: row.llm.engine.tensor_parallel.probe(200, cfg["hidden_size"])
                for row in rows if row.llm.engine.tensor_parallel}
        decode_path = {row.name: row.llm.snapshot().decode_path for row in rows}
    finally:
        for row in rows:
            row.close()
        if tmp is not None:
            tmp.cleanup()
    return {"model": note, "sizes": sizes, "tokens": tokens, "prefill_tokens": prefill_tokens,
            "repeats": repeats, "rows": {name: {w: {"compute_s": c, "comm_s": m} for w, (c, m) in r.items()}
                                         for name, r in results.items()},
            "ranks": {name: {str(k): v for k, v in s.items()} for name, s in ranks.items()},
            "decode_path": decode_path, "bare_all_reduce_s": bare,
            "collectives_per_step": 2 * cfg["num_hidden_layers"] + 2}


def table(result: dict) -> str:
    lines = [f"tensor parallel -- {result['model']}; float32 weights, median step of {result['repeats']} rounds "
             f"({result['tokens']} decode tokens, a {result['prefill_tokens']}-token prefill); "
             f"ms: compute + communication = step (communication's share)"]
    lines.append(f"{'':<22}" + "".join(f"{w:>36}" for w in WORKLOADS))
    for name, row in result["rows"].items():
        cells = []
        for w in WORKLOADS:
            if w not in row:
                cells.append(f"{'-':>36}")
                continue
            c, m = row[w]["compute_s"] * 1e3, row[w]["comm_s"] * 1e3
            cells.append(f"{f'{c:.1f} + {m:.1f} = {c + m:.1f} ({m / (c + m):.0%})':>36}")
        lines.append(f"{name:<22}" + "".join(cells))
    for name, stats in result["ranks"].items():
        per = ", ".join(f"rank {r}: {s['comm_s']:.2f} s in {s['calls']} collectives"
                        + (f", {s['step_s']:.2f} s in {s['steps']} steps" if "step_s" in s else "")
                        for r, s in stats.items())
        lines.append(f"  {name} over the whole run -- {per}")
    for name, seconds in result["bare_all_reduce_s"].items():
        n = result["collectives_per_step"]
        lines.append(f"  {name}: a bare all-reduce of one hidden row takes {seconds * 1e3:.2f} ms here; a step makes "
                     f"{n} collectives (2 a layer, the embedding's, the logits' gather on rank 0): a floor of "
                     f"{n * seconds * 1e3:.1f} ms a step before any rank waits for another")
    lines.append("  communication: rank 0 sending the step record and waiting inside all-reduce / gather "
                 "(the slowest rank's lateness included); on a machine with fewer cores than ranks, ranks "
                 "share cores and no speed-up is expected")
    return "\n".join(lines)
