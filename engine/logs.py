"""The engine logs as a library does: records go to the ``"engine"`` logger, which has no handler
and no level of its own; the application decides what is shown (``python -m playground`` shows
INFO). Where nothing is configured, Python's last-resort handler prints WARNING and above to
stderr, so warnings stay visible (a ``NullHandler`` would silence them too).

Importing Paddle breaks that for every library: ``paddle.distributed.utils.log_utils.get_logger``
(Paddle 3.3.1, called on import by ``paddle/distributed/auto_parallel/random.py``) asks for a
logger named ``"root"``, which *is* the root logger, and gives it a stderr handler at INFO; in a
notebook every INFO record then prints as red stderr. ``undo_paddle_root_logging`` takes back
exactly that handler and level, whether Paddle was imported before the engine or by it.
"""

from __future__ import annotations

import logging

# paddle/distributed/utils/log_utils.py's format, which tells its handler from an application's
PADDLE_ROOT_FORMAT = "[%(asctime)-15s] [%(levelname)8s] %(filename)s:%(lineno)s - %(message)s"


def undo_paddle_root_logging() -> None:
    """Remove the handler Paddle's import put on the root logger and the INFO level it set."""
    root = logging.getLogger()
    paddles = [h for h in root.handlers if type(h) is logging.StreamHandler
               and h.formatter is not None and h.formatter._fmt == PADDLE_ROOT_FORMAT]
    for handler in paddles:
        root.removeHandler(handler)
    if paddles and root.level == logging.INFO:
        root.setLevel(logging.WARNING)


