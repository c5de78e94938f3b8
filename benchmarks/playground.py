"""``python -m benchmarks.playground``: what the open playground costs the engine, and how soon
the first chat after start gets its first token.

Starts the app as ``python -m playground`` does (the engine loaded in a process of its own,
``LLMProcess``; ``--in-process`` keeps it in this one; warm-up, ``build_app``, ``launch``) and:

1. **First chat after start**: one chat through the app over HTTP (``gradio_client``, ``/chat``);
   the time from sending it to the first streamed token, and the engine's own TTFT.
2. **Decode cost of the open UI**, the same greedy chats (``--tabs`` at once, the same prompts,
   so the same tokens) run two ways, alternated ``--repeats`` times:
   *engine alone* — ``LLM.stream`` on each chat, nobody on the page (the app idles);
   *app* — each chat sent by its own tab through the app over HTTP, streaming the chat and the
   logprob view, while every tab refreshes its panels as the page's script does: the block map
   from the map's own route every ``--interval`` s (``playground.live_map``), the prefix-cache,
   engine, timeline and inspector panels from theirs once a second (``playground.live_panels``).
   The tabs run in their own process
   (``benchmarks.playground_tabs``), at nice 10 by default: on this machine they still take CPU
   from the engine, as browsers on the server's own machine would. ``--tabs-idle`` runs them at
   Linux's SCHED_IDLE instead (only CPU time the server leaves idle), closer to browsers on the
   visitors' own machines; the output says which was used. Each round the engine waits until
   every tab's chat has reached it (``held_until_streams``), so the chats decode together however
   little CPU the tabs' process gets once one of them decodes.
   Decode tok/s is read from the engine's step events in both (steps where every chat decodes),
   so client-side time never enters it. Goal: the app at most 5 % slower, with the map
   refreshed at least 4 times a second per tab (it changes once per monitor snapshot, so it can
   refresh at most min(engine steps/s, 1 / interval) times a second). The CPU use of this
   process (engine and app server) and of the tabs' process is printed beside, in cores, and
   this process's CPU seconds for the same chats in both modes (their difference is the app's
   server-side work, a number the machine's load moves less than tok/s; the engine's process
   counts as the server's), and, with ``--in-process``, how the engine thread spent its time
   between the measured steps: on a core, waiting for one (the UI's CPU share), waiting for the
   interpreter or engine lock.
3. ``--cold-start PORT`` instead of 1 and 2: only the first chat after ``python -m playground
   --port PORT``, started in its own process (in a fresh clone this includes compiling the
   kernels, which the CLI does before it prints the URL), then a first chat whose prompt is past
   the quantized matmuls' small-batch path (more than ``block_matmul.SMALL_T`` tokens).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.config import FlagParser, add_engine_args, config_from_args

# Paddle and Gradio are imported where they are used, after the arguments are parsed: --help and
# a wrong flag answer at once.

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me about the ocean.", "Describe a forest at night.", "Explain how a bicycle works.",
           "Write about a city in the rain.", "Describe the moon.", "Tell me about trains.",
           "Describe a mountain village.", "Explain what clouds are."]
LOGPROBS = 5


def _stat_cpu_s(path: str) -> float | None:
    """User + system CPU seconds from a Linux ``/proc/.../stat`` file; None if it cannot be read."""
    try:
        with open(path) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# The engine's own process (``LLMProcess``), once started: part of the server in every reading below.
engine_pid: int | None = None


def cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, all threads) of the server (this process and the engine's, if it
    has its own) or of ``pid`` (Linux /proc)."""
    if pid is None:
        return time.process_time() + (0.0 if engine_pid is None else _stat_cpu_s(f"/proc/{engine_pid}/stat") or 0.0)
    return _stat_cpu_s(f"/proc/{pid}/stat")


ENGINE_SIDE = "engine loop, ended threads, native"


