"""``python -m benchmarks.serving``: our OpenAI server beside llama.cpp's ``llama-server``, through HTTP.

In the manner of ``vllm bench serve`` (metric definitions: `benchmarks.serving_load`): the same
real chat prompts (the playground benchmark's chats and the engine benchmark's poem prompts,
under the playground's system prompt), streamed to ``/v1/chat/completions`` greedy with
``ignore_eos`` and a fixed ``max_tokens``, at concurrency 1, 4, 16 and 32 and at one seeded
Poisson request rate. Per server and setting: request throughput, output tok/s, TTFT p50/p99,
ITL p50/p99, errors.

Servers, each started and stopped by this benchmark, one at a time, and interleaved round by
round (the order reversed every other round, so that drift on a shared machine hits both):

* **ours** -- ``python -m engine.entrypoints.openai.api_server --model M --max-num-seqs 32``;
* **llama-server** -- llama.cpp's server (``scripts/build_llama_server.sh`` builds it) on the
  same GGUF: ``-t 2 -tb 2 --parallel 16 -c 32768 --cont-batching --metrics``;
* **in-process** -- ``engine.LLM.stream`` in this process at one stream, the same prompts: the
  HTTP overhead of our server at one stream is ``1 - (ours c=1 tok/s) / (in-process tok/s)``.

Each server must answer ``/health`` 200 and one warm-up request before it is measured. Every
number is the median over rounds of that round's value. Cores used by the server, the clients and
every other process are measured per setting; on a shared machine ``--quiet-below 0.3`` waits for
quiet before each setting and measures it again when others took more than that meanwhile (a
llama.cpp server with ``-t 2`` on 2 busy cores slows down far more than ours: its threads spin).
Results go to ``benchmarks/results/serving.json``, rendered into ``docs/benchmarks/serving.{md,png}``
(``--quick``: ``build/serving-quick.{json,md,png}``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.serving_load import RequestRecord, run_load, stream_chat, summarize

from engine.config import FlagParser

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / "build" / "llama-server" / "bin" / "llama-server"
SIDES = ("ours", "llama-server")


def conversations(n: int) -> list[list[dict]]:
    """``n`` chats cycling over the project's prompt sets, each under the playground's system prompt."""
    from benchmarks.fallback import TOPICS, poem_prompts
    from benchmarks.playground import PROMPTS
    from playground.app import DEFAULT_SYSTEM_PROMPT

    users = list(PROMPTS) + poem_prompts(len(TOPICS))
    return [[{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": users[i % len(users)]}]
            for i in range(n)]


def machine_busy_s() -> float:
    """CPU seconds spent by the whole machine, all cores (Linux /proc/stat, idle and iowait left out)."""
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Cores used over one setting by the server, by this process (the clients) and by everything else
    on the machine -- the last says whether the numbers were taken on a quiet machine."""

    def __init__(self, server_pid: int | None):
        from benchmarks.playground import cpu_s

        self.cpu_s, self.pid = cpu_s, server_pid
        self.start = (time.perf_counter(), machine_busy_s(), self._server(), time.process_time())

    def _server(self) -> float:
        return (self.cpu_s(self.pid) or 0.0) if self.pid else 0.0

    def cores(self) -> dict:
        t, busy, server, client = (b - a for a, b in zip(self.start, (time.perf_counter(), machine_busy_s(),
                                                                       self._server(), time.process_time())))
        return {"server_cores": server / t, "client_cores": client / t, "others_cores": (busy - server - client) / t}


