"""Test files that run in processes beside the suite, one after another, on the second core.

The suite is mostly one process working one test at a time; some files do not need to share it:

* ``SIMULATOR_FILES`` re-run themselves under ``NUMBA_ENABLE_CUDASIM=1`` (which must be set
  before ``numba.cuda`` is first imported); each has one outer test that relays that run's
  output as it comes (`relay_cudasim_run`).
* ``BESIDE_FILES`` run in one plain pytest process beside this one; here, each of their
  tests waits for that process's report of the same test and passes, fails or skips as it did
  there (`BesideItem`), so every test keeps its id and outcome.

The runs start at the end of collection in two queues (`collection_modifyitems`), each one
run after another, at a lower scheduling priority than the suite's process (`yielding`): the
suite never waits for them while it has work of its own, and they take the second core and
whatever the suite leaves idle (its tests wait on servers, browsers and paced engines for
much of their time).
The tests that read them are moved to the end of the session. Running one of these files
alone (``pytest tests/test_kernels_cpu.py``) runs it here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

# Two queues beside the suite:
# 1. the jobs queued first (transformers' reading of Gemma 3, conftest.py), then one pytest
#    process for BESIDE_FILES (Gemma 3 through PaddleFormers goes there, which keeps the main
#    process's peak to the shared SmolLM2 engine and one model; the engine's consistency and
#    fuzz tests on tiny models need no shared engine);
# 2. the simulator files, then one pytest process for LATE_BESIDE_FILES: the CPU kernels
#    against the reference (they compile the float16 / bfloat16 kernels), then the notebooks
#    (each in its own Jupyter kernel, on the Numba cache the suite's first engine and those
#    tests have filled by then: the kernel lab runs the half-precision kernels too), then the
#    simulated engine (it compiles the CPU kernels too).
SIMULATOR_FILES = ("test_kernels_cudasim.py", "test_kernels_mma.py")
BESIDE_FILES = ("test_loader.py", "test_fallback_gemma3.py", "test_environment.py",
                "test_engine_consistency.py", "test_fuzz_engine.py")
LATE_BESIDE_FILES = ("test_kernels_cpu.py", "test_notebooks.py")
LATE_SIMULATOR_FILES = ("test_engine_on_cuda_kernels.py",)
NICE = 10      # the runs beside yield the CPU to the suite's own process
SIMULATOR_TESTS = ("test_kernels_cudasim.py::test_cuda_kernels_in_the_simulator",
                   "test_kernels_mma.py::test_tensor_core_prefill_in_the_simulator",
                   "test_engine_on_cuda_kernels.py::test_engine_on_cuda_kernels_in_the_simulator")
REPORT_ENV = "FLEET_TESTS_BESIDE_REPORT"    # set in the beside process: where its reports go


def say(config, text: str) -> None:
    """Write ``text`` on a line of its own on the terminal, whatever pytest captures (``-q`` shows
    only dots), with capture suspended as pytest's live-logging plugin does."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        sys.stdout.write(f"\n{text} ")
        sys.stdout.flush()


def waits_for(item) -> str:
    """What ``item`` waits for, when it reads a run beside the suite (for the heartbeat's line)."""
    if isinstance(item, BesideItem):
        return ", waiting for the process beside the suite"
    if item.nodeid.endswith(SIMULATOR_TESTS) and not in_a_run_beside():
        return ", waiting for its run in the CUDA simulator"
    return ""


def in_a_run_beside() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or REPORT_ENV in os.environ


def yielding(argv: list[str]) -> list[str]:
    """``argv`` run at ``NICE`` (coreutils' ``nice``; as it is where there is none)."""
    return ["nice", "-n", str(NICE), *argv] if shutil.which("nice") else argv