def thread_group(name: str) -> str:
    """Which part of the server a thread of this process belongs to (by its Python name). A chat's
    reply in the app (its stream's thread, the thread handing its updates to Gradio) is the UI's;
    the engine alone's streams here are the benchmark's. The engine's loop comes and goes (it ends
    when the engine idles), as does each chat's thread, and threads Python did not start (Paddle's,
    BLAS's) have no name: with the time of ended threads, one group, ``ENGINE_SIDE``."""
    for prefix, group in (("engine-client", "engine client"), ("fused-decode", "decode team"), ("playground-monitor", "monitor"),
                          ("AnyIO worker", "gradio workers"), ("ThreadPoolExecutor", "gradio workers"),
                          ("stream-alone", ENGINE_SIDE), ("stream-", "chat replies"), ("chat-updates", "chat replies"),
                          ("engine-loop", ENGINE_SIDE), ("(native)", ENGINE_SIDE)):
        if name.startswith(prefix):
            return group
    return "uvicorn and other"


def thread_cpu_s() -> tuple[float, dict[int, tuple[str, float]]]:
    """This process's CPU seconds so far, and each live thread's: ``{tid: (group, seconds)}``
    (``thread_group`` of its Python name; threads Python did not start are "native")."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    threads = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        used = _stat_cpu_s(f"/proc/self/task/{tid}/stat")
        if used is not None:                               # else it ended meanwhile
            threads[tid] = (thread_group(names.get(tid, "(native)")), used)
    if engine_pid is not None:      # the engine's own process: one group
        for tid in map(int, os.listdir(f"/proc/{engine_pid}/task")):
            used = _stat_cpu_s(f"/proc/{engine_pid}/task/{tid}/stat")
            if used is not None:
                threads[-tid] = ("engine process", used)
    return cpu_s(), threads


def cpu_delta(before: tuple, after: tuple) -> dict[str, float]:
    """CPU seconds by thread group between two ``thread_cpu_s`` readings. A thread that ended in
    between (the engine's loop stops when idle; each chat's stream has its own) took its time with
    it: what the process spent beyond the live threads' sum is put under ``ENGINE_SIDE``."""
    total = after[0] - before[0]
    out: dict[str, float] = {}
    for tid, (group, used) in after[1].items():
        old = before[1].get(tid)
        out[group] = out.get(group, 0.0) + used - (old[1] if old and old[0] == group else 0.0)
    out[ENGINE_SIDE] = out.get(ENGINE_SIDE, 0.0) + total - sum(out.values())
    return {g: round(v, 3) for g, v in out.items()}


