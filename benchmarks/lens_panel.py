"""``python -m benchmarks.lens_panel``: the attention lens's panel in the playground -- what a click
costs the visitor, and what the panel costs the chats decoding beside it.

The playground's own handlers on one engine (``Handlers``, ``LensPanel``: the page's events minus
HTTP), in this process:

1. **Click to lens** at a ``--context``-token conversation (default 2,048): ``LensPanel.lens`` on a
   reply's last token -- the engine's lens (its blocks in the prefix cache, as for a chat) and the
   panel's HTML (heat on every token, mass per block) -- beside ``LLM.attention_lens`` alone on the
   same tokens. Goal: under 1 s.
2. **Decode with the panel open vs closed**: ``--streams`` tabs each send a second message of their
   own conversation at once (``Handlers.send``, greedy, the same prompts every round so the same
   tokens), with every tab's lens panel *closed*, then *open* holding a lens of its first reply,
   alternated ``--repeats`` times (the order reversed every other round); and *open, clicking*: one tab clicks a token of its lens every
   ``--click-every`` s while the chats decode (each click is a lens pass: a request of its own that
   joins the decode steps). Decode tok/s from the engine's step events (the steps where every chat
   decodes, lens passes included). Goal: open = closed within noise.

Results: ``benchmarks/results/lens_panel.json`` (``benchmarks.results``), with the load beside.
"""

from __future__ import annotations

import statistics
import threading
import time

from engine import LLM, SamplingParams
from engine.config import FlagParser

from . import results

PROMPTS = ["Tell me about the ocean.", "Describe a forest at night.", "Explain how a bicycle works.",
           "Write about a city in the rain.", "Describe the moon.", "Tell me about trains."]
SYSTEM = "You are a concise, friendly assistant. Answer in a few sentences."