class _Output:
    """A subprocess's combined stdout/stderr, collected by a thread as it comes."""

    def __init__(self, pipe):
        self._chunks: list[str] = []
        self._done = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(pipe,), daemon=True, name="beside-output").start()

    def _read(self, pipe):
        for chunk in iter(lambda: pipe.read1(256), b""):
            with self._cond:
                self._chunks.append(chunk.decode(errors="replace"))
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def text(self) -> str:
        with self._cond:
            return "".join(self._chunks)

    def whole(self) -> str:
        """All of it, once the pipe has closed."""
        with self._cond:
            while not self._done:
                self._cond.wait()
            return "".join(self._chunks)

    def relay(self, stream) -> str:
        """Write what came so far to ``stream``, then the rest as it comes; return all of it."""
        sent = 0
        while True:
            with self._cond:
                while sent == len(self._chunks) and not self._done:
                    self._cond.wait()
                new, sent, done = self._chunks[sent:], len(self._chunks), self._done
            stream.write("".join(new))
            stream.flush()
            if done and sent == len(self._chunks):
                return "".join(self._chunks)


class _Run:
    """One pytest process beside the suite: started by `_Queue` when its turn comes."""

    def __init__(self, args: list[str], root: str, env: dict | None = None):
        self.args, self.root, self.env = args, root, env or {}
        self.proc: subprocess.Popen | None = None
        self.output: _Output | None = None
        self._started = threading.Event()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            yielding([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *self.args]),
            env=dict(os.environ, **self.env), cwd=self.root,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.output = _Output(self.proc.stdout)
        self._started.set()

    def wait_started(self) -> None:
        self._started.wait()

    def wait(self) -> int:
        self.wait_started()
        return self.proc.wait()

    def ended(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _Queue:
    """Runs jobs (`_Run`s, or anything with ``start``, ``wait`` and ``kill``) one after another in
    a thread."""

    def __init__(self, runs: list[_Run]):
        self.runs, self._stopped = runs, False
        self.timings: list[tuple[str, float, int]] = []     # (what, seconds, exit code)
        self.started, self.ended = time.monotonic(), None
        threading.Thread(target=self._work, daemon=True, name="beside-queue").start()

    def _work(self):
        for run in self.runs:
            if self._stopped:
                return
            start = time.monotonic()
            run.start()
            returncode = run.wait()
            self.timings.append((_describe(run), time.monotonic() - start, returncode))
        self.ended = time.monotonic()

    def stop(self, wait_s: float = 0.0):
        """Start nothing more; give the run in progress ``wait_s`` to end (its session teardown),
        then kill what is left."""
        self._stopped = True
        deadline = time.monotonic() + wait_s
        for run in self.runs:
            while run.running() and time.monotonic() < deadline:
                time.sleep(0.1)
            run.kill()


class _BesideRun(_Run):
    """The plain pytest process for ``BESIDE_FILES``: its test reports go to a JSON-lines file."""

    def __init__(self, nodeids: list[str], root: str):
        fd, self.report_path = tempfile.mkstemp(prefix="beside-", suffix=".jsonl")
        os.close(fd)
        super().__init__(nodeids, root, {REPORT_ENV: self.report_path})
        self._reports: dict[str, list[dict]] = {}
        self._read = 0

    def reports(self, nodeid: str, timeout_s: float = 3600.0) -> list[dict] | None:
        """The setup/call/teardown reports of ``nodeid`` (None if the process ended without them)."""
        deadline = time.monotonic() + timeout_s
        if not self._started.wait(timeout_s):
            return None
        while time.monotonic() < deadline:
            self._read_new()
            phases = self._reports.get(nodeid, [])
            if phases and phases[-1]["when"] == "teardown":
                return phases
            if self.proc.poll() is not None:
                self._read_new()
                phases = self._reports.get(nodeid, [])
                return phases if phases and phases[-1]["when"] == "teardown" else None
            time.sleep(0.2)
        return None

    def _read_new(self):
        with open(self.report_path, encoding="utf-8") as fh:
            fh.seek(self._read)
            for line in iter(fh.readline, ""):
                if not line.endswith("\n"):    # being written
                    break
                self._read = fh.tell()
                report = json.loads(line)
                self._reports.setdefault(report["nodeid"], []).append(report)

    def kill(self):
        super().kill()
        if os.path.exists(self.report_path):
            os.unlink(self.report_path)


class BesideItem(pytest.Item):
    """A test of ``BESIDE_FILES`` as the beside process ran it: same id, same outcome."""

    def __init__(self, *, run: _BesideRun, original: pytest.Item, **kwargs):
        super().__init__(**kwargs)
        self.run, self.original = run, original
        self.own_markers = list(original.own_markers)
        self.keywords.update(original.keywords)

    def runtest(self):
        phases = self.run.reports(self.nodeid)      # conftest's heartbeat says meanwhile what it waits for
        if phases is None:
            out = self.run.output.text() if self.run.output else ""
            pytest.fail(f"the process beside the suite ended without running this test:\n{out[-4000:]}",
                        pytrace=False)
        failed = [f"[{p['when']} in the process beside the suite]\n{p['longrepr']}"
                  for p in phases if p["outcome"] == "failed"]
        if failed:
            pytest.fail("\n".join(failed), pytrace=False)
        skipped = [p for p in phases if p["outcome"] == "skipped"]
        if skipped:
            pytest.skip(skipped[0]["longrepr"])

    def reportinfo(self):
        return self.original.reportinfo()


# ------------------------------------------------- hooks (conftest.py forwards them)

def collection_modifyitems(config, items: list[pytest.Item], first=()) -> None:
    """Queue the runs beside in their two lanes (the jobs ``first`` at the head of the first),
    start nothing yet; move the tests that read them to the end, in run order."""
    if in_a_run_beside() or config.option.collectonly:
        return
    name = lambda item: item.path.name  # noqa: E731
    sims = {f: [i for i in items if i.nodeid.endswith(SIMULATOR_TESTS) and name(i) == f]
            for f in SIMULATOR_FILES + LATE_SIMULATOR_FILES}
    groups = {files: [i for i in items if name(i) in files] for files in (BESIDE_FILES, LATE_BESIDE_FILES)}
    moved = {id(i) for group in (*sims.values(), *groups.values()) for i in group}
    own = [i for i in items if id(i) not in moved]
    root = str(config.rootpath)
    tail: list[pytest.Item] = []

    def simulated(files) -> list:
        runs = []
        for f in files:
            for item in sims[f]:
                runs.append(_simulator_run(config, str(item.path)))
                tail.append(item)
        return runs

    def beside(files) -> list:
        group = groups[files]
        if not (group and own):        # alone, these files run here
            tail.extend(group)
            return []
        run = _BesideRun([i.nodeid for i in group], root)
        tail.extend(BesideItem.from_parent(i.parent, name=i.name, run=run, original=i) for i in group)
        return [run]

    lanes = [[*first, *beside(BESIDE_FILES)],
             [*simulated(SIMULATOR_FILES), *beside(LATE_BESIDE_FILES), *simulated(LATE_SIMULATOR_FILES)]]
    items[:] = own + tail
    config.__dict__["_beside_lanes"] = [lane for lane in lanes if lane]
    if own and tail:
        config.__dict__["_first_beside_item"] = tail[0]


def runtest_setup(item) -> None:
    """Note (and say) when the main process has run its own tests and starts reading the runs beside."""
    config = item.config
    if item is config.__dict__.get("_first_beside_item"):
        config.__dict__["_own_tests_ended"] = time.monotonic()
        queues = config.__dict__.get("_beside_queues", ())
        left = [_describe(run) for queue in queues for run in queue.runs if not run.ended()]
        say(config, f"[this process's own tests done after {time.monotonic() - queues[0].started:.0f} s; "
                    f"now the tests run beside it" + (f", {', '.join(left)} still running" if left else "") + "]")


def _simulator_run(config, path: str) -> _Run:
    runs = config.__dict__.setdefault("_cudasim_runs", {})
    path = os.path.abspath(path)
    if path not in runs:
        runs[path] = _Run([path], os.path.dirname(os.path.dirname(path)), {"NUMBA_ENABLE_CUDASIM": "1"})
    return runs[path]


def collection_finish(session) -> None:
    lanes = session.config.__dict__.get("_beside_lanes")
    if lanes:
        session.config.__dict__["_beside_queues"] = [_Queue(runs) for runs in lanes]
        first = session.config.__dict__.get("_first_beside_item")
        beside_items = len(session.items) - session.items.index(first) if first is not None else 0
        plan = "; ".join(f"{n}) " + ", then ".join(_describe(run) for run in runs) for n, runs in enumerate(lanes, 1))
        queues = f"{len(lanes)} queue{'s' * (len(lanes) > 1)}"
        say(session.config, f"[{len(session.items) - beside_items} tests in this process, then {beside_items} read "
                            f"from the runs beside it, at nice {NICE}, in {queues}: {plan}]")


def _describe(run) -> str:
    names = sorted({os.path.basename(a.split("::")[0]) for a in run.args if not a.startswith("-")})
    if isinstance(run, _Run):
        return " ".join(names) + (" (CUDA simulator)" if run.env.get("NUMBA_ENABLE_CUDASIM") else "")
    return "hf_reference.py " + " ".join(run.args[:1])


def terminal_summary(terminalreporter, config) -> None:
    """How long each run beside the suite took (they are not in --durations)."""
    queues = [q for q in config.__dict__.get("_beside_queues", ()) if q.timings]
    if not queues:
        return
    terminalreporter.write_sep("-", f"beside the suite, in {len(queues)} queue{'s' * (len(queues) > 1)}")
    own_ended = config.__dict__.get("_own_tests_ended")
    for number, queue in enumerate(queues, 1):
        for what, seconds, returncode in queue.timings:
            terminalreporter.write_line(f"{number}: {seconds:7.1f}s  {what}" + (f"  (exit {returncode})" if returncode else ""))
        if queue.ended is not None:
            terminalreporter.write_line(f"{number}: ended after {queue.ended - queue.started:.0f} s")
    if own_ended is not None:
        # how evenly the cores were shared: the last to end waited for nothing
        terminalreporter.write_line(f"the main process ran its own tests for {own_ended - queues[0].started:.0f} s")
    for queue in queues:
        for run in queue.runs:
            if isinstance(run, _Run) and run.output is not None:
                terminalreporter.write_sep("-", f"beside the suite: {_describe(run)}")
                terminalreporter.write_line(_summary(run))


def _summary(run: _Run) -> str:
    """What a run's output says in the end: its short test summary and result line; all of its last
    3000 characters where it did not end as pytest does (exit codes other than 0 and 1)."""
    text = run.output.text().rstrip()
    if run.ended() and run.proc.returncode not in (0, 1):
        return f"exited with {run.proc.returncode}:\n{text[-3000:]}"
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "short test summary info" in line]
    return "\n".join(lines[starts[-1] + 1:] if starts else lines[-1:])