def _run_queue_s() -> float | None:
    """Seconds this thread has waited, runnable, for a core (Linux ``/proc/thread-self/schedstat``)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


class DecodeMeter:
    """Decode tokens/s from the engine's step events: steps where ``n`` requests decode together.

    The events are delivered on the engine's thread, so each one also reads that thread's CPU
    time and run-queue wait: between two steps of the measured stretch, its time splits into on
    a core, waiting for a core (CPU share), and the rest -- waiting for the interpreter lock or
    the engine lock, the only other things a busy engine thread waits for (``waits``)."""

    def __init__(self, llm, n: int):
        from engine import LLM

        self.n, self.steps, self._clocks = n, [], []
        self._on_engine_thread = isinstance(llm, LLM)   # an LLMProcess delivers events on its own thread
        self._unsubscribe = llm.subscribe(self._on_event)

    def _on_event(self, event) -> None:
        if event.kind == "step":
            self.steps.append((event.time, len(event.data["decode"]), bool(event.data["prefill"])))
            self._clocks.append((threading.get_ident(), time.perf_counter(), time.thread_time(), _run_queue_s())
                                if self._on_engine_thread else (None, 0.0, 0.0, None))

    def stop(self) -> float:
        self._unsubscribe()
        full = [(t, d) for t, d, prefill in self.steps if d == self.n and not prefill]
        if len(full) < 3:
            raise RuntimeError(f"only {len(full)} steps decoded all {self.n} chats together: raise --max-tokens "
                               "(with --tabs-idle on a busy machine: the tabs' process got too little CPU to "
                               "send its chats at once; measure that mode on a quiet machine)")
        return sum(d for _, d in full[1:]) / (full[-1][0] - full[0][0])

    @property
    def waits(self) -> dict[str, float] | None:
        """Shares of the engine thread's time between consecutive measured steps: ``on_cpu``,
        ``core`` (runnable, waiting for a core), ``locks`` (the rest); None without schedstat."""
        wall = cpu = queue = 0.0
        marks = [(s, c) for s, c in zip(self.steps, self._clocks) if s[1] == self.n and not s[2]]
        for (_, a), (_, b) in zip(marks, marks[1:]):
            if a[0] != b[0] or a[3] is None or b[3] is None:
                continue
            wall, cpu, queue = wall + b[1] - a[1], cpu + b[2] - a[2], queue + b[3] - a[3]
        if wall <= 0:
            return None
        return {"on_cpu": round(cpu / wall, 3), "core": round(queue / wall, 3),
                "locks": round(max(0.0, wall - cpu - queue) / wall, 3)}

    @property
    def steps_per_s(self) -> float:
        return (len(self.steps) - 1) / (self.steps[-1][0] - self.steps[0][0]) if len(self.steps) > 1 else 0.0


def chat_args(prompt: str, max_tokens: int) -> dict:
    """``/chat``'s inputs by their API names (greedy; the sampling controls the page adds later keep
    their off values)."""
    from playground.app import DEFAULT_SYSTEM_PROMPT

    return dict(message=prompt, system_prompt=DEFAULT_SYSTEM_PROMPT, temperature=0.0, top_p=1.0, top_k=0,
                max_tokens=max_tokens, seed=0, logprobs=LOGPROBS, min_p=0.0, repetition_penalty=1.0,
                frequency_penalty=0.0, presence_penalty=0.0, stop_sequences="", mode="chat")


def chat_messages(prompt: str) -> list[dict]:
    """A chat's first turn as the app sends it to the engine (its default system prompt)."""
    from playground.app import DEFAULT_SYSTEM_PROMPT

    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": prompt}]


