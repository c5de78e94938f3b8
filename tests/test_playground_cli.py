"""``python -m playground`` as a user runs it: it says what it is doing, warms up before the
URL appears, and stops cleanly (exit code 0, no traceback) on Ctrl-C and on SIGTERM.

A tiny random model keeps the start-up short; the default model goes through the same path.
"""

from __future__ import annotations

import os
import queue
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


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_start_up_is_announced_and_a_signal_stops_it_cleanly(tiny, signum):
    proc = subprocess.Popen(
        [sys.executable, "-m", "playground", "--model", tiny, "--port", str(_free_port())],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    stdout = []
    try:
        deadline = time.monotonic() + 240
        while not any(line.startswith("Ready") for line in stdout):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "the playground exited before it was ready: " + proc.stderr.read()[-3000:]
            stdout.append(line)
        proc.send_signal(signum)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while (line := lines.get(timeout=10)) is not None:
        stdout.append(line)
    err = proc.stderr.read()
    text = "".join(stdout)

    assert rc == 0, (rc, text[-2000:], err[-3000:])
    assert "Traceback" not in err and "FatalError" not in err and "Error Message Summary" not in text, err[-3000:]
    assert "No ccache found" not in err
    said = [next(i for i, line in enumerate(stdout) if line.startswith(start)) for start in
            ("Starting", "Loading", "Warming up", "Warmed up", "* Running on local URL", "Ready", "Stopped")]
    assert said == sorted(said), text
