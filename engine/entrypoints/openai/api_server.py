"""``python -m engine.entrypoints.openai.api_server``: the engine as an OpenAI-compatible server.

FastDeploy's command line runs unchanged with ``fastdeploy`` replaced by ``engine``::

    python -m engine.entrypoints.openai.api_server --model smollm2-135m-instruct --port 8582 \\
        --metrics-port 28582 --max-model-len 8192 --max-num-seqs 256 --kv-cache-ratio 0.75 \\
        --tensor-parallel-size 1 --gpu-memory-utilization 0.9 --model-impl paddleformers

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health`` and ``/ping`` (503 while the model loads, then 200), ``GET /metrics`` (on
``--metrics-port`` when that differs from ``--port``). The port is bound before the model loads,
so a busy port fails at once. Binds 127.0.0.1 unless ``--host`` says otherwise; ``--api-key``
(or ``FD_API_KEY`` / ``VLLM_API_KEY``) guards the ``/v1`` routes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading

from ...config import DEFAULT_MODEL, FlagParser, accepted_only_notes, add_engine_args, config_from_args

logger = logging.getLogger("engine.server")


def make_arg_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m engine.entrypoints.openai.api_server",
                        description=__doc__.splitlines()[0].replace("``", ""),
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(parser)
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics on this port too (default: only on --port)")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    s.add_argument("--api-key", action="append", default=None,
                   help="a key clients must send as 'Authorization: Bearer KEY' (repeatable; also FD_API_KEY or "
                        "VLLM_API_KEY)")
    s.add_argument("--max-concurrency", type=int, default=512,
                   help="most chat/completion requests in flight; more get 429")
    s.add_argument("--max-logprobs", type=int, default=20, help="most logprobs a token a request may ask for")
    return parser


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a busy port is an error before anything loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc.strerror}; is another server using that "
                         "port? Pick another with --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _reclaim_signals() -> None:
    """Install the Python-level SIGINT/SIGTERM handlers (uvicorn's) again, at the C level too."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):
            signal.signal(sig, handler)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> int:
    args = make_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.max_logprobs < 0 or args.max_concurrency < 1:
        print("error: --max-logprobs must be >= 0 and --max-concurrency >= 1", file=sys.stderr)
        return 2
    for note in accepted_only_notes(args):
        logger.info("%s", note)
    keys = args.api_key or [k for k in (os.environ.get("FD_API_KEY"), os.environ.get("VLLM_API_KEY")) if k]
    if not _is_loopback(args.host) and not keys:
        logger.warning("listening on %s without --api-key: anyone who can reach this port can use the engine",
                       args.host)
    sock = _bind(args.host, args.port)
    metrics_sock = None
    if args.metrics_port is not None and args.metrics_port != args.port:
        metrics_sock = _bind(args.host, args.metrics_port)

    import uvicorn

    from .app import ServerState, build_app

    class _Server(uvicorn.Server):
        """Ctrl-C and SIGTERM shut the server down and it exits 0 (uvicorn raises the signal again
        after its shutdown, which would end the process with 128 + the signal's number)."""

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                if self._captured_signals:
                    logger.info("stopped by signal %d", self._captured_signals[-1])
                self._captured_signals.clear()

    state = ServerState(served_model_name=args.served_model_name or config.model or DEFAULT_MODEL,
                        api_keys=keys, max_concurrency=args.max_concurrency, max_logprobs=args.max_logprobs,
                        metrics_on_main=metrics_sock is None)
    app = build_app(state)
    server = _Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    servers = [server]
    if metrics_sock is not None:
        from .app import build_metrics_app
        servers.append(uvicorn.Server(uvicorn.Config(build_metrics_app(state), log_level="warning")))

    def load() -> None:
        try:
            state.load(config)
            # Loading imported Paddle (and PaddleFormers) on this thread, and they put C++ SIGTERM
            # handlers in place of uvicorn's: take the signals back, on the main thread.
            loop = getattr(server, "loop", None)
            if loop is not None:
                loop.call_soon_threadsafe(_reclaim_signals)
            logger.info("ready: http://%s:%d/v1 serves %s (model_impl=%s)", args.host, args.port,
                        state.served_model_name, state.llm.model_impl)
        except Exception as exc:    # noqa: BLE001  (a model that cannot load ends the server, with its message)
            logger.error("the model did not load: %s: %s", type(exc).__name__, exc)
            state.failed = f"{type(exc).__name__}: {exc}"
            for s in servers:
                s.should_exit = True

    logger.info("listening on http://%s:%d (loading %s; /health answers 503 until it is ready)",
                args.host, args.port, config.model)
    threading.Thread(target=load, name="model-loader", daemon=True).start()
    if metrics_sock is not None:
        threading.Thread(target=servers[1].run, kwargs={"sockets": [metrics_sock]}, name="metrics-server",
                         daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        for s in servers[1:]:
            s.should_exit = True
        state.shutdown()
    return 2 if state.failed else 0


if __name__ == "__main__":
    sys.exit(main())