def wait_quiet(below: float, timeout: float) -> float:
    """Wait until the machine's busy cores over 5 s drop below ``below`` (at most ``timeout`` s);
    the last reading. Nothing of this benchmark runs meanwhile, so the reading is everyone else."""
    t0 = time.perf_counter()
    while True:
        b0, c0 = machine_busy_s(), time.perf_counter()
        time.sleep(5.0)
        busy = (machine_busy_s() - b0) / (time.perf_counter() - c0)
        if busy < below or time.perf_counter() - t0 > timeout:
            if busy >= below:
                log(f"  the machine stayed busy ({busy:.2f} cores) for {timeout:.0f} s; measuring anyway")
            return busy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process this benchmark started, its log in ``log_path``."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: Path):
        self.name, self.argv, self.url = name, argv, f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {shlex.join(argv)}\n".encode())
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, cwd=ROOT)

    def wait_ready(self, timeout: float) -> float:
        """Poll ``/health`` until 200; the seconds it took. Raises if the process dies or times out."""
        import httpx

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before /health was 200:\n"
                                   + self.log_path.read_text(errors="replace")[-2000:])
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.name}: /health not 200 after {timeout:.0f} s (log: {self.log_path})")

    def model_id(self) -> str:
        import httpx

        return httpx.get(self.url + "/v1/models", timeout=10.0).json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)   # its own session: the server and its children
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def server_argv(side: str, args, port: int | str) -> list[str]:
    if side == "ours":
        return [sys.executable, "-m", "engine.entrypoints.openai.api_server", "--model", args.model,
                "--port", str(port), "--max-num-seqs", str(args.max_num_seqs), *shlex.split(args.ours_args)]
    from engine.loader.zoo import zoo_path

    t = str(args.threads)
    return [str(args.llama_server), "-m", zoo_path(args.model), "-t", t, "-tb", t, "--parallel", str(args.parallel),
            "-c", str(args.ctx), "--cont-batching", "--metrics", "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(args.llama_args)]


def settings(args) -> list[dict]:
    """Every measured setting: its label, its load and its requests."""
    out = [{"label": f"c={c}", "concurrency": c, "rate": None, "n": args.num_prompts or max(16, 2 * c)}
           for c in args.concurrency]
    if args.request_rate:
        out.append({"label": f"rate={args.request_rate:g}/s", "concurrency": None, "rate": args.request_rate,
                    "n": args.num_prompts or args.rate_prompts})
    return out


def measure_server(side: str, args, log_dir: Path, plan: list[dict], seed: int) -> dict:
    """Start one server, wait for it, warm it up, run every setting, stop it."""
    port = free_port()
    server = Server(side, server_argv(side, args, port), port, log_dir)
    try:
        ready_s = server.wait_ready(args.ready_timeout)
        model = server.model_id()
        url = server.url + "/v1/chat/completions"
        warm = asyncio.run(stream_chat_once(url, model, conversations(1)[0], args.max_tokens))
        if warm.error:
            raise RuntimeError(f"{side}: warm-up request failed: {warm.error}")
        out = {"ready_s": ready_s, "model_id": model}
        for s in plan:
            def once(s=s):
                chats, meter = conversations(s["n"]), CpuMeter(server.proc.pid)
                records, duration = asyncio.run(run_load(url, model, chats, args.max_tokens, s["concurrency"],
                                                         s["rate"], seed))
                return {**summarize(records, duration), **meter.cores()}

            out[s["label"]] = undisturbed(once, args, side, s["label"])
        return out
    finally:
        server.stop()


async def stream_chat_once(url: str, model: str, messages: list[dict], max_tokens: int) -> RequestRecord:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        return await stream_chat(client, url, model, messages, max_tokens)


def undisturbed(measure, args, side: str, label: str) -> dict:
    """``measure()`` once, or with ``--quiet-below``: after waiting for a quiet machine, and again (at
    most ``--retries`` times) while other processes used more cores than that meanwhile."""
    for attempt in range(args.retries + 1):
        if args.quiet_below:
            wait_quiet(args.quiet_below, args.quiet_timeout)
        result = {**measure(), "attempts": attempt + 1}
        log(f"  {side:12s} {label:10s} {brief(result)}")
        if not args.quiet_below or result["others_cores"] < args.quiet_below:
            break
        log(f"  {side:12s} {label:10s} disturbed: other processes used {result['others_cores']:.2f} cores")
    return result


def measure_in_process(llm, args, n: int) -> dict:
    """``LLM.stream`` at one stream over the same chats, recorded as the HTTP clients record."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    chats = conversations(n)
    records, t0, meter = [], time.perf_counter(), CpuMeter(None)
    for messages in chats:
        record = RequestRecord(start=time.perf_counter())
        for delta in llm.stream(messages, params):
            if delta.text:
                record.chunk_times.append(time.perf_counter())
            record.output_tokens += len(delta.token_ids)
            record.prompt_tokens = delta.num_prompt_tokens or record.prompt_tokens
            record.error = delta.error or ""
        records.append(record)
    cores = meter.cores()
    cores["server_cores"] = cores["client_cores"]     # the engine is this process
    return {**summarize(records, time.perf_counter() - t0), **cores}


def brief(m: dict) -> str:
    f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    return (f"{m['request_throughput']:.2f} req/s  {m['output_tok_s']:.1f} tok/s  TTFT p50/p99 {f(m['ttft_ms_p50'])}/"
            f"{f(m['ttft_ms_p99'])} ms  ITL p50/p99 {f(m['itl_ms_p50'])}/{f(m['itl_ms_p99'])} ms  "
            f"errors {m['errors']}  cores: server {m['server_cores']:.2f} client {m['client_cores']:.2f} "
            f"others {m['others_cores']:.2f}")


def over_rounds(rounds: list[dict]) -> dict:
    """One setting over rounds: each metric the median of its per-round values (one round disturbed
    by another process on a shared machine does not set the result), errors summed."""
    def med(key):
        values = [r[key] for r in rounds if r.get(key) is not None]
        return statistics.median(values) if values else None

    keys = ("request_throughput", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
            "tpot_ms_p50", "server_cores")
    return {"rounds": len(rounds), "errors": sum(r["errors"] for r in rounds),
            "requests": sum(r["completed"] + r["errors"] for r in rounds), **{k: med(k) for k in keys},
            "others_cores_max": max(r["others_cores"] for r in rounds)}


def log(msg: str) -> None:
    print(msg, flush=True)


def main(argv=None) -> int:
    from benchmarks.results import start
    from benchmarks.serving_report import write

    p = FlagParser(prog="python -m benchmarks.serving",
                   description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--model", default="smollm2-135m-instruct", help="zoo name (its GGUF goes to llama-server)")
    p.add_argument("--servers", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--no-in-process", dest="in_process", action="store_false",
                   help="skip the in-process LLM.stream at one stream (the HTTP overhead)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 32])
    p.add_argument("--request-rate", type=float, default=0.5, help="Poisson requests/s of the rate setting; 0: none")
    p.add_argument("--rate-prompts", type=int, default=32, help="requests sent at the request rate")
    p.add_argument("--num-prompts", type=int, default=0, help="requests per setting (0: 2 x concurrency, >= 16)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument("--max-num-seqs", type=int, default=32, help="our server's --max-num-seqs")
    p.add_argument("--ours-args", default="", help="more flags for our server")
    p.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help="the llama-server binary")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t/-tb")
    p.add_argument("--parallel", type=int, default=16, help="llama-server --parallel (slots)")
    p.add_argument("--ctx", type=int, default=32768, help="llama-server -c (shared by the slots)")
    p.add_argument("--llama-args", default="", help="more flags for llama-server")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--quiet-below", type=float, default=0.0,
                   help="before each setting, wait until other processes use fewer cores than this, and measure "
                        "the setting again when they used more meanwhile (0: don't)")
    p.add_argument("--retries", type=int, default=3, help="the most repeats of a disturbed setting")
    p.add_argument("--quiet-timeout", type=float, default=600.0, help="the longest such wait (s)")
    p.add_argument("--quick", action="store_true",
                   help="one round, concurrency 1 and 16, 48 tokens, 16 requests at the rate; writes build/serving-quick")
    p.add_argument("--from-json", type=Path, default=None,
                   help="no measuring: recompute the summary and the table from a results JSON's rounds")
    p.add_argument("--out", default=None, help="path stem of the results (default benchmarks/results/serving, rendered "
                                                "into docs/benchmarks/; elsewhere the .md and .png go beside the .json)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the running server on the way out
    if args.quick:
        args.rounds, args.concurrency, args.max_tokens, args.rate_prompts = 1, [1, 16], 48, 16
    out = Path(args.out or (ROOT / "build" / "serving-quick" if args.quick else ROOT / "benchmarks/results/serving"))
    if "llama-server" in args.servers and not args.llama_server.exists():
        p.error(f"no llama-server at {args.llama_server}: run scripts/build_llama_server.sh")
    log_dir = ROOT / "build" / "serving-logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    if args.from_json:
        return rewrite(args.from_json, out)
    started = start()
    plan = settings(args)
    sides = list(args.servers) + (["in-process"] if args.in_process and "ours" in args.servers else [])
    raw: dict[str, dict[str, list]] = {side: {} for side in sides}
    llm = None
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        for side in (sides if r % 2 == 0 else sides[::-1]):
            if side == "in-process":
                if llm is None:
                    from engine import LLM

                    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs)
                    log("")
                    measure_in_process(llm, args, 1)  # warm-up
                n = next((s["n"] for s in plan if s["concurrency"] == 1), 16)
                raw[side].setdefault("c=1", []).append(
                    undisturbed(lambda: measure_in_process(llm, args, n), args, side, "c=1"))
                continue
            result = measure_server(side, args, log_dir, plan, args.seed + r)
            for s in plan:
                raw[side].setdefault(s["label"], []).append(result[s["label"]])
            raw[side].setdefault("_ready_s", []).append(result["ready_s"])
    if llm is not None:
        llm.shutdown()

    summary = {side: {label: over_rounds(rounds) for label, rounds in by.items() if not label.startswith("_")}
               for side, by in raw.items()}
    path = write(out, args, plan, sides, raw, summary, {s: shown(shlex.join(server_argv(s, args, "PORT")))
                                                        for s in args.servers}, started=started)
    log("\n" + rendered(path).read_text())
    return 0


def shown(command: str) -> str:
    """A server's command line as a reader would type it: ``python``, paths inside the repository relative."""
    return command.replace(sys.executable, "python").replace(f"{ROOT}/", "")


def rendered(path: Path) -> Path:
    """The Markdown `benchmarks.results` rendered from the results file at ``path``."""
    from benchmarks import results

    return (results.DOCS if path.parent.resolve() == results.RESULTS.resolve() else path.parent) / f"{path.stem}.md"


def recorded_run(doc: dict) -> tuple[dict, dict, str | None]:
    """(the run's own fields, its date / machine / commit, llama-server's version) of a results
    file, in `benchmarks.results`' form or in the form written before it."""
    if "raw" in doc:
        env = {k: doc[k] for k in ("date", "machine", "commit", "uncommitted_changes", "versions") if k in doc}
        return doc["raw"], env, doc.get("settings", {}).get("llama-server")
    e = doc["environment"]
    m, v = e["machine"], e["versions"]
    env = {"date": e["date"], "commit": v["commit"],
           "machine": {"cpu": m["cpu"], "cores": m["cpus"], "load_start": [round(x, 2) for x in m["load_average"]],
                       "load_end": None, "python": v["python"]},
           "versions": {"paddlepaddle": v["paddle"], "numba": v["numba"], "numpy": v["numpy"]}}
    return doc, env, e.get("llama_server")


def rewrite(path: Path, out: Path) -> int:
    """The summary, targets and rendering of an earlier run, recomputed from its per-round values."""
    from benchmarks.serving_report import write

    doc = json.loads(path.read_text())
    run, env, llama_server = recorded_run(doc)
    args = argparse.Namespace(**run["args"])
    summary = {side: {label: over_rounds(rounds) for label, rounds in by.items() if not label.startswith("_")}
               for side, by in run["rounds"].items()}
    commands = {side: shown(cmd) for side, cmd in run["servers"].items()}
    written = write(out, args, run["settings"], run["sides"], run["rounds"], summary, commands, recorded=env,
                    command=doc["command"], llama_server=llama_server)
    log(rendered(written).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
