"""Building a PaddleFormers model without the notices its import and constructors print.

Importing ``paddleformers`` 1.2.0 imports ``transformers`` with torch hidden, so transformers says
"PyTorch was not found..." (``transformers/__init__.py``, an advisory warning), then PaddleFormers
warns that it did so (``paddleformers/__init__.py``); something on the way replaces distutils
(setuptools' ``_distutils_hack`` warns), and building a model logs an INFO line per loss config
(``paddleformers/nn/criterion/interface.py``). PaddleFormers' logger (``paddleformers/utils/log.py``)
has its own coloured stderr handler at DEBUG, so all of it lands as red stderr in a notebook cell.
None of it concerns the engine, which builds the model and never uses torch through transformers.

``quiet_paddleformers()`` is held around the import and the model's construction: PaddleFormers'
records below WARNING and the one torch notice are dropped, transformers' advisory warnings are
off, and the distutils warning is ignored. Other warnings still show.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

# paddleformers/utils/log.py: Logger() wraps logging.getLogger("PaddleFormers")
PADDLEFORMERS_LOGGER = "PaddleFormers"
_TORCH_NOTICE = "Due to potential compatibility issues between PaddlePaddle and PyTorch in PaddleFormers"


class _DropNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        return not str(record.msg).startswith(_TORCH_NOTICE)


@contextlib.contextmanager
def quiet_paddleformers():
    """Import PaddleFormers and build its models inside this block: its notices stay unprinted."""
    pf_logger = logging.getLogger(PADDLEFORMERS_LOGGER)
    drop = _DropNotices()
    pf_logger.addFilter(drop)
    advisory = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Setuptools is replacing distutils")
            yield
    finally:
        pf_logger.removeFilter(drop)
        if advisory is None:
            os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advisory
