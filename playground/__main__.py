"""``python -m playground``: load a model and serve the playground.

Engine flags (``--model``, ``--model-impl``, ``--block-size``,
``--kv-cache-memory``, ``--max-num-seqs``, ``--max-model-len``,
``--no-prefix-caching``, ...) are the engine's own CLI flags; the rest are
about serving. The server binds to 127.0.0.1 unless ``--host`` says
otherwise, and makes a public share link only with ``--share``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from engine import LLM, add_engine_args, config_from_args

from .app import build_app, launch
from .handlers import Limits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m playground", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(parser)
    web = parser.add_argument_group("server")
    web.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 exposes it to the network)")
    web.add_argument("--port", type=int, default=7860)
    web.add_argument("--share", action="store_true", help="also create a public gradio.live link")
    web.add_argument("--queue-size", type=int, default=32, help="requests allowed to wait; more are refused")
    web.add_argument("--max-input-chars", type=int, default=Limits.max_input_chars,
                     help="longest accepted chat message")
    web.add_argument("--max-batch", type=int, default=Limits.max_batch, help="largest batch demo")
    web.add_argument("--allow-engine-admin", action="store_true",
                     help="enable actions that affect every visitor (reset the prefix cache, load a second "
                          "backend for the consistency check)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    config = config_from_args(args)
    print(f"Loading {config.model} (model_impl={config.model_impl}, device={config.device}) ...", flush=True)
    t0 = time.perf_counter()
    llm = LLM(**vars(config))
    print(f"Loaded {llm.model_name} with model_impl={llm.model_impl} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    limits = Limits(max_input_chars=args.max_input_chars, max_batch=args.max_batch)
    demo = build_app(llm, limits=limits, queue_size=args.queue_size, allow_engine_admin=args.allow_engine_admin)
    launch(demo, server_name=args.host, server_port=args.port, share=args.share)


if __name__ == "__main__":
    sys.exit(main())