def sessionfinish(session) -> None:
    queues = session.config.__dict__.get("_beside_queues", ())
    if any(run.running() for queue in queues for run in queue.runs):
        say(session.config, "[waiting for the runs beside the suite to end]")
    for queue in queues:
        # a session that ran to its end lets each queue's last run finish
        queue.stop(wait_s=0.0 if session.shouldstop or session.shouldfail else 120.0)


def runtest_logreport(report) -> None:
    """In the beside process: append each phase's outcome for the suite's process to read."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple):       # (file, line, "Skipped: reason")
        text = f"{longrepr[0]}:{longrepr[1]}: {longrepr[2].removeprefix('Skipped: ')}"
    else:
        text = "" if longrepr is None else str(getattr(report, "longreprtext", longrepr))
    line = json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                       "longrepr": text, "duration": report.duration})
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def relay_cudasim_run(config, path: str, capsys) -> tuple[int, str]:
    """Wait for the simulator run of ``path`` (started now if it is not queued); return its exit code
    and output, which the session's summary shows under its own heading (`terminal_summary`)."""
    run = _simulator_run(config, path)
    if run.proc is None and not any(run is r for lane in config.__dict__.get("_beside_lanes", ()) for r in lane):
        run.start()
    run.wait_started()
    return run.proc.wait(), run.output.whole()
