"""``python -m benchmarks.lens``: what the attention lens costs, and what it costs decoding.

1. **Lens latency** for a ``--context``-token context (default 2,048) on the model: ``LLM.attention_lens``
   at the last position, *cold* (the prefix cache reset: the whole context is prefilled) and *warm*
   (the context's blocks in the prefix cache, as for a chat the lens is opened on: one block is
   computed). The peer is HF transformers on the same GGUF in a process of its own, eager attention
   (the only way it exposes probabilities), one forward over the context with each layer's
   probabilities of the last position kept by a hook (``output_attentions=True`` would hold every
   layer's full ``[heads, T, T]`` matrix: 4.5 GB at 2,048 tokens on SmolLM2). Goal: warm under 1 s.
2. **Decode with the lens closed**: greedy decode tok/s of ``--streams`` concurrent requests (from the
   engine's step events), the engine as it is beside the same engine with its per-step records
   (``engine.provenance``) switched off, alternated ``--repeats`` times: the records are the only
   work a step gained; a lens never touches a step it does not ask for.

Results: ``benchmarks/results/lens.json`` (``benchmarks.results``), the load beside the numbers.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time

from engine import LLM, SamplingParams
from engine.config import FlagParser

from . import results

PEER = textwrap.dedent('''
    import json, os, sys, time
    sys.modules["torchcodec"] = None
    import torch, transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count())
    path, ids, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    d, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, attn_implementation="eager").eval()
    rows = []
    def keep(module, args, output):
        rows.append(output[1][0, :, -1, :].clone())
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(keep)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            rows.clear()
            start = time.perf_counter()
            model.model(torch.tensor([ids]), use_cache=False)
            times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": times, "layers": len(rows), "transformers": transformers.__version__}))
''')


def decode_rate(llm: LLM, streams: int, tokens: int, total: bool = False):
    """Decode tok/s over the steps where every request decodes (the engine's step events); with
    ``total``, also the seconds of every step of the run."""
    steps = []
    unsubscribe = llm.subscribe(lambda e: steps.append(e.data) if e.kind == "step" else None)
    try:
        prompts = [f"Write a long story about the number {i}." for i in range(streams)]
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    finally:
        unsubscribe()
    full = [s for s in steps if len(s["decode"]) == streams and not s["prefill"]]
    rate = sum(len(s["decode"]) for s in full) / sum(s["duration_s"] for s in full)
    return (rate, sum(s["duration_s"] for s in steps)) if total else rate


def main(argv=None) -> None:
    parser = FlagParser(prog="python -m benchmarks.lens", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--no-peer", action="store_true", help="skip transformers (it needs torch)")
    args = parser.parse_args(argv)
    started = results.start()
    from engine.loader.zoo import zoo_path
    from engine.provenance import ProvenanceRecorder

    llm = LLM(model=args.model, max_model_len=args.context + 64)
    tok = llm.get_tokenizer()
    text = "The block table maps every position of a sequence to a physical block of the KV cache. "
    ids = tok.encode(text * (args.context // 10 + 1))[: args.context]
    cold, warm, plain = [], [], []
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        cold.append(llm.attention_lens(ids, len(ids) - 1).seconds)
        warm.append(llm.attention_lens(ids, len(ids) - 1).seconds)
        start = time.perf_counter()                     # the same request, the same cache hits, no lens
        llm.generate({"prompt_token_ids": ids}, one)
        plain.append(time.perf_counter() - start)
    print(f"lens at {len(ids)} tokens: cold {statistics.median(cold):.3f} s, warm {statistics.median(warm):.3f} s, "
          f"the same request without the lens {statistics.median(plain):.3f} s (load {results.load_average()})",
          flush=True)

    on, off, shares = [], [], []
    record_step, record_token = ProvenanceRecorder.record_step, ProvenanceRecorder.record_token
    spent = [0.0]

    def timed_step(self, step, batch):
        start = time.perf_counter()
        record_step(self, step, batch)
        spent[0] += time.perf_counter() - start

    def timed_token(*a):
        start = time.perf_counter()
        record_token(*a)
        spent[0] += time.perf_counter() - start

    decode_rate(llm, args.streams, 8)                      # warm
    for _ in range(args.repeats):
        ProvenanceRecorder.record_step, ProvenanceRecorder.record_token = timed_step, staticmethod(timed_token)
        spent[0] = 0.0
        rate, busy = decode_rate(llm, args.streams, args.tokens, total=True)
        on.append(rate)
        shares.append(100 * spent[0] / busy)
        ProvenanceRecorder.record_step = lambda self, step, batch: None
        ProvenanceRecorder.record_token = staticmethod(lambda *a: None)
        try:
            off.append(decode_rate(llm, args.streams, args.tokens))
        finally:
            ProvenanceRecorder.record_step, ProvenanceRecorder.record_token = record_step, staticmethod(record_token)
    print(f"decode tok/s, {args.streams} streams: engine {statistics.median(on):.1f} (rounds {[round(x, 1) for x in on]}), "
          f"records off {statistics.median(off):.1f} ({[round(x, 1) for x in off]}); the records' share of the "
          f"steps' time {statistics.median(shares):.3f} %", flush=True)
    llm.shutdown()

    peer = None
    if not args.no_peer:
        out = subprocess.run([sys.executable, "-c", PEER, zoo_path(args.model), json.dumps(ids), str(args.repeats)],
                             capture_output=True, text=True, check=True)
        peer = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"transformers eager forward with the last row kept: {statistics.median(peer['seconds']):.3f} s", flush=True)
    peer_s = statistics.median(peer["seconds"]) if peer else None
    figures = [
        results.figure(f"lens latency, {len(ids)} tokens, warm (context in the prefix cache)", "s",
                       round(statistics.median(warm), 4), peer_s and round(peer_s, 4), "lower"),
        results.figure(f"lens latency, {len(ids)} tokens, cold (prefix cache reset)", "s",
                       round(statistics.median(cold), 4), peer_s and round(peer_s, 4), "lower"),
        results.figure(f"lens latency, {len(ids)} tokens, warm, beside the same request without the lens", "s",
                       round(statistics.median(warm), 4), round(statistics.median(plain), 4), "lower"),
        results.figure(f"decode tok/s, {args.streams} streams, with the per-step records beside without", "tok/s",
                       round(statistics.median(on), 2), round(statistics.median(off), 2), "higher"),
        results.figure("per-step records' share of the decode steps' time", "%",
                       round(statistics.median(shares), 4), None, "lower"),
    ]
    path = results.write_run(
        "lens", figures, ours="this engine", peer="transformers (eager, last row kept); decode: records off",
        title="Attention lens: latency and decode cost", started=started,
        settings={"model": args.model, "context": len(ids), "repeats": args.repeats, "streams": args.streams,
                  "tokens": args.tokens},
        targets=[{"target": "lens at 2,048 tokens under 1 s (warm)", "value": f"{statistics.median(warm):.3f} s",
                  "met": statistics.median(warm) < 1.0}],
        notes=["Peers: the lens latency beside transformers' eager forward over the same context (its only way to "
               "give attention probabilities), and beside the same one-token request without the lens; decode with "
               "the per-step records (engine.provenance) beside the same engine with them switched off."],
        raw={"cold_s": cold, "warm_s": warm, "plain_s": plain, "decode_on": on, "decode_off": off,
             "records_share_pct": shares, "peer": peer})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
