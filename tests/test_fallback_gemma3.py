"""The fallback on a model without a native implementation: Gemma 3 270M (``auto`` picks
PaddleFormers) against HF transformers reading the same GGUF file, greedy, with a prompt longer
than the local layers' 512-token sliding window.

Its own module, so that the SmolLM2 models of test_fallback.py are freed before Gemma loads.
"""

import hashlib
import json
import os

import pytest
from conftest import ReferenceProcess, require_reference

from engine import LLM, SamplingParams

def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


GEMMA_PROMPTS = ["Question: What is 2+3?\nAnswer:", "The capital of France is", "Once upon a time",
                 # > 512 tokens: the local layers' sliding window is in play
                 "Count with me: " + ", ".join(str(i) for i in range(1, 260)) + ", and the next number is"]


GREEDY_TOKENS = 12


def greedy_reference_memo(checkpoint):
    """The prompts as token ids, and where transformers' greedy continuations of them are
    memoised: the zoo cache, under a key of the GGUF file, the prompts, the tokens per prompt
    and the transformers/torch versions (reading the GGUF takes transformers about a minute)."""
    from importlib.metadata import version

    from engine.loader.zoo import cache_dir

    ids = [checkpoint.tokenizer.encode(p, add_special_tokens=True) for p in GEMMA_PROMPTS]
    stat = os.stat(checkpoint.path)
    key = hashlib.sha256(json.dumps([ids, GREEDY_TOKENS, stat.st_size, stat.st_mtime_ns, version("transformers"),
                                     version("torch")]).encode()).hexdigest()[:16]
    return ids, cache_dir() / f"hf-reference-gemma3-{key}.json"


@pytest.fixture(scope="module")
def gemma3_transformers(gemma3_checkpoint):
    """HF transformers' greedy continuations: ``() -> (prompt ids, continuations)``.

    From the memo (`greedy_reference_memo`; in a full run, the reading of Gemma 3's weights
    queued first beside the suite writes it, see conftest.py), else computed by
    `hf_reference.py` in a separate process started right away (so it overlaps with loading
    our model) and memoised.
    """
    require_reference()

    ids, memo = greedy_reference_memo(gemma3_checkpoint)
    if memo.is_file():
        yield lambda: (ids, json.loads(memo.read_text()))
        return
    run = ReferenceProcess("greedy", gemma3_checkpoint.path, "--max-new-tokens", str(GREEDY_TOKENS), stdin=ids)

    def result():
        continuations = run.result()
        memo.write_text(json.dumps(continuations))
        return ids, continuations

    yield result
    run.close()


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
