"""The PaddleFormers backend's fused Q/K/V and gate/up (`fusion`) and its captured decode step (`captured`).

* fused projections compute what the separate library linears computed;
* decode steps of a borrowed Llama run on the engine's fused CPU kernel
  (``decode_path == "fused"``) with the greedy tokens of the eager library
  forward (``cpu_decode="paddle"``) and logprobs within 1e-4 -- on a tiny
  model and on SmolLM2's quantized GGUF;
* what the kernel cannot compute stays eager, with the reason: Gemma 3's
  layers by structure, a forward the structure check cannot see by the
  load-time probe.
"""

import numpy as np
import paddle
import pytest

from engine import LLM, SamplingParams
from engine.loader import load_checkpoint
from tiny_models import make_tiny_model, tiny_prompts

LOGPROBS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
PROMPTS = ["The capital of France is", "Question: What is 2+3?\nAnswer:", "Once upon a time",
           "def fibonacci(n):\n"]


def assert_same_decoding(reference, candidate, tol=1e-4):
    for ref, out in zip(reference, candidate):
        ids = out.outputs[0].token_ids
        assert ids == ref.outputs[0].token_ids
        for tok, lp_ref, lp in zip(ids, ref.outputs[0].logprobs, out.outputs[0].logprobs):
            assert abs(lp[tok].logprob - lp_ref[tok].logprob) <= tol


def generate_both_ways(model, prompts, params, **kwargs):
    outputs, paths = {}, {}
    for decode in ("paddle", "fused"):
        llm = LLM(model=model, model_impl="paddleformers", cpu_decode=decode, **kwargs)
        try:
            paths[decode] = llm.snapshot().decode_path
            outputs[decode] = llm.generate(prompts, params)
        finally:
            llm.shutdown()
    return outputs, paths


def test_fused_projections_compute_the_separate_linears():
    from engine.fallback.fusion import FusedLinear, ProjectionSlice, fuse_projections

    rng = np.random.default_rng(0)
    parent = paddle.nn.Layer()
    for name, out in (("q_proj", 12), ("k_proj", 4), ("v_proj", 4)):
        linear = paddle.nn.Linear(8, out)
        linear.weight.set_value(rng.standard_normal((8, out)).astype(np.float32))
        linear.bias.set_value(rng.standard_normal(out).astype(np.float32))
        setattr(parent, name, linear)
    x, y = (paddle.to_tensor(rng.standard_normal((3, 8)).astype(np.float32)) for _ in range(2))
    expected = {n: (getattr(parent, n)(x).numpy(), getattr(parent, n)(y).numpy()) for n in ("q_proj", "k_proj", "v_proj")}
    assert fuse_projections(parent) == {"fused_qkv": 1, "fused_gate_up": 0}
    assert isinstance(parent.fused_qkv, FusedLinear) and isinstance(parent.q_proj, ProjectionSlice)
    assert len(parent.parameters()) == 2  # the fused weight and bias only: memory unchanged
    for n in ("q_proj", "k_proj", "v_proj", "q_proj"):  # consecutive calls on x share one product
        np.testing.assert_allclose(getattr(parent, n)(x).numpy(), expected[n][0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(getattr(parent, n)(y).numpy(), expected[n][1], rtol=1e-5, atol=1e-5)


def test_captured_decode_matches_eager_on_a_tiny_llama(tmp_path):
    tiny = make_tiny_model(str(tmp_path / "llama"), "LlamaForCausalLM", seed=11)
    outputs, paths = generate_both_ways(tiny, tiny_prompts(4), LOGPROBS, block_size=4)
    assert paths == {"paddle": "paddle", "fused": "fused"}
    assert_same_decoding(outputs["paddle"], outputs["fused"])


def test_captured_decode_matches_eager_on_smollm2_gguf():
    outputs, paths = generate_both_ways("smollm2-135m-instruct", PROMPTS, LOGPROBS)
    assert paths == {"paddle": "paddle", "fused": "fused"}
    assert_same_decoding(outputs["paddle"], outputs["fused"])


def test_gemma3_layers_stay_eager_and_say_why(tmp_path):
    tiny = make_tiny_model(str(tmp_path / "gemma3"), "Gemma3ForCausalLM", seed=3)
    llm = LLM(model=tiny, model_impl="paddleformers")
    try:
        path = llm.snapshot().decode_path
    finally:
        llm.shutdown()
    assert path == "paddle (hidden_act is gelu_pytorch_tanh)"


def test_a_forward_the_kernel_does_not_compute_fails_the_probe(tmp_path):
    from engine.fallback.captured import capture, describe_decoder
    from engine.fallback.paddleformers import build_paddleformers_model

    wrapped = build_paddleformers_model(load_checkpoint(make_tiny_model(str(tmp_path / "llama"), seed=3)),
                                        "float32", "cpu")
    assert not isinstance(capture(wrapped), str)
    # an embedding scale (as Gemma has) is invisible to the structure check...
    wrapped.body.embed_tokens.register_forward_post_hook(lambda layer, args, out: out * 2.0)
    assert not isinstance(describe_decoder(wrapped), str)
    # ...and caught by the probe, which keeps the eager path
    reason = capture(wrapped)
    assert isinstance(reason, str) and "departs from the eager PaddleFormers forward" in reason
