"""The browser side of ``python -m benchmarks.playground``: open tabs of the playground, driven over
HTTP in their own process (as a browser is), so their client work never runs under the engine's
interpreter lock. Started by the benchmark; reads one command per line on stdin:

``round MAX_TOKENS`` — every tab polls the block map's route every ``--interval`` s and the other
panels' route once a second, as the page's script does, and sends its
chat (``/chat``, greedy); when all chats have finished, one JSON line is printed: block maps
received per second per tab, and the polls' round-trip times.
``round MAX_TOKENS chats`` — the chats without the timers.
``ticks`` — the timers alone: ``{"ticking": n}`` at once, the JSON line after a ``stop`` line.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import threading
import time

import gradio_client
import httpx

from engine.config import FlagParser

SYSTEM = "You are a concise, friendly assistant. Answer in a few sentences."
LOGPROBS = 5


def chat_args(prompt: str, max_tokens: int) -> dict:
    """``/chat``'s inputs by their API names (greedy; the other sampling controls at their off values)."""
    return dict(message=prompt, system_prompt=SYSTEM, temperature=0.0, top_p=1.0, top_k=0, max_tokens=max_tokens,
                seed=0, logprobs=LOGPROBS, min_p=0.0, repetition_penalty=1.0, frequency_penalty=0.0,
                presence_penalty=0.0, stop_sequences="", mode="chat")


class Tab:
    """One browser tab: its own session, its chat, its refresh timer."""

    def __init__(self, url: str, prompt: str):
        self.client = gradio_client.Client(url, verbose=False)
        self.prompt = prompt
        config = self.client.config
        kv_map = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "kv-map")
        deps = config["dependencies"]
        # The page's load event draws the block map with the tab's token; the page's script then
        # polls the map's route and the other panels' route with it.
        map_load = next(i for i, d in enumerate(deps) if kv_map in d["outputs"])
        self.maps = 0
        self.tick_s: list[float] = []
        self.http = httpx.Client(timeout=60)
        self.run_url = f"{url.rstrip('/')}/gradio_api/run/predict"
        self.map_url = f"{url.rstrip('/')}/playground/map"
        self.panels_url = f"{url.rstrip('/')}/playground/panels"
        panel = self._load_event(map_load)[0]
        self.token, self.map_key = re.search(r'data-tab="([^"]+)".*?data-key="([^"]*)"', panel).groups()

    def _load_event(self, fn_index: int) -> list:
        """One queue-less event as the page sends it (the load event that draws the map): a POST to
        ``/run/predict`` (gradio_client would join the queue instead)."""
        body = {"data": [None], "fn_index": fn_index, "session_hash": self.client.session_hash,
                "event_data": None, "trigger_id": None}
        response = self.http.post(self.run_url, json=body)
        response.raise_for_status()
        return response.json()["data"]

    def poll_map(self) -> None:
        """The page's script asking the map's route for a newer map (204: none)."""
        response = self.http.get(self.map_url, params={"tab": self.token, "since": self.map_key})
        response.raise_for_status()
        if response.status_code == 200:
            self.maps += 1
            self.map_key = response.headers["X-Map-Key"]

    def poll_panels(self) -> None:
        """The page's script asking the panels' route for their contents."""
        response = self.http.get(self.panels_url, params={"tab": self.token})
        response.raise_for_status()
        response.json()

    def refresh_every(self, interval: float, stop: threading.Event) -> None:
        """The map's polls every ``interval`` s; the panels' once a second beside them, on their own
        (the page's two pollers are independent: a slow panels poll does not delay the map)."""
        panels = threading.Thread(target=self._panels_every, args=(1.0, stop))
        panels.start()
        while not stop.is_set():
            t0 = time.perf_counter()
            self.poll_map()
            self.tick_s.append(time.perf_counter() - t0)
            stop.wait(max(0.0, interval - (time.perf_counter() - t0)))
        panels.join()

    def _panels_every(self, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            self.poll_panels()
            stop.wait(max(0.0, interval - (time.perf_counter() - t0)))

    def new_conversation(self) -> None:
        """Clear: each round's chat starts a new conversation, as the engine-alone runs do (the same
        prompt and so the same tokens every round, not a history that grows round by round: a
        longer context to decode and a longer chat to send with every update)."""
        self.client.predict(api_name="/clear")

    def chat(self, max_tokens: int) -> None:
        self.client.predict(**chat_args(self.prompt, max_tokens), api_name="/chat")


def run_round(tabs: list[Tab], max_tokens: int | None, interval: float, ticks: bool = True) -> dict:
    """Timers (``ticks``) and chats (``max_tokens``, None: wait for a ``stop`` line instead)."""
    stop = threading.Event()
    if max_tokens is not None:
        for t in tabs:                  # before the round, so that its chats are sent together
            t.new_conversation()
    timers = [threading.Thread(target=t.refresh_every, args=(interval, stop)) for t in tabs if ticks]
    for t in timers:
        t.start()
    time.sleep(2 * interval)
    maps0 = [t.maps for t in tabs]                  # counted over the same time as ``elapsed``
    ticks0 = [len(t.tick_s) for t in tabs]
    t0 = time.perf_counter()
    if max_tokens is None:
        print(json.dumps({"ticking": len(tabs)}), flush=True)
        sys.stdin.readline()
    else:
        chats = [threading.Thread(target=t.chat, args=(max_tokens,)) for t in tabs]
        for t in chats:
            t.start()
        for t in chats:
            t.join()
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in timers:
        t.join()
    ticks = [s for t, n in zip(tabs, ticks0) for s in t.tick_s[n:]]
    return {"maps_per_s": statistics.median((t.maps - m) / elapsed for t, m in zip(tabs, maps0)),
            "tick_ms": statistics.median(ticks) * 1000 if ticks else None}


def main(argv: list[str] | None = None) -> None:
    parser = FlagParser(prog="python -m benchmarks.playground_tabs",
                        description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("url")
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--prompts", nargs="+", required=True, help="one chat per tab")
    parser.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority")
    parser.add_argument("--idle", action="store_true",
                        help="run at Linux's SCHED_IDLE: only on CPU time nothing else wants (browsers on "
                             "the visitors' own machines take none of the server's)")
    args = parser.parse_args(argv)
    os.nice(args.nice)
    if args.idle:            # before any thread starts: threads inherit the policy
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    tabs = [Tab(args.url, p) for p in args.prompts]
    print(json.dumps({"ready": len(tabs)}), flush=True)
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "round":
            result = run_round(tabs, int(rest[0]), args.interval, ticks=rest[1:] != ["chats"])
        elif command == "ticks":
            result = run_round(tabs, None, args.interval)
        else:
            raise SystemExit(f"unknown command {command!r}: round MAX_TOKENS [chats], ticks")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
