"""``python -m playground``: load a model and serve the playground.

Engine flags (``--model``, ``--model-impl``, ``--block-size``,
``--kv-cache-memory``, ``--max-num-seqs``, ``--max-model-len``,
``--no-prefix-caching``, ...) are the engine's own CLI flags; the rest are
about serving. The server binds to 127.0.0.1 unless ``--host`` says
otherwise, and makes a public share link only with ``--share``.

Start-up says what it is doing (importing, loading, warming up) and does the
slow first-time work -- kernel compilation, matplotlib's font cache, which
Gradio touches on every request -- before the URL appears, so the first chat
is as fast as the next. The engine runs in a process of its own
(``engine.LLMProcess``; ``--in-process`` keeps it in this one). Ctrl-C and
SIGTERM stop the server and exit with 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

from .inputs import Limits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from engine.config import FlagParser, add_engine_args

    parser = FlagParser(prog="python -m playground", description=__doc__.splitlines()[0].replace("``", ""),
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(parser)
    web = parser.add_argument_group("server")
    web.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 exposes it to the network)")
    web.add_argument("--port", type=int, default=7860, help="port to listen on")
    web.add_argument("--share", action="store_true", help="also create a public gradio.live link")
    web.add_argument("--queue-size", type=int, default=32, help="requests allowed to wait; more are refused")
    web.add_argument("--max-input-chars", type=int, default=Limits.max_input_chars,
                     help="longest accepted chat message")
    web.add_argument("--max-batch", type=int, default=Limits.max_batch, help="largest batch demo")
    web.add_argument("--allow-engine-admin", action="store_true",
                     help="enable actions that affect every visitor (reset the prefix cache, load a second "
                          "backend for the consistency check)")
    web.add_argument("--server", metavar="URL", default=None,
                     help="use the engine of a server instead of loading a model here (engine flags are then "
                          "ignored): python -m engine.entrypoints.openai.api_server (every view), or any "
                          "OpenAI-compatible server -- vLLM, FastDeploy, llama.cpp's llama-server -- read through "
                          "its OpenAI routes and /metrics (no KV block map: such a server does not expose it)")
    web.add_argument("--api-key", default=None, help="the key of --server, if it has one")
    web.add_argument("--openai-only", action="store_true",
                     help="read --server through its standard OpenAI routes only, as any other server, even when "
                          "it is this project's engine server")
    web.add_argument("--in-process", action="store_true",
                     help="run the engine in the server's process (by default it runs in a process of its "
                          "own: the server's threads then never hold up a decode step)")
    return parser.parse_args(argv)


def _say(message: str) -> None:
    print(message, flush=True)


def serve(demo, host: str, port: int, share: bool | None) -> None:
    """Start Gradio's server and say where it listens. Gradio's own start-up lines are left out: its
    hint names its Python API (``share=True``); ``share=False`` says the flag (``--share``) instead,
    ``None`` (a command without it) says nothing."""
    from .app import launch

    launch(demo, server_name=host, server_port=port, share=bool(share), prevent_thread_lock=True, quiet=True)
    _say(f"* Running on local URL:  {demo.local_url}")
    if share is False:
        _say("  (--share adds a public gradio.live link)")


def _stop_on_sigterm() -> None:
    """SIGTERM stops the server like Ctrl-C (Paddle's own handler would print a C++ fatal error)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (None when it can)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _warm_up(llm, progress: bool = False) -> None:
    """Pay the first requests' one-time costs now, before the URL is printed (the engine's own
    warm-up at load covers a short prefill and a decode step): the engine thread, sampling and
    detokenizing; a prompt longer than ``block_matmul.SMALL_T`` tokens, whose prefill takes the
    BLAS path of the quantized matmuls (in a fresh install compiling it took seconds, which the
    first long chat would otherwise wait through); and matplotlib, which Gradio imports for every
    request when it is installed and which builds its font cache on first import; the timeline's
    Plotly figure. The prefix cache is emptied afterwards: the page starts with every block free.
    ``progress``: a tqdm bar in the terminal naming each part as it runs, with its estimate."""
    from tqdm import tqdm

    from engine import SamplingParams
    from gpu_kernels.cpu.block_matmul import SMALL_T

    from .timeline_chart import timeline_figure
    from .timeline import Timeline

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    hi = llm.get_tokenizer().encode("Hi", add_special_tokens=False)
    long = hi * (SMALL_T // len(hi) + 2)

    def matplotlib() -> None:
        try:
            import matplotlib.pyplot  # noqa: F401
        except ImportError:
            pass

    parts = [
        ("a short request: the engine thread, sampling, detokenizing", lambda: llm.generate("Hi", params, use_tqdm=False)),
        (f"a {len(long)}-token prompt: the quantized matmuls' BLAS path (compiled on a fresh install)",
         lambda: llm.generate({"prompt_token_ids": long}, params, use_tqdm=False)),
        ("matplotlib's font cache (Gradio imports it for every request)", matplotlib),
        ("the timeline's Plotly figure", lambda: timeline_figure(Timeline().series())),
    ]
    with tqdm(parts, unit="part", disable=not progress, file=sys.stdout, dynamic_ncols=True,
              bar_format="{l_bar}{bar}| {n}/{total} [{elapsed}<{remaining}]") as bar:
        for what, run in bar:
            bar.set_description(f"warming up: {what}")
            run()
    llm.reset_prefix_cache()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    busy = _port_in_use(args.host, args.port)
    if busy:    # before minutes of loading, not after
        print(f"error: cannot listen on {args.host}:{args.port}: {busy}; is another server using that port? "
              "Pick another with --port", file=sys.stderr)
        return 2
    _say("Starting the Fleet Playground: importing PaddlePaddle and Gradio ...")
    from engine import LLM, LLMProcess, config_from_args
    from engine.llm import EngineDeadError

    from .app import build_app

    # Our own records at INFO; other libraries' (httpx logs every request Gradio makes) at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("engine", "playground"):
        logging.getLogger(name).setLevel(logging.INFO)
    _stop_on_sigterm()
    demo = llm = None
    try:
        try:    # a model or engine setting that cannot work: its message, not a traceback
            t0 = time.perf_counter()
            if args.server:
                from engine.client import connect

                _say(f"Connecting to the engine at {args.server} ...")
                llm = connect(args.server, api_key=args.api_key, openai_only=args.openai_only)
            else:
                config = config_from_args(args)
                _say(f"Loading {config.model} (model_impl={config.model_impl}, device={config.device}); the first "
                     "run after an install also compiles the attention kernels ...")
                llm = (LLM if args.in_process else LLMProcess)(**vars(config))
        except (FileNotFoundError, ValueError, NotImplementedError, EngineDeadError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        _say(f"{'Connected to' if args.server else 'Loaded'} {llm.model_name} with model_impl={llm.model_impl} in "
             f"{time.perf_counter() - t0:.1f} s")
        if not args.server:     # a server's engine is warm, and its prefix cache is its users'
            _say("Warming up: a short and a long request through the engine, and the libraries the first chat "
                 "loads ...")
            t0 = time.perf_counter()
            _warm_up(llm, progress=True)
            _say(f"Warmed up in {time.perf_counter() - t0:.1f} s")
        limits = Limits(max_input_chars=args.max_input_chars, max_batch=args.max_batch)
        demo = build_app(llm, limits=limits, queue_size=args.queue_size,
                         allow_engine_admin=args.allow_engine_admin)
        serve(demo, args.host, args.port, share=args.share)
        _say("Ready. Press Ctrl-C to stop.")
        while demo.is_running:
            time.sleep(0.2)
    except KeyboardInterrupt:   # Ctrl-C, or SIGTERM through _stop_on_sigterm
        signal.signal(signal.SIGINT, signal.SIG_DFL)    # a second Ctrl-C during clean-up quits at once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    finally:
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
