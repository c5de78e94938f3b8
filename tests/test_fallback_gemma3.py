"""The fallback on a model without a native implementation: Gemma 3 270M (``auto`` picks
PaddleFormers) against HF transformers reading the same GGUF file, greedy, with a prompt longer
than the local layers' 512-token sliding window (transformers' answer live with the "reference"
extra, else its recording: `hf_recorded`).

Its own module, so that the SmolLM2 models of test_fallback.py are freed before Gemma loads.
"""

import hashlib
import json
import os

import hf_recorded
import pytest
from conftest import ReferenceProcess, require_reference

from engine import LLM, SamplingParams

def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


GEMMA_PROMPTS = ["Question: What is 2+3?\nAnswer:", "The capital of France is", "Once upon a time",
                 # > 512 tokens: the local layers' sliding window is in play
                 "Count with me: " + ", ".join(str(i) for i in range(1, 260)) + ", and the next number is"]


GREEDY_TOKENS = 12


def prompt_ids(checkpoint) -> list[list[int]]:
    return [checkpoint.tokenizer.encode(p, add_special_tokens=True) for p in GEMMA_PROMPTS]


def greedy_reference_memo(checkpoint):
    """The prompts as token ids, and where transformers' greedy continuations of them are
    memoised: the zoo cache, under a key of the GGUF file, the prompts, the tokens per prompt
    and the transformers/torch versions (reading the GGUF takes transformers about a minute)."""
    from importlib.metadata import version

    from engine.loader.zoo import cache_dir

    ids = prompt_ids(checkpoint)
    stat = os.stat(checkpoint.path)
    key = hashlib.sha256(json.dumps([ids, GREEDY_TOKENS, stat.st_size, stat.st_mtime_ns, version("transformers"),
                                     version("torch")]).encode()).hexdigest()[:16]
    return ids, cache_dir() / f"hf-reference-gemma3-{key}.json"


@pytest.fixture(scope="module")
def gemma3_transformers(gemma3_checkpoint):
    """HF transformers' greedy continuations: ``() -> (prompt ids, continuations)``.

    Live, from the memo (`greedy_reference_memo`; in a full run, the reading of Gemma 3's weights
    queued first beside the suite writes it, see conftest.py), else computed by
    `hf_reference.py` in a separate process started right away (so it overlaps with loading
    our model) and memoised; without torch, from the recording.
    """
    ids, run, memo = prompt_ids(gemma3_checkpoint), None, None
    inputs = {**hf_recorded.gguf_inputs(gemma3_checkpoint.path), "ids": ids, "tokens": GREEDY_TOKENS}
    if hf_recorded.live():
        require_reference()
        ids, memo = greedy_reference_memo(gemma3_checkpoint)
        if not memo.is_file():
            run = ReferenceProcess("greedy", gemma3_checkpoint.path, "--max-new-tokens", str(GREEDY_TOKENS),
                                   stdin=ids)

    def compute():
        if memo.is_file():
            return json.loads(memo.read_text())
        continuations = run.result()
        memo.write_text(json.dumps(continuations))
        return continuations

    yield lambda: (ids, hf_recorded.answer("gemma3-greedy", inputs, compute))
    if run is not None:
        run.close()


@pytest.mark.reference
@pytest.mark.slow
def test_gemma3_auto_serves_paddleformers_and_matches_transformers(gemma3_transformers):
    llm = LLM(model="gemma3-270m", kv_cache_memory=64 * 1024**2)   # ~1800 tokens, for ~700
    assert llm.model_impl == "paddleformers" and llm.snapshot().model_impl == "paddleformers"
    ids, expected = gemma3_transformers()
    assert len(ids[-1]) > 512
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True))
    assert token_ids(outs) == expected
    assert outs[0].outputs[0].text.startswith(" 2+3=5")


@pytest.mark.slow
def test_gemma3_captured_decode_matches_eager():
    """Gemma 3 270M's decode steps on the fused kernel (the captured decode step: sandwich norms,
    GELU, local layers' window and RoPE base, scaled embeddings) give the eager PaddleFormers
    forward's greedy tokens and logprobs within 1e-4, past the 512-token window."""
    from engine.loader import load_checkpoint

    checkpoint = load_checkpoint("gemma3-270m")
    ids = [checkpoint.tokenizer.encode(p, add_special_tokens=True) for p in GEMMA_PROMPTS]
    assert len(ids[-1]) > 512
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    outputs, paths = {}, {}
    for decode in ("paddle", "fused"):
        llm = LLM(model="gemma3-270m", cpu_decode=decode, kv_cache_memory=64 * 1024**2)
        try:
            paths[decode] = (llm.snapshot().decode_path, llm.snapshot().prefill_path)
            outputs[decode] = llm.generate([{"prompt_token_ids": p} for p in ids], params)
        finally:
            llm.shutdown()
    assert paths == {"paddle": ("paddle", "paddle"), "fused": ("fused", "fused")}
    for eager, fused in zip(outputs["paddle"], outputs["fused"]):
        assert fused.outputs[0].token_ids == eager.outputs[0].token_ids
        for tok, lp_eager, lp in zip(eager.outputs[0].token_ids, eager.outputs[0].logprobs, fused.outputs[0].logprobs):
            assert abs(lp[tok].logprob - lp_eager[tok].logprob) <= 1e-4
