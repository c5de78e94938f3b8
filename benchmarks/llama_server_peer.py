"""llama.cpp's own ``llama-server`` as a single-stream peer: prefill and decode rates by its own clock.

The binary is built from the vendored llama.cpp (``scripts/build_llama_server.sh``) and
started on a GGUF file with ``-t T -tb T`` (its decode and batch threads) and one slot.
Every measurement is one ``POST /completion`` with a prompt of token ids (the very ids
the engine gets), ``cache_prompt: false`` (the prompt is evaluated from scratch each
time) and greedy sampling; the rates are llama.cpp's ``timings`` of that request:

* ``prompt_per_second`` -- the prompt's evaluation (prefill), HTTP and sampling excluded;
* ``predicted_per_second`` -- generated tokens over the time spent generating them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .serving import LLAMA_SERVER, Server, free_port

STARTUP_S = 300.0


class LlamaServerPeer:
    """One ``llama-server`` on ``path`` with ``threads`` threads, stopped by `close`."""

    def __init__(self, path: str, threads: int, ctx: int = 4096, binary: Path = LLAMA_SERVER):
        if not Path(binary).exists():
            raise FileNotFoundError(f"no llama-server at {binary}: run scripts/build_llama_server.sh")
        self.log_dir = Path(tempfile.mkdtemp(prefix="llama-server-"))
        port = free_port()
        t = str(threads)
        self.server = Server("llama-server", [str(binary), "-m", path, "-t", t, "-tb", t, "--parallel", "1",
                                              "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)],
                             port, self.log_dir)
        try:
            self.server.wait_ready(STARTUP_S)
        except Exception:
            self.server.stop()
            raise

    def version(self) -> str:
        import httpx

        props = httpx.get(self.server.url + "/props", timeout=10.0).json()
        return str(props.get("build_info") or "")

    def _complete(self, prompt: list[int], n: int) -> dict:
        import httpx

        body = {"prompt": list(map(int, prompt)), "n_predict": n, "cache_prompt": False, "temperature": 0.0,
                "top_k": 1, "ignore_eos": True, "return_tokens": True, "stream": False}
        reply = httpx.post(self.server.url + "/completion", json=body, timeout=600.0)
        reply.raise_for_status()
        return reply.json()

    def prefill_tok_s(self, prompt: list[int]) -> float:
        """llama.cpp's prompt evaluation rate for ``prompt`` from an empty cache."""
        return float(self._complete(prompt, 1)["timings"]["prompt_per_second"])

    def decode(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        """llama.cpp's generation rate over ``n`` greedy tokens after ``prompt``, and the tokens."""
        doc = self._complete(prompt, n)
        return float(doc["timings"]["predicted_per_second"]), list(doc.get("tokens") or [])

    def close(self) -> None:
        self.server.stop()
