"""``python -m benchmarks.playground``: does the live UI slow generation down?

Runs the same greedy workload (``--requests`` concurrent streams of
``--max-tokens`` tokens each) with and without the playground's live-panel
loop, alternating the two ``--repeats`` times, and reports decode tokens/s.
The UI loop is what the app does for ``--tabs`` open browser tabs: an
``EngineMonitor`` subscribed to the engine (snapshots on events), and every
``--interval`` seconds per tab a render of the block map, the prefix-cache
panel, the engine panel, the engine timeline and a logprob view. Target: at
most 5 % slower, with the block map refreshed at least 4 times a second
(``map_refreshes_per_s``: new snapshots per second while streaming).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from engine import LLM, SamplingParams, add_engine_args, config_from_args

from playground import render
from playground.logprobs import token_records
from playground.monitor import EngineMonitor
from playground.timeline import timeline_html

PROMPTS = ["Tell me about the ocean.", "Describe a forest at night.", "Explain how a bicycle works.",
           "Write about a city in the rain.", "Describe the moon.", "Tell me about trains.",
           "Describe a mountain village.", "Explain what clouds are."]


def run_workload(llm, n_requests: int, max_tokens: int) -> float:
    """Stream ``n_requests`` requests at once; return decode tokens/s (all requests together)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    firsts, lasts, counts = [], [], []

    def one(prompt: str) -> None:
        n, first = 0, None
        for delta in llm.stream([{"role": "user", "content": prompt}], params):
            if delta.token_ids:
                n += len(delta.token_ids)
                first = first or time.perf_counter()
        firsts.append(first)
        lasts.append(time.perf_counter())
        counts.append(n)

    threads = [threading.Thread(target=one, args=(PROMPTS[i % len(PROMPTS)] + f" ({i})",))
               for i in range(n_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Decode phase: from the last request's first token to the last request's end.
    decode_tokens = sum(counts) - n_requests
    return decode_tokens / (max(lasts) - max(firsts))


class UILoop:
    """The app's live-panel work for ``tabs`` tabs, on a background thread."""

    def __init__(self, llm, tabs: int, interval: float, reply_tokens: int = 64):
        self.monitor = EngineMonitor(llm, interval=min(interval, 0.2))   # as build_app does
        self.tabs, self.interval = tabs, interval
        vocab = [" the", " sea", " is", " wide", ".", "\n"]
        lps = [{i: {"logprob": -0.5 - 0.1 * i, "rank": i + 1, "decoded_token": vocab[i % 6]} for i in range(5)}
               for _ in range(reply_tokens)]
        self.records = token_records([0] * reply_tokens, lps)
        self.renders = 0
        self.render_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        # Like the app's refresh handler: every ``interval`` each tab redraws its panels only when
        # the monitor has a new snapshot (or a new step), and its timeline once a second.
        seen = [None] * self.tabs
        timeline_at = [0.0] * self.tabs
        while not self._stop.is_set():
            t0 = time.perf_counter()
            for tab in range(self.tabs):
                key = (self.monitor.version, self.monitor.num_steps)
                if time.monotonic() - timeline_at[tab] >= 1.0:
                    timeline_html(self.monitor.timeline.series())
                    timeline_at[tab] = time.monotonic()
                if key == seen[tab]:
                    continue
                seen[tab] = key
                snap = self.monitor.snapshot()
                render.block_map_html(snap)
                render.prefix_cache_html(snap, [{"num_prompt_tokens": 40, "num_cached_tokens": 16}])
                render.engine_panel_html(snap, self.monitor.steps(120), {"ttft": 0.1, "decode_tps": 10.0})
                render.logprob_html(self.records)
                self.renders += 1
            self.render_s += time.perf_counter() - t0
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.monitor.close()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.playground", description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--requests", type=int, default=4, help="concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tabs", type=int, default=4, help="browser tabs the UI loop renders for")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between a tab's refreshes")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--check", action="store_true", help="exit 1 if the UI costs more than 5%%")
    args = parser.parse_args(argv)
    llm = LLM(**vars(config_from_args(args)))
    run_workload(llm, args.requests, 8)   # warm-up
    without, with_ui, per_render, ui_share, map_rate, step_rate = [], [], [], [], [], []

    def measure_with_ui() -> None:
        t0 = time.perf_counter()
        with UILoop(llm, args.tabs, args.interval) as ui:
            v0, s0, t1 = ui.monitor.version, ui.monitor.num_steps, time.perf_counter()
            with_ui.append(run_workload(llm, args.requests, args.max_tokens))
            map_rate.append((ui.monitor.version - v0) / (time.perf_counter() - t1))
            step_rate.append((ui.monitor.num_steps - s0) / (time.perf_counter() - t1))
        per_render.append(ui.render_s / max(ui.renders, 1))
        ui_share.append(ui.render_s / (time.perf_counter() - t0))

    for i in range(args.repeats):   # A B, B A, ...: slow drifts of the machine cancel out
        order = (lambda: without.append(run_workload(llm, args.requests, args.max_tokens)), measure_with_ui)
        for run in (order if i % 2 == 0 else order[::-1]):
            run()
    base, ui_tps = statistics.median(without), statistics.median(with_ui)
    result = {
        "model": llm.model_name, "model_impl": llm.model_impl, "requests": args.requests,
        "max_tokens": args.max_tokens, "tabs": args.tabs, "interval_s": args.interval,
        "decode_tok_s_without_ui": round(base, 2), "decode_tok_s_with_ui": round(ui_tps, 2),
        "slowdown_pct": round((1 - ui_tps / base) * 100, 1),
        # Each "with" run against the "without" run next to it: robust to a machine whose load drifts.
        "slowdown_pct_paired": round(statistics.median(1 - w / b for w, b in zip(with_ui, without)) * 100, 1),
        "render_ms_per_tab_refresh": round(statistics.median(per_render) * 1000, 2),
        # The map changes once per engine step: it can refresh min(steps/s, 1 / interval) times a second.
        "map_refreshes_per_s": round(statistics.median(map_rate), 1),
        "engine_steps_per_s": round(statistics.median(step_rate), 1),
        "ui_thread_busy_pct": round(statistics.median(ui_share) * 100, 2),
        "runs_without": [round(x, 2) for x in without], "runs_with": [round(x, 2) for x in with_ui],
    }
    for key, value in result.items():
        print(f"{key:>28}: {value}")
    if args.check and result["slowdown_pct_paired"] > 5:
        raise SystemExit(f"the UI loop slows decoding by {result['slowdown_pct_paired']}% (> 5%)")
    return result


if __name__ == "__main__":
    main()
