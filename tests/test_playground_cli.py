"""``python -m playground`` as a user runs it: it says what it is doing, warms up before the
URL appears, and stops cleanly (exit code 0, no traceback) on Ctrl-C and on SIGTERM.

A tiny random model keeps the start-up short; the default model goes through the same path.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), "LlamaForCausalLM", seed=1)


class Playground:
    """``python -m playground`` (or ``command``) in a subprocess, its stdout lines collected as they come."""

    def __init__(self, model: str | None = None, command: list[str] | None = None, env: dict | None = None):
        command = command or [sys.executable, "-m", "playground", "--model", model, "--port", str(_free_port())]
        self.proc = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, start: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(start) for line in self.lines):
            line = self._queue.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"exited before {start!r}: " + self.proc.stderr.read()[-3000:]
            self.lines.append(line)

    def stop(self, signum) -> tuple[int, str]:
        """Send ``signum``; return the exit code and stderr once it exited."""
        try:
            self.proc.send_signal(signum)
            rc = self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return rc, self.proc.stderr.read()


@pytest.mark.slow
def test_start_up_is_announced_and_ctrl_c_or_sigterm_stops_it_cleanly(tiny):
    apps = {signal.SIGINT: Playground(tiny), signal.SIGTERM: Playground(tiny)}   # start together
    engines = {}
    try:
        for signum, app in apps.items():
            app.wait_for("Ready", timeout=240)
            engines[signum] = _spawned_children(app.proc.pid)
    finally:
        results = {signum: app.stop(signum) for signum, app in apps.items()}

    for signum, (rc, err) in results.items():
        lines = apps[signum].lines
        text = "".join(lines)
        assert rc == 0, (signum, rc, text[-2000:], err[-3000:])
        assert "Traceback" not in err and "FatalError" not in err, (signum, err[-3000:])
        assert "Error Message Summary" not in text and "No ccache found" not in err
        assert "HTTP Request:" not in text + err, "other libraries' INFO records (httpx) reach the terminal"
        assert "share=True" not in text + err and "--share adds a public gradio.live link" in text
        said = [next(i for i, line in enumerate(lines) if line.startswith(start)) for start in
                ("Starting", "Loading", "Warming up", "Warmed up", "* Running on local URL", "Ready")]
        assert said == sorted(said), text
        assert [line.strip() for line in lines[said[-1] + 1:] if line.strip()] == ["Stopped."], text
        assert engines[signum] and not [pid for pid in engines[signum] if _alive(pid)], "the engine outlived it"


@pytest.mark.parametrize("argv", [["--model", "no-such-model"], ["--block-size", "0"]])
def test_a_model_or_setting_that_cannot_work_exits_with_its_message(argv):
    result = subprocess.run([sys.executable, "-m", "playground", *argv, "--port", str(_free_port())],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert ("not found; it must be" if argv[1] == "no-such-model" else "block_size") in result.stderr


def test_warm_up_prefills_past_the_small_matmul_path_and_leaves_no_cached_block(smollm2_llm):
    """The CLI's warm-up runs a prefill longer than ``block_matmul.SMALL_T`` tokens (the quantized
    matmuls' BLAS path, which a fresh install would otherwise compile during the first long chat)
    and leaves every block free, as the page shows it at start."""
    from gpu_kernels.cpu.block_matmul import SMALL_T
    from playground.__main__ import _warm_up

    steps = []
    unsubscribe = smollm2_llm.subscribe(lambda e: steps.append(e.data) if e.kind == "step" else None)
    try:
        _warm_up(smollm2_llm)
    finally:
        unsubscribe()
    assert max(s["num_tokens"] for s in steps) > SMALL_T
    assert {b.state for b in smollm2_llm.snapshot().blocks} == {"free"}


def test_warm_up_shows_a_bar_naming_each_part(smollm2_llm, capsys):
    """``python -m playground`` warms up under a tqdm bar that says what runs now, with its estimate."""
    from playground.__main__ import _warm_up

    _warm_up(smollm2_llm, progress=True)
    out = capsys.readouterr().out
    assert "warming up: a short request" in out and "BLAS path" in out and "Plotly figure" in out
    assert re.search(r"4/4 \[\d+:\d+<\d+:\d+\]", out), out[-500:]
    _warm_up(smollm2_llm)
    assert capsys.readouterr().out == ""                  # the tests' and benchmarks' warm-up is quiet


def test_a_busy_port_fails_before_anything_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        out = subprocess.run([sys.executable, "-m", "playground", "--port", str(busy.getsockname()[1])], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr and "--port" in out.stderr
    assert "importing PaddlePaddle" not in out.stdout and "Traceback" not in out.stderr


@pytest.mark.parametrize("command,typo,said", [
    (["-m", "playground"], ["--max-model-lenght", "64"], "did you mean --max-model-len?"),
    (["-m", "engine.entrypoints.openai.api_server"], ["--tensor-paralel-size", "1"],
     "did you mean --tensor-parallel-size?"),
    (["app.py"], ["--port", "7861"], "unknown flag --port"),
    (["-m", "benchmarks.serving"], ["--concurency", "4"], "did you mean --concurrency?"),
])
def test_an_unknown_flag_fails_before_paddle_or_gradio_is_imported(command, typo, said):
    out = subprocess.run([sys.executable, "-X", "importtime", *command, *typo], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    said_lines = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    assert out.returncode == 2 and len(said_lines) == 1 and said in said_lines[0], out.stderr[-2000:]
    assert said_lines[0].endswith("(--help lists every flag)")
    assert "paddle" not in imported and "gradio" not in imported and "torch" not in imported


@pytest.mark.parametrize("module", ["benchmarks.engine", "benchmarks.sampler", "benchmarks.playground"])
def test_a_benchmark_s_help_imports_neither_paddle_nor_gradio(module):
    """A benchmark parses its arguments before it imports Paddle or Gradio: ``--help`` answers at once."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", module, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert out.returncode == 0 and out.stdout.startswith(f"usage: python -m {module}"), out.stderr[-2000:]
    assert not {name for name in imported if name.split(".")[0] in ("paddle", "gradio", "gradio_client", "torch")}