def engine_alone(llm, prompts: list[str], max_tokens: int, cores: list | None = None) -> float:
    """The chats straight through ``LLM.stream`` (the app idles); decode tok/s."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=0, logprobs=LOGPROBS)
    meter = DecodeMeter(llm, len(prompts))
    threads0, cpu0, t0 = thread_cpu_s(), cpu_s(), time.perf_counter()

    def one(prompt: str) -> None:
        for _ in llm.stream(chat_messages(prompt), params):
            pass

    threads = [threading.Thread(target=one, args=(p,), name=f"stream-alone-{i}") for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tps = meter.stop()
    if cores is not None:
        cores.append({"cores": (cpu_s() - cpu0) / (time.perf_counter() - t0), "cpu_s": cpu_s() - cpu0,
                      "by_thread": cpu_delta(threads0, thread_cpu_s()), "waits": meter.waits})
    return tps


@contextlib.contextmanager
def held_until_streams(llm, n: int, timeout: float = 30.0):
    """Hold the engine (``paused``) from the ``with`` body until ``n`` new chat streams of the app
    (``stream-*`` threads, which submit their request first thing) are waiting for it, so the
    tabs' chats decode together however little CPU the tabs' process gets once one chat decodes
    (at SCHED_IDLE, nothing while the engine is busy). Released anyway after ``timeout`` s."""
    before = {t.ident for t in threading.enumerate()}
    with llm.paused():
        yield
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and sum(
                t.name.startswith("stream-") and t.ident not in before for t in threading.enumerate()) < n:
            time.sleep(0.005)


class Tabs:
    """The open tabs, in their own process (``benchmarks.playground_tabs``)."""

    def __init__(self, url: str, prompts: list[str], interval: float, nice: int, idle: bool = False):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.playground_tabs", url, "--interval", str(interval),
             "--nice", str(nice), *(["--idle"] if idle else []), "--prompts", *prompts],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self._read()                                         # {"ready": n}

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the tabs' process exited ({self.proc.wait()})")
        return json.loads(line)

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def round(self, llm, n: int, max_tokens: int, ticks: bool = True) -> dict:
        """Every tab sends its chat through the app (and refreshes, with ``ticks``); decode tok/s
        from the engine's steps meanwhile."""
        meter = DecodeMeter(llm, n)
        threads0, cpu0, tabs0, t0 = thread_cpu_s(), cpu_s(), cpu_s(self.proc.pid), time.perf_counter()
        with held_until_streams(llm, n):
            self._send(f"round {max_tokens}" + ("" if ticks else " chats"))
        result = self._read()
        wall = time.perf_counter() - t0
        tabs1 = cpu_s(self.proc.pid)
        return {**result, "tps": meter.stop(), "steps_per_s": meter.steps_per_s, "waits": meter.waits,
                "server_cores": (cpu_s() - cpu0) / wall, "server_cpu_s": cpu_s() - cpu0,
                "by_thread": cpu_delta(threads0, thread_cpu_s()),
                "tabs_cores": None if tabs0 is None or tabs1 is None else (tabs1 - tabs0) / wall}

    def ticking(self, llm, prompts: list[str], max_tokens: int) -> dict:
        """The chats straight through the engine while every tab refreshes."""
        self._send("ticks")
        self._read()                                         # {"ticking": n}
        tps = engine_alone(llm, prompts, max_tokens)
        self._send("stop")
        return {**self._read(), "tps": tps}

    def idle(self, seconds: float) -> dict:
        """The tabs open and refreshing, nobody chatting: this process's CPU use (cores), the
        server side of the timers alone."""
        self._send("ticks")
        self._read()                                         # {"ticking": n}
        cpu0, t0 = cpu_s(), time.perf_counter()
        time.sleep(seconds)
        cores = (cpu_s() - cpu0) / (time.perf_counter() - t0)
        self._send("stop")
        return {**self._read(), "server_cores": cores}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def ui_cpu_by_kind(llm, tabs: "Tabs", prompts: list[str], max_tokens: int) -> dict[str, float]:
    """Cores the UI's threads (``_ui_cpu``: Gradio's event loop and workers, chat replies, the monitor) use for
    each kind of page work, with the engine decoding the tabs' chats: CPU time is what the open
    page takes from the decode, and unlike tok/s on a shared machine it hardly moves between runs."""
    from engine import SamplingParams

    def cores(work) -> dict[str, float]:
        before, t0 = thread_cpu_s(), time.perf_counter()
        work()
        by_group = cpu_delta(before, thread_cpu_s())
        seconds = time.perf_counter() - t0
        return {"UI": _ui_cpu(by_group) / seconds, **{g: v / seconds for g, v in sorted(by_group.items())}}

    stop = threading.Event()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=LOGPROBS)

    def chat_forever(prompt: str) -> None:
        while not stop.is_set():
            for _ in llm.stream(chat_messages(prompt), params):
                if stop.is_set():
                    break

    streams = [threading.Thread(target=chat_forever, args=(p,), name=f"stream-alone-{i}")
               for i, p in enumerate(prompts)]
    for t in streams:
        t.start()
    time.sleep(1.0)
    try:
        result = {"engine decoding, no page": cores(lambda: time.sleep(4.0)),
                  "engine decoding, the tabs' timers (map + panels)": cores(lambda: tabs.idle(8.0))}
    finally:
        stop.set()
        for t in streams:
            t.join()
    result["the tabs' chats through the app"] = cores(lambda: tabs.round(llm, len(prompts), max_tokens, ticks=False))
    result["the tabs' chats and timers"] = cores(lambda: tabs.round(llm, len(prompts), max_tokens))
    return result


