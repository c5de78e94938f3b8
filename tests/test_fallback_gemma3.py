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


@pytest.fixture(scope="module")
def gemma3_transformers(gemma3_checkpoint):
    """HF transformers' greedy continuations: ``() -> (prompt ids, continuations)``.

    Computed by `hf_reference.py` in a separate process started right away (so
    it overlaps with loading our model), and memoised in the zoo cache under a
    key of the GGUF file, the prompts and the transformers/torch versions:
    reading the GGUF takes transformers about a minute.
    """
    from importlib.metadata import version

    from engine.loader.zoo import cache_dir

    require_reference()

    ids = [gemma3_checkpoint.tokenizer.encode(p, add_special_tokens=True) for p in GEMMA_PROMPTS]
    stat = os.stat(gemma3_checkpoint.path)
    key = hashlib.sha256(json.dumps([ids, 12, stat.st_size, stat.st_mtime_ns, version("transformers"),
                                     version("torch")]).encode()).hexdigest()[:16]
    memo = cache_dir() / f"hf-reference-gemma3-{key}.json"
    if memo.is_file():
        yield lambda: (ids, json.loads(memo.read_text()))
        return
    run = ReferenceProcess("greedy", gemma3_checkpoint.path, "--max-new-tokens", "12", stdin=ids)

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
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert token_ids(outs) == expected
    assert outs[0].outputs[0].text.startswith(" 2+3=5")
