"""What the engine's start-up says while Numba compiles (`engine.compile_progress`): a bar naming the
warm-up's stage and the kernel being compiled, with an estimate; nothing when the kernels are cached."""

from __future__ import annotations

import contextlib
import re

import numba
import numpy as np
import pytest
from numba import njit
from tiny_models import make_tiny_model

from engine import compile_progress as cp


def _fresh_kernels(cache_dir, monkeypatch):
    """Two cached kernels Numba has not compiled yet: their disk cache in ``cache_dir``, empty."""
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(cache_dir))     # read as a kernel is defined

    @njit(cache=True)
    def total(x):
        return np.sort(x).sum()

    @njit(cache=True)
    def doubled(x):
        return (x * 2.0).sum()

    return total, doubled


def test_a_compile_shows_the_stage_the_kernel_and_an_estimate(capsys, tmp_path, monkeypatch):
    total, doubled = _fresh_kernels(tmp_path, monkeypatch)
    with cp.compile_progress() as progress:
        progress.stage("prefill")
        total(np.arange(5.0))
        progress.stage("decode")
        doubled(np.arange(5.0))
        progress.stage("sampler")
    err = capsys.readouterr().err
    assert "first run, compiling kernels (prefill): test_compile_progress._fresh_kernels.<locals>.total" in err
    assert "(decode): test_compile_progress._fresh_kernels.<locals>.doubled" in err
    assert "estimating the time left after this stage" in err       # during the first stage
    # after the prefill stage (37 of 100), the rest at the pace it took
    assert re.search(r"37%\|[^|]*\| \d\d:\d\d, about \d\d:\d\d left", err), err[-800:]
    assert err.rstrip().rsplit("\r", 1)[-1].startswith("first run, compiled 2 kernels (Numba keeps them cached)")
    assert progress.kernels == 2


def test_nothing_is_shown_when_the_kernels_are_cached(capsys, tmp_path, monkeypatch):
    """Kernels from Numba's disk cache show nothing, nor does one Numba cannot cache and so compiles on
    every start (as ``sync.close_step``)."""
    total, doubled = _fresh_kernels(tmp_path, monkeypatch)
    total(np.arange(5.0))
    doubled(np.arange(5.0))
    total, doubled = _fresh_kernels(tmp_path, monkeypatch)     # as a new process defines them: cached on disk

    @njit
    def uncached(x):
        return x.max()

    capsys.readouterr()
    with cp.compile_progress() as progress:
        progress.stage("prefill")
        total(np.arange(7.0))
        doubled(np.arange(7.0))
        uncached(np.arange(7.0))
    assert capsys.readouterr().err == "" and progress.kernels == 0


def test_an_unknown_stage_is_refused_with_the_known_ones():
    with cp.compile_progress() as progress, pytest.raises(ValueError, match="known: runner, prefill, decode"):
        progress.stage("prefil")


def test_the_engine_warm_up_goes_through_every_stage(tmp_path, monkeypatch):
    """A load marks each stage the weights of `STAGES` are for, in order (the fused CPU decode
    step and the sampler included), so the bar's share of each is where its kernels compile."""
    from engine import LLM, llm_engine

    seen = []

    @contextlib.contextmanager
    def recording():
        progress = cp.CompileProgress()
        original = progress.stage
        progress.stage = lambda name: (seen.append(name), original(name))
        yield progress

    monkeypatch.setattr(llm_engine, "compile_progress", recording)
    llm = LLM(model=make_tiny_model(str(tmp_path / "llama"), "LlamaForCausalLM", seed=1), kv_cache_memory=2**20)
    try:
        assert llm.engine.runner.decode_path == "fused"
    finally:
        llm.shutdown()
    assert seen == list(cp.STAGES)