LONG_MESSAGE = ("Here is a short story I am writing. A lighthouse keeper on a small northern island keeps a log "
                "of every ship that passes, the weather, and the birds that rest on the rail of the gallery. One "
                "winter night the lamp fails and a ship he cannot see answers his signal. What happens next?")


def first_chat(url: str, message: str = "What is the capital of France?") -> dict:
    """A chat as a visitor sends it (by default the first after start): time to the first streamed token."""
    import gradio_client

    client = gradio_client.Client(url, verbose=False)
    t0 = time.perf_counter()
    job = client.submit(**chat_args(message, 16), api_name="/chat")
    first = None
    for update in job:
        text = update[0][-1]["content"] if update[0] else ""
        text = text if isinstance(text, str) else "".join(p.get("text", "") for p in text)
        if first is None and text.split('\n\n<div class="pg-meta"')[0].rstrip("▌"):
            first = time.perf_counter() - t0
    meta = job.result()[0][-1]["content"]
    meta = meta if isinstance(meta, str) else "".join(p.get("text", "") for p in meta)
    engine_ttft = re.search(r"TTFT (\d+) ms", meta)
    return {"client_s": first, "engine_ms": int(engine_ttft.group(1)) if engine_ttft else None}


def cold_start(port: int, engine_argv: list[str]) -> dict:
    """``python -m playground`` as a visitor's first use finds it: the CLI started in its own process
    (in a fresh clone, with no compiled kernels in ``__pycache__``, it compiles them before it prints
    the URL), then the first chat through HTTP. Seconds from the command to "Ready.", and the first
    chat's first token."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "playground", "--port", str(port), *engine_argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("Ready."):
                break
        else:
            raise RuntimeError("python -m playground exited before it was ready:\n" + "\n".join(lines[-20:]))
        ready = time.perf_counter() - t0
        first = first_chat(f"http://127.0.0.1:{port}/")
        long = first_chat(f"http://127.0.0.1:{port}/", LONG_MESSAGE)   # a prompt past the small-matmul path
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"command_to_ready_s": round(ready, 1), "first_chat_first_token_s": round(first["client_s"], 3),
            "first_chat_engine_ttft_ms": first["engine_ms"],
            "first_long_chat_first_token_s": round(long["client_s"], 3), "first_long_chat_engine_ttft_ms": long["engine_ms"],
            "start_log": lines}


def _ui_cpu(by_thread: dict[str, float]) -> float:
    return sum(v for g, v in by_thread.items() if g in ("uvicorn and other", "gradio workers", "chat replies", "monitor"))


def _by_thread(runs: list[dict[str, float]]) -> dict[str, float]:
    groups = sorted({g for r in runs for g in r})
    return {g: round(statistics.median(r.get(g, 0.0) for r in runs), 2) for g in groups}


def _median_shares(runs: list) -> dict | None:
    runs = [r for r in runs if r]
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]} if runs else None


def main(argv: list[str] | None = None) -> dict:
    parser = FlagParser(prog="python -m benchmarks.playground",
                        description=__doc__.splitlines()[0].replace("``", ""))
    add_engine_args(parser)
    parser.add_argument("--tabs", type=int, default=4, help="open tabs, each streaming one chat")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--interval", type=float, default=0.2,
                        help="the page's block-map refresh (s), as build_app's refresh_every")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-warm-up", action="store_true", help="start without the CLI's warm-up")
    parser.add_argument("--tabs-nice", type=int, default=10,
                        help="CPU priority of the tabs' process (a browser's work is not the server's)")
    parser.add_argument("--tabs-idle", action="store_true",
                        help="run the tabs' process at SCHED_IDLE instead of nice --tabs-nice: the stand-in "
                             "browsers then get only CPU the server leaves idle, as browsers on the visitors' "
                             "own machines take none of it; the default has them compete for the server's "
                             "cores, as browsers on the server's machine would")
    parser.add_argument("--split", action="store_true",
                        help="also measure the refresh timers alone and the chats through the app alone")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run, in seconds (default: the app's own setting)")
    parser.add_argument("--ui-cpu", action="store_true",
                        help="instead of tok/s, the cores the UI's threads use for each kind of page work "
                             "(median of --repeats rounds)")
    parser.add_argument("--in-process", action="store_true",
                        help="the engine in the app's process (python -m playground --in-process); by default "
                             "it runs in its own, as python -m playground runs it")
    parser.add_argument("--check", action="store_true", help="exit 1 if the app costs more than 5%%")
    parser.add_argument("--cold-start", type=int, metavar="PORT", default=None,
                        help="only measure the first chat after `python -m playground --port PORT` (run it in "
                             "a fresh clone for the first chat after an install: the kernels compile at start)")
    args = parser.parse_args(argv)
    if args.cold_start is not None:
        engine_argv = list(argv if argv is not None else sys.argv[1:])
        at = next(i for i, a in enumerate(engine_argv) if a.startswith("--cold-start"))
        del engine_argv[at:at + (1 if "=" in engine_argv[at] else 2)]     # the rest goes to the CLI
        result = cold_start(args.cold_start, engine_argv)
        for line in result.pop("start_log"):
            print(f"  | {line}")
        for key, value in result.items():
            print(f"{key:>30}: {value}")
        return result

    from engine import LLM, LLMProcess
    from playground.__main__ import _warm_up
    from playground.app import build_app, launch

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    t0 = time.perf_counter()
    global engine_pid
    llm = (LLM if args.in_process else LLMProcess)(**vars(config_from_args(args)))
    engine_pid = None if args.in_process else llm.pid
    if not args.no_warm_up:
        _warm_up(llm)
    demo = build_app(llm, refresh_every=args.interval)
    _, url, _ = launch(demo, prevent_thread_lock=True, quiet=True)
    ready_s = time.perf_counter() - t0
    try:
        first = first_chat(url)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.tabs)]
        tabs = Tabs(url, prompts, args.interval, args.tabs_nice, idle=args.tabs_idle)
        if args.ui_cpu:
            runs = [ui_cpu_by_kind(llm, tabs, prompts, 2 * args.max_tokens) for _ in range(args.repeats)]
            tabs.close()
            result = {k: {g: round(statistics.median(r[k].get(g, 0.0) for r in runs), 3) for g in runs[0][k]}
                      for k in runs[0]}
            print("cores by thread group (UI: Gradio's event loop and workers, chat replies, the monitor), 2-core machine:")
            groups = list(next(iter(result.values())))
            print(f"{'':>50} | " + " | ".join(groups))
            for key, value in result.items():
                print(f"{key:>50} | " + " | ".join(f"{value.get(g, 0.0):.3f}" for g in groups))
            return result
        engine_alone(llm, prompts, args.max_tokens)                       # both paths once, unmeasured
        tabs.round(llm, len(prompts), args.max_tokens)
        idle_cpu0 = cpu_s()
        time.sleep(3.0)
        idle_alone = (cpu_s() - idle_cpu0) / 3.0                            # nobody on the page
        idle_tabs = tabs.idle(3.0)
        alone, app, ticks_only, chats_only, alone_cores = [], [], [], [], []
        for i in range(args.repeats):   # A B, B A, ...: slow drifts of the machine cancel out
            runs = [lambda: alone.append(engine_alone(llm, prompts, args.max_tokens, alone_cores)),
                    lambda: app.append(tabs.round(llm, len(prompts), args.max_tokens))]
            if args.split:
                runs += [lambda: ticks_only.append(tabs.ticking(llm, prompts, args.max_tokens)),
                         lambda: chats_only.append(tabs.round(llm, len(prompts), args.max_tokens, ticks=False))]
            for run in runs if i % 2 == 0 else runs[::-1]:
                run()
        tabs.close()
    finally:
        demo.close()
        demo.playground_monitor.close()
        llm.shutdown()
    base = statistics.median(alone)
    with_app = statistics.median(a["tps"] for a in app)
    result = {
        "model": llm.model_name, "model_impl": llm.model_impl, "tabs": args.tabs, "max_tokens": args.max_tokens,
        "refresh_interval_s": args.interval, "warm_up": not args.no_warm_up,
        # How the stand-in browsers share this machine's cores with the server: printed, since it
        # moves the result (SCHED_IDLE: they get only what the server leaves idle).
        "tabs_process_priority": "SCHED_IDLE (--tabs-idle)" if args.tabs_idle else f"nice {args.tabs_nice}",
        "engine_runs_in": "the app's process (--in-process)" if args.in_process else "its own process",
        "switch_interval_ms": round(sys.getswitchinterval() * 1000, 3),
        "start_to_ready_s": round(ready_s, 1),
        "first_chat_first_token_s": round(first["client_s"], 3) if first["client_s"] is not None else None,
        "first_chat_engine_ttft_ms": first["engine_ms"],
        "decode_tok_s_engine_alone": round(base, 2),
        "decode_tok_s_app_streaming": round(with_app, 2),
        "slowdown_pct": round((1 - with_app / base) * 100, 1),
        # Each app run against the engine-alone run next to it: robust to a machine whose load drifts.
        "slowdown_pct_paired": round(statistics.median(1 - a["tps"] / b for a, b in zip(app, alone)) * 100, 1),
        "map_refreshes_per_s_per_tab": round(statistics.median(a["maps_per_s"] for a in app), 2),
        "engine_steps_per_s": round(statistics.median(a["steps_per_s"] for a in app), 2),
        # CPU use during the runs, in cores: this process (engine + app server) and the tabs' process.
        "server_cores_engine_alone": round(statistics.median(c["cores"] for c in alone_cores), 2),
        "server_cores_app": round(statistics.median(a["server_cores"] for a in app), 2),
        # CPU seconds this process spent on the same chats: the difference is what the app's
        # server side costs (load-independent, unlike tok/s on a shared machine).
        "server_cpu_s_engine_alone": round(statistics.median(c["cpu_s"] for c in alone_cores), 2),
        "server_cpu_s_app": round(statistics.median(a["server_cpu_s"] for a in app), 2),
        # The same CPU seconds by the threads that spent them (medians over the runs): what the app's
        # server side is made of, beside the engine's own threads.
        "server_cpu_s_by_thread_engine_alone": _by_thread([c["by_thread"] for c in alone_cores]),
        "server_cpu_s_by_thread_app": _by_thread([a["by_thread"] for a in app]),
        # The UI's own threads (Gradio's event loop and workers, chat replies, the monitor), app minus engine alone:
        # unlike the totals above, without the engine's extra steps when the tabs' chats arrive apart.
        "ui_threads_cpu_s_app_minus_alone": round(statistics.median(
            _ui_cpu(a["by_thread"]) - _ui_cpu(c["by_thread"]) for a, c in zip(app, alone_cores)), 2),
        # The engine thread's time between measured steps: on a core, waiting for one (the UI's
        # CPU share), waiting for the interpreter or engine lock (medians over the runs).
        "engine_thread_time_engine_alone": _median_shares([c["waits"] for c in alone_cores]),
        "engine_thread_time_app": _median_shares([a["waits"] for a in app]),
        # The open tabs' timers with the engine idle: this process's CPU use without and with them.
        "server_cores_idle_no_tabs": round(idle_alone, 3),
        "server_cores_idle_tabs_refreshing": round(idle_tabs["server_cores"], 3),
        "tabs_process_cores": (round(statistics.median(a["tabs_cores"] for a in app), 2)
                               if all(a["tabs_cores"] is not None for a in app) else None),
        "refresh_round_trip_ms": round(statistics.median(a["tick_ms"] for a in app), 1),
        **({"decode_tok_s_refresh_timers_only": round(statistics.median(a["tps"] for a in ticks_only), 2),
            "decode_tok_s_chats_through_app_only": round(statistics.median(a["tps"] for a in chats_only), 2)}
           if args.split else {}),
        "runs_engine_alone": [round(x, 2) for x in alone],
        "runs_app": [round(a["tps"], 2) for a in app],
    }
    wanted = min(1 / args.interval, result["engine_steps_per_s"])
    if args.tabs_idle and result["map_refreshes_per_s_per_tab"] < min(4.0, 0.8 * wanted):
        # SCHED_IDLE tabs on a busy machine poll less than a page does: the app did less work.
        result["warning"] = (f"the SCHED_IDLE tabs refreshed the map {result['map_refreshes_per_s_per_tab']} "
                             f"times a second (goal 4, at most {wanted:.1f}): starved of CPU, they asked the app for less "
                             "than open pages would; this run understates the app's cost")
    for key, value in result.items():
        print(f"{key:>30}: {value}")
    if args.check and "warning" in result:
        raise SystemExit(f"not a valid measurement: {result['warning']}")
    if args.check and result["slowdown_pct_paired"] > 5:
        raise SystemExit(f"the open app slows decoding by {result['slowdown_pct_paired']}% (> 5%)")
    return result


def write(result: dict, started: dict) -> None:
    """The run through `benchmarks.results` (``playground.json``; ``--cold-start``: ``playground-cold-start``,
    ``--ui-cpu``: ``playground-ui-cpu``): the app beside the engine alone where both were measured."""
    from . import results

    if "command_to_ready_s" in result:
        figures = [results.figure(k, "ms" if k.endswith("_ms") else "s", v, better="lower")
                   for k, v in result.items() if isinstance(v, (int, float))]
        return results.write_run("playground-cold-start", figures, started=started,
                                 title="Playground: the command to its URL and the first chats")
    if all(isinstance(v, dict) for v in result.values()):
        figures = [results.figure(f"{kind}: {group}", "cores", v, better="lower")
                   for kind, by in result.items() for group, v in by.items()]
        return results.write_run("playground-ui-cpu", figures, started=started,
                                 title="Playground: the cores the UI's threads use for each kind of page work")
    f = results.figure
    figures = [f("decode with the app open and streaming (peer: the engine alone)", "tok/s",
                 result["decode_tok_s_app_streaming"], result["decode_tok_s_engine_alone"]),
               f("slowdown, each app round against the engine-alone round beside it", "%",
                 result["slowdown_pct_paired"], better="lower"),
               f("block-map refreshes a second per tab", "1/s", result["map_refreshes_per_s_per_tab"]),
               f("server CPU for the same chats (peer: the engine alone)", "CPU s", result["server_cpu_s_app"],
                 result["server_cpu_s_engine_alone"], better="lower"),
               f("the UI's threads, app minus engine alone", "CPU s", result["ui_threads_cpu_s_app_minus_alone"],
                 better="lower"),
               f("refresh round trip", "ms", result["refresh_round_trip_ms"], better="lower"),
               f("start to ready", "s", result["start_to_ready_s"], better="lower"),
               f("first chat: first token", "s", result["first_chat_first_token_s"], better="lower")]
    results.write_run("playground", figures, ours="app open", peer="engine alone", started=started,
                      title="Playground: decoding with the page open beside the engine alone",
                      targets=[{"target": "app at most 5% slower", "value": f"{result['slowdown_pct_paired']}%",
                                "met": result["slowdown_pct_paired"] <= 5},
                               {"target": "block map refreshed at least 4 times a second per tab",
                                "value": str(result["map_refreshes_per_s_per_tab"]),
                                "met": result["map_refreshes_per_s_per_tab"] >= 4}],
                      settings={k: result[k] for k in ("model", "tabs", "max_tokens", "refresh_interval_s",
                                                       "tabs_process_priority", "engine_runs_in")},
                      raw=result)


if __name__ == "__main__":
    from .results import start

    _started = start()
    write(main(), _started)