def click_to_lens(llm: LLM, panel, session_cls, context: int, repeats: int) -> tuple[list[float], list[float], int]:
    """Seconds from a click on the last token of a ``context``-token reply to the panel's HTML, and
    of the engine's lens alone on the same tokens."""
    from playground.chat import Reply, stream_reply

    tok = llm.get_tokenizer()
    text = "The block table maps every position of a sequence to a physical block of the KV cache. "
    session = session_cls()
    prompt = tok.encode(text * (context // 10 + 1))[: context - 8]
    user = session.tree.add_user(text)           # a long message, as the chat's handlers keep one
    node = session.tree.add_reply(user.node_id, Reply(request_id=session.new_request_id("chat")))
    for _ in stream_reply(llm, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0,
                                                                               ignore_eos=True), node.reply):
        pass
    ids = list(node.reply.prompt_token_ids) + node.reply.all_token_ids
    state = panel.state(session)
    state.open = True
    clicks, alone = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        html = panel.lens(session, node.reply.request_id, len(ids) - 1, None, None)[0]
        clicks.append(time.perf_counter() - start)
        assert "lz-blocks" in html, html[-300:]
        start = time.perf_counter()
        llm.attention_lens(ids, len(ids) - 1)
        alone.append(time.perf_counter() - start)
    return clicks, alone, len(ids)


def decode_round(llm: LLM, panel, session_cls, streams: int, tokens: int, mode: str, click_every: float) -> float:
    """One round: ``streams`` tabs, each with a short first turn, send their second message at once;
    decode tok/s over the steps where every chat decodes."""
    h = panel.h
    tabs = [session_cls() for _ in range(streams)]
    for tab, prompt in zip(tabs, PROMPTS):
        list(h.send(prompt, tab, SYSTEM, 0.0, 1.0, 0, 4, 0, 3, "chat"))
        if mode != "closed":
            panel.state(tab).open = True
            first = tab.tree.last_reply().reply
            panel.lens(tab, first.request_id, len(first.prompt_token_ids) + 1, None, None)
    steps, done = [], threading.Event()
    unsubscribe = llm.subscribe(lambda e: steps.append(e.data) if e.kind == "step" else None)

    def chat(tab):
        list(h.send("Now say more about it, in detail.", tab, SYSTEM, 0.0, 1.0, 0, tokens, 0, 3, "chat"))

    def clicking():
        first = tabs[0].tree.replies()[0].reply
        n, position = 0, len(first.prompt_token_ids)
        while not done.wait(click_every):
            n += 1
            panel.on_lens_token(tabs[0], None, None, type("Click", (), {"_data": {"position": position - n % 8}})())

    threads = [threading.Thread(target=chat, args=(t,)) for t in tabs]
    if mode == "clicking":
        threads.append(threading.Thread(target=clicking))
    try:
        for t in threads:
            t.start()
        for t in threads[:streams]:
            t.join()
    finally:
        done.set()
        for t in threads[streams:]:
            t.join()
        unsubscribe()
    full = [s for s in steps if len(s["decode"]) == streams]
    return sum(len(s["decode"]) for s in full) / sum(s["duration_s"] for s in full)


def main(argv=None) -> None:
    parser = FlagParser(prog="python -m benchmarks.lens_panel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--click-every", type=float, default=1.0)
    args = parser.parse_args(argv)
    started = results.start()
    from playground.chat import ChatSession
    from playground.handlers import Handlers, Limits
    from playground.lens_panel import LensPanel
    from playground.monitor import EngineMonitor

    llm = LLM(model=args.model, max_model_len=args.context + 64)
    monitor = EngineMonitor(llm, interval=0.15)
    panel = LensPanel(Handlers(llm, monitor, Limits(max_tokens=max(args.tokens, 8))))
    try:
        clicks, alone, n = click_to_lens(llm, panel, ChatSession, args.context, args.repeats)
        print(f"click to lens at {n} tokens: {statistics.median(clicks):.3f} s (the engine's lens alone "
              f"{statistics.median(alone):.3f} s; load {results.load_average()})", flush=True)
        decode_round(llm, panel, ChatSession, args.streams, 8, "closed", args.click_every)       # warm
        rates: dict[str, list[float]] = {"closed": [], "open": [], "clicking": []}
        for r in range(args.repeats):
            for mode in (list(rates) if r % 2 == 0 else list(rates)[::-1]):      # each mode first and last in turn
                rates[mode].append(decode_round(llm, panel, ChatSession, args.streams, args.tokens, mode,
                                                args.click_every))
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"decode tok/s, {args.streams} streams: panel closed {med['closed']:.1f} {rates['closed']}, open "
              f"{med['open']:.1f} {rates['open']}, open with a click every {args.click_every:g} s "
              f"{med['clicking']:.1f} {rates['clicking']} (load {results.load_average()})", flush=True)
    finally:
        monitor.close()
        llm.shutdown()
    figures = [
        results.figure(f"click to lens (engine lens + panel HTML), {n} tokens, beside the engine's lens alone", "s",
                       round(statistics.median(clicks), 4), round(statistics.median(alone), 4), "lower"),
        results.figure(f"decode tok/s, {args.streams} chats, lens panel open beside closed", "tok/s",
                       round(med["open"], 2), round(med["closed"], 2), "higher"),
        results.figure(f"decode tok/s, {args.streams} chats, a lens click every {args.click_every:g} s beside "
                       "the panel closed", "tok/s", round(med["clicking"], 2), round(med["closed"], 2), "higher"),
    ]
    path = results.write_run(
        "lens_panel", figures, ours="the playground's lens panel", peer="the engine's lens alone; the panel closed",
        title="Attention lens panel: click latency and decode cost", started=started,
        settings={"model": args.model, "context": n, "repeats": args.repeats, "streams": args.streams,
                  "tokens": args.tokens, "click_every_s": args.click_every},
        targets=[{"target": f"click to lens at {n} tokens under 1 s", "value": f"{statistics.median(clicks):.3f} s",
                  "met": statistics.median(clicks) < 1.0}],
        notes=["In process: the playground's handlers (Handlers.send, LensPanel) on one engine, no HTTP or browser. "
               "Open: every tab's panel open with a lens held; nothing of it runs until a click. Clicking: one tab "
               "asks for a lens every click_every seconds while the chats decode."],
        raw={"click_s": clicks, "engine_lens_s": alone, "decode": rates})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
