"""Hypothesis fuzz of SamplingParams and prompts against a running engine, with a greedy canary.

Every generated input must end one of two ways: a ``ValueError``/``TypeError`` raised before
anything is queued (the engine holds no request afterwards), or a normal finish (``stop`` or
``length``) whose output respects the parameters. Meanwhile a greedy canary request runs next to
each input, in the same batches, and must produce the same tokens every time.
"""

import threading
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from engine import LLM, SamplingParams
from tiny_models import VOCAB, make_tiny_model

CANARY = {"prompt_token_ids": [40, 41, 42, 43, 44, 45, 46, 47, 48]}
CANARY_PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

odd = st.sampled_from([None, True, False, "1", b"x", [], {}, 2.5, float("nan"), float("inf"), -float("inf"),
                       5e-324, -0.0, 1e308, 2**70, -(2**70), -1, 0, 21])
words = st.lists(st.sampled_from(["w1", "w22", "w300", "<|user|>", "x", "\n", "é", "</s>", "w7 w8"]), min_size=1,
                 max_size=10).map(" ".join)
stops = st.lists(st.sampled_from(["w", "1", " w", "2 w", "<|end|>", "é", "w22", "\n"]), min_size=1, max_size=3).map(
    "".join)

VALID = {  # every value here is accepted; a fuzzed case replaces at most one of them with a hostile one
    "max_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.sampled_from([0.0, 5e-324, 1e-6, 1e-5, 0.5, 1.0]), st.floats(0, 3)),
    "top_p": st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    "min_p": st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    "top_k": st.integers(-1, 50),
    "seed": st.one_of(st.none(), st.integers(0, 2**70)),
    "stop": st.one_of(st.none(), stops, st.lists(stops, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB + 5), max_size=3),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.one_of(st.just(1.0), st.floats(0.05, 5.0)),
    "min_tokens": st.integers(0, 3),
    "include_stop_str_in_output": st.booleans(),
}
FIELDS = sorted(VALID)
HOSTILE = st.one_of(odd, st.integers(-5, 25), st.floats(-10, 10), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=3), st.lists(odd, max_size=2))

conversation = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                               "content": words}), min_size=1, max_size=3)
VALID_PROMPTS = st.one_of(
    words,
    st.lists(st.integers(7, VOCAB - 1), min_size=1, max_size=40).map(lambda ids: {"prompt_token_ids": ids}),
    conversation,
)
HOSTILE_PROMPTS = st.one_of(
    odd, st.just(""), st.just({"prompt_token_ids": []}),
    st.lists(st.one_of(st.integers(-2, VOCAB + 2), odd), max_size=8).map(lambda ids: {"prompt_token_ids": ids}),
    st.just({"prompt_token_ids": [9] * 600}),                                   # longer than max_model_len
    st.lists(st.fixed_dictionaries({"role": odd, "content": odd}), max_size=2),
    st.dictionaries(st.sampled_from(["prompt", "prompt_token_ids", "x"]), odd, max_size=2),
)


@st.composite
def cases(draw):
    kwargs = {k: draw(v) for k, v in VALID.items() if draw(st.booleans())}
    bad = draw(st.sampled_from([None] * 2 * len(FIELDS) + FIELDS))
    if bad is not None:
        kwargs[bad] = draw(HOSTILE)
    prompt = draw(st.one_of(VALID_PROMPTS, VALID_PROMPTS, VALID_PROMPTS, HOSTILE_PROMPTS))
    # issue 31: a field set after construction, to a valid or a hostile value, must be checked too
    mutation = draw(st.one_of(st.none(), st.tuples(st.sampled_from(FIELDS), HOSTILE),
                              st.sampled_from(FIELDS).flatmap(lambda f: st.tuples(st.just(f), VALID[f]))))
    return kwargs, prompt, mutation


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = LLM(model=make_tiny_model(str(tmp_path_factory.mktemp("fuzz")), seed=5), block_size=4,
              max_num_batched_tokens=32, kv_cache_memory=64 * 2048, max_model_len=256)
    yield llm
    assert not llm.snapshot().requests


@pytest.fixture(scope="module")
def canary(llm):
    return llm.generate(CANARY, CANARY_PARAMS)[0].outputs[0].token_ids


def check_output(out, params: SamplingParams):
    o = out.outputs[0]
    assert o.finish_reason in ("stop", "length"), (o.finish_reason, o.error)
    assert 1 <= len(o.token_ids) <= params.max_tokens and isinstance(o.text, str)
    for stop in params.stop_strings:
        if params.include_stop_str_in_output:
            assert stop not in o.text[:-len(stop)] if o.text.endswith(stop) else stop not in o.text
        else:
            assert stop not in o.text
    if params.logprobs is not None:
        assert len(o.logprobs) == len(o.token_ids)
        for lp, tok in zip(o.logprobs, o.token_ids):
            assert tok in lp and len(lp) <= params.logprobs + 1
    if params.prompt_logprobs is not None:
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_fuzzed_requests_get_a_clear_error_or_a_normal_finish(llm, canary):
    tally = Counter()

    @settings(max_examples=80, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases(), api=st.sampled_from(["generate", "stream", "chat"]))
    def one_case(case, api):
        kwargs, prompt, mutation = case
        tally["cases"] += 1
        canary_out = {}
        worker = threading.Thread(target=lambda: canary_out.update(out=llm.generate(CANARY, CANARY_PARAMS)[0]))
        worker.start()
        try:
            params = SamplingParams(**kwargs)
            if mutation is not None:
                setattr(params, *mutation)
            if api == "generate":
                outs = llm.generate(prompt, params)
            elif api == "chat":
                outs = llm.chat(prompt, params)
            else:
                deltas = list(llm.stream(prompt, params))
                final = llm.generate(prompt, params)[0]
                if params.greedy or params.seed is not None:  # same tokens either way: same text
                    assert "".join(d.text for d in deltas) == final.outputs[0].text
                assert deltas[-1].finished and deltas[-1].finish_reason == final.outputs[0].finish_reason
                outs = [final]
        except (ValueError, TypeError) as exc:
            tally["clear errors"] += 1
            assert str(exc), "an error must say what is wrong"
        else:
            tally["normal finishes"] += 1
            for out in outs:
                check_output(out, params)
        finally:
            worker.join(60)
        assert not worker.is_alive(), "the canary hung"
        assert canary_out["out"].outputs[0].token_ids == canary, "the canary's greedy output changed"
        assert not llm.snapshot().requests

    one_case()
    print(f"\nfuzz tally: {dict(tally)}")
    # the fuzz is only meaningful if it produced both refusals and completions
    assert tally["cases"] >= 80 and tally["clear errors"] >= 10 and tally["normal finishes"] >= 10
