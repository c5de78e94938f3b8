"""``python -m benchmarks.kv_events``: what the KV event log costs decoding, and what an estimate costs.

1. **Decode with the event log** (``engine.kv_events``): greedy decode tok/s of ``--streams``
   concurrent requests (from the engine's step events), the engine as it is beside the same engine
   with ``KVEventLog.add`` switched off, alternated ``--repeats`` times in one process, and the
   log's share of the steps' time (``add`` timed inside the run). A decode step logs only when a
   request crosses into a new block.
2. **A run that preempts** (a ``--small-pool``-block KV cache, ``--streams`` x 2 requests): the
   events it logged and the engine's counters, and the log's share of that run's steps.
3. **The estimate** (``LLM.estimate_prefill``) of a ``--context``-token prompt whose blocks are in the
   prefix cache, beside sending the same prompt for one token (what the estimate saves asking).

Results: ``benchmarks/results/kv_events.json`` (``benchmarks.results``), the load beside the numbers.
"""

from __future__ import annotations

import statistics
import time

from engine import LLM, SamplingParams
from engine.config import FlagParser
from engine.kv_events import KVEventLog

from . import results
from .lens import decode_rate


def main(argv=None) -> None:
    parser = FlagParser(prog="python -m benchmarks.kv_events", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--small-pool", type=int, default=24, help="KV blocks of the run that preempts")
    args = parser.parse_args(argv)
    started = results.start()
    add = KVEventLog.add
    spent = [0.0]

    def timed_add(self, *a, **kw):
        start = time.perf_counter()
        add(self, *a, **kw)
        spent[0] += time.perf_counter() - start

    llm = LLM(model=args.model, max_model_len=args.context + 64)
    decode_rate(llm, args.streams, 8)                      # warm
    on, off, shares = [], [], []
    for _ in range(args.repeats):
        KVEventLog.add, spent[0] = timed_add, 0.0
        try:
            rate, busy = decode_rate(llm, args.streams, args.tokens, total=True)
        finally:
            KVEventLog.add = add
        on.append(rate)
        shares.append(100 * spent[0] / busy)
        KVEventLog.add = lambda self, *a, **kw: None
        try:
            off.append(decode_rate(llm, args.streams, args.tokens))
        finally:
            KVEventLog.add = add
    print(f"decode tok/s, {args.streams} streams: log on {statistics.median(on):.1f} ({[round(x, 1) for x in on]}), "
          f"log off {statistics.median(off):.1f} ({[round(x, 1) for x in off]}); the log's share of the steps' time "
          f"{statistics.median(shares):.4f} % (load {results.load_average()})", flush=True)

    tok = llm.get_tokenizer()
    text = "The prefix cache keeps every full block of a prompt under the hash of everything before it. "
    ids = tok.encode(text * (args.context // 10 + 1))[: args.context]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": ids}, one)           # its blocks in the prefix cache
    estimate, send = [], []
    for _ in range(max(5, args.repeats)):
        start = time.perf_counter()
        est = llm.estimate_prefill(ids)
        estimate.append(time.perf_counter() - start)
        start = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, one)[0]
        send.append(time.perf_counter() - start)
        assert out.num_cached_tokens == est.num_cached_tokens, (out.num_cached_tokens, est.num_cached_tokens)
    print(f"estimate of {len(ids)} tokens: {1000 * statistics.median(estimate):.2f} ms, sending them for one token "
          f"{1000 * statistics.median(send):.1f} ms ({est.num_cached_tokens} cached)", flush=True)
    from engine.model_runner import kv_block_bytes

    bs = llm.engine.config.block_size
    per_block = kv_block_bytes(bs, *llm.engine.runner.model.kv_layout(), llm.engine.dtype)
    llm.shutdown()

    small = LLM(model=args.model, kv_cache_memory=args.small_pool * per_block, max_model_len=args.small_pool * bs)
    steps = []
    unsubscribe = small.subscribe(lambda e: steps.append(e.data) if e.kind == "step" else None)
    KVEventLog.add, spent[0] = timed_add, 0.0
    try:
        prompts = [f"Question {i}: write a long story about a lighthouse keeper." for i in range(2 * args.streams)]
        small.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))
    finally:
        KVEventLog.add = add
        unsubscribe()
    log = small.kv_events()
    busy = sum(s["duration_s"] for s in steps)
    kinds = {k: sum(1 for e in log["events"] if e["kind"] == k) for k in ("allocate", "free", "evict", "preempt",
                                                                          "recompute")}
    preempt_share = 100 * spent[0] / busy
    print(f"small pool ({args.small_pool} blocks): {kinds}, counters {log['counters']}, the log's share "
          f"{preempt_share:.4f} %", flush=True)
    small.shutdown()

    figures = [
        results.figure(f"decode tok/s, {args.streams} streams, with the KV event log beside without", "tok/s",
                       round(statistics.median(on), 2), round(statistics.median(off), 2), "higher"),
        results.figure("KV event log's share of the decode steps' time", "%", round(statistics.median(shares), 5),
                       None, "lower"),
        results.figure(f"KV event log's share of the steps' time, {args.small_pool}-block pool that preempts", "%",
                       round(preempt_share, 5), None, "lower"),
        results.figure(f"estimate_prefill, {len(ids)} cached tokens, beside sending them for one token", "ms",
                       round(1000 * statistics.median(estimate), 3), round(1000 * statistics.median(send), 2), "lower"),
    ]
    path = results.write_run(
        "kv_events", figures, ours="this engine", peer="the same engine with the log off; sending the prompt",
        title="KV event log and prefill estimate: what they cost", started=started,
        settings={"model": args.model, "repeats": args.repeats, "streams": args.streams, "tokens": args.tokens,
                  "context": len(ids), "small_pool_blocks": args.small_pool},
        notes=["Decode with the KV event log (engine.kv_events) beside the same engine with KVEventLog.add switched "
               "off, alternated in one process; the estimate (a read-only walk of the prefix-cache index) beside "
               "sending the same prompt for one token. The run that preempts checks the log's counts against the "
               "engine's counters."],
        tables=[{"title": "the run that preempts", "columns": ["kind", "events"],
                 "rows": [[k, v] for k, v in kinds.items()] + [["engine preemptions", log["counters"]["preemptions"]],
                                                                ["engine evictions", log["counters"]["evictions"]]]}],
        raw={"decode_on": on, "decode_off": off, "log_share_pct": shares, "estimate_s": estimate, "send_s": send,
             "small_pool_kinds": kinds, "small_pool_counters": log["counters"]})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