def _space_env(port: int) -> dict:
    """The environment of ``python app.py`` on ``port``, bound to 127.0.0.1 as outside a Space."""
    env = {k: v for k, v in os.environ.items() if k not in ("GRADIO_SERVER_NAME", "PLAYGROUND_MODEL")}
    return {**env, "GRADIO_SERVER_PORT": str(port)}


def _spawned_children(pid: int) -> list[int]:
    """The processes ``pid`` started through multiprocessing's spawn (the engine's, not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_space_fails_at_once_on_a_busy_port():
    """``python app.py`` checks its port before the weights, Paddle and Gradio: a one-line error."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        out = subprocess.run([sys.executable, "app.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env=_space_env(busy.getsockname()[1]))
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: cannot listen on 127.0.0.1:")
    assert "GRADIO_SERVER_PORT" in out.stderr


@pytest.mark.slow
def test_the_space_warms_up_like_the_cli_and_sigterm_stops_it_and_its_engine():
    """How a Space is stopped: SIGTERM to ``python app.py``. It stops the server and the engine's
    process, says so in one line and exits 0, without Paddle's C++ fatal-error trace."""
    app = Playground(command=[sys.executable, "app.py"], env=_space_env(_free_port()))
    engine = []
    try:
        app.wait_for("Ready", timeout=300)
        engine = _spawned_children(app.proc.pid)
    finally:
        rc, err = app.stop(signal.SIGTERM)
    text = "".join(app.lines)
    assert rc == 0, (rc, text[-2000:], err[-3000:])
    assert "Traceback" not in err and "FatalError" not in err and "Error Message Summary" not in text + err, err
    assert engine and not [pid for pid in engine if _alive(pid)], "the engine's process outlived the app"
    said = [next(i for i, line in enumerate(app.lines) if line.startswith(start)) for start in
            ("Starting", "Loading", "Warming up", "Warmed up", "* Running on local URL", "Ready")]
    assert said == sorted(said), text
    assert [line.strip() for line in app.lines[said[-1] + 1:] if line.strip()] == ["Stopped."], text

