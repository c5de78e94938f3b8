"""Greedy output must not depend on how the engine schedules the work.

Prefix caching on/off, chunked-prefill budgets, batch composition and
preemption all change which kernels see which tokens when; none may change a
single generated token. The paged path must also agree with a plain dense
forward of the same weights.
"""

import numpy as np
import paddle
import pytest

from engine import LLM, SamplingParams
from engine.loader import load_checkpoint
from engine.models import build_native_model
from tiny_models import make_tiny_model, tiny_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_dir(request, tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param)), request.param, seed=3)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_paged_path_matches_dense_forward(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4, max_num_batched_tokens=7)
    prompts = tiny_prompts(3)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = llm.generate(prompts, params)

    ckpt = load_checkpoint(tiny_dir)
    dense = build_native_model(ckpt.architecture, ckpt.config, ckpt.weights(), "float32")
    for prompt, out in zip(prompts, outs):
        seq = prompt["prompt_token_ids"] + out.outputs[0].token_ids
        ids = paddle.to_tensor(np.asarray(seq, dtype=np.int64))
        with paddle.no_grad():
            logits = dense.compute_logits(dense(ids, paddle.arange(len(seq), dtype="int64"))).numpy()
        ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        n = len(prompt["prompt_token_ids"])
        for i, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            assert tok == int(np.argmax(ref[n - 1 + i])), f"greedy token {i} differs from dense argmax"
            assert abs(lp[tok].logprob - ref[n - 1 + i, tok]) < 1e-4
            assert lp[tok].rank == 1
        assert out.prompt_logprobs[0] is None
        for pos in range(1, n):
            target = seq[pos]
            assert abs(out.prompt_logprobs[pos][target].logprob - ref[pos - 1, target]) < 1e-4


@pytest.fixture(scope="module")
def baseline(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    return token_ids(llm.generate(tiny_prompts(8), GREEDY))


@pytest.mark.parametrize("settings", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 1},
    {"max_num_batched_tokens": 7},
    {"max_num_batched_tokens": 64},
    {"max_num_seqs": 3},
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_greedy_is_schedule_independent(tiny_dir, baseline, settings):
    llm = LLM(model=tiny_dir, block_size=4, **settings)
    assert token_ids(llm.generate(tiny_prompts(8), GREEDY)) == baseline


def test_batch_of_8_equals_one_by_one(tiny_dir, baseline):
    llm = LLM(model=tiny_dir, block_size=4)
    one_by_one = [token_ids(llm.generate(p, GREEDY))[0] for p in tiny_prompts(8)]
    assert one_by_one == baseline


def test_preemption_keeps_greedy_output(tiny_dir, baseline):
    # 2 layers x 2 KV heads x 4 tokens x 16 dims x fp32 x (K+V) = 2 KiB per block; 14 blocks total,
    # while 8 requests of ~32 tokens want ~64 blocks: requests must be preempted and recomputed.
    llm = LLM(model=tiny_dir, block_size=4, kv_cache_memory=14 * 2048)
    kinds = []
    llm.subscribe(lambda e: kinds.append(e.kind))
    assert token_ids(llm.generate(tiny_prompts(8), GREEDY)) == baseline
    assert kinds.count("request_preempted") > 0
    snap = llm.snapshot()
    assert all(b.ref_cnt == 0 for b in snap.blocks) and not snap.requests


def test_prefix_cache_hit_counts_full_blocks_and_skips_compute(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4)
    steps = []
    llm.subscribe(lambda e: steps.append(e.data["num_tokens"]) if e.kind == "step" else None)
    shared = list(range(10, 24))                      # 14 tokens: 3 full blocks of 4
    first = llm.generate({"prompt_token_ids": shared + [30, 31]}, GREEDY)[0]
    computed_first = steps[0]
    steps.clear()
    second = llm.generate({"prompt_token_ids": shared + [40, 41, 42]}, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 3 * 4
    assert steps[0] == len(second.prompt_token_ids) - 12 < computed_first
    stats = llm.snapshot().prefix_cache
    assert stats.hits == 12 and stats.queries == 16 + 17


def test_step_events_tell_decode_from_prefill(tiny_dir):
    llm = LLM(model=tiny_dir, block_size=4, max_num_batched_tokens=8)
    steps = []
    llm.subscribe(lambda e: steps.append(e.data) if e.kind == "step" else None)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    rid = llm.generate({"prompt_token_ids": list(range(10, 22))}, params)[0].request_id
    # 12 prompt tokens under a budget of 8: two prefill chunks (the second samples token 1), then 3 decodes
    assert [s["prefill"] for s in steps] == [{rid: 8}, {rid: 4}, {}, {}, {}]
    assert [s["decode"] for s in steps] == [[], [], [rid], [rid], [rid]]
    assert llm.snapshot().last_step.decode == (rid,) and llm.snapshot().last_step.prefill == {}
