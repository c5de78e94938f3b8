"""The PaddleFormers backend's fused Q/K/V and gate/up (`fusion`) and its captured decode step (`captured`).

* fused projections compute what the separate library linears computed;
* decode steps of a borrowed Llama run on the engine's fused CPU kernel
  (``decode_path == "fused"``) and its prefill steps on the captured prefill
  (``prefill_path == "fused"``, `engine.fused_prefill`) with the greedy tokens
  of the eager library forward (``cpu_decode="paddle"``) and logprobs within
  1e-4 -- on a tiny model and on SmolLM2's quantized GGUF;
* Gemma 3's layers too (sandwich norms, GELU, sliding windows, a RoPE base
  per layer type, soft-capped logits);
* what the kernel cannot compute stays eager, with the reason: a forward the
  structure check cannot see fails the load-time probe.
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


BOTH_PATHS = {"paddle": "paddle", "paddle prefill": "paddle", "fused": "fused", "fused prefill": "fused"}


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
            snap = llm.snapshot()
            paths[decode] = snap.decode_path
            paths[decode + " prefill"] = snap.prefill_path
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
    assert paths == BOTH_PATHS
    assert_same_decoding(outputs["paddle"], outputs["fused"])


def test_captured_decode_matches_eager_on_smollm2_gguf():
    outputs, paths = generate_both_ways("smollm2-135m-instruct", PROMPTS, LOGPROBS)
    assert paths == BOTH_PATHS
    assert_same_decoding(outputs["paddle"], outputs["fused"])


def tiny_gemma3(directory, **config):
    """A tiny Gemma 3 (sandwich norms, (1 + w) norms, Q/K norms, GELU, scaled embeddings,
    query_pre_attn_scalar, Q/K/V grouped per KV head) whose local layers (window 4) and global
    layers rotate with different RoPE bases, and ``config`` on top."""
    import json

    path = make_tiny_model(directory, "Gemma3ForCausalLM", seed=3, sliding_window=4, layers=3)
    with open(f"{path}/config.json") as fh:
        c = json.load(fh)
    c.update({"rope_theta": 1_000_000.0, "query_pre_attn_scalar": 24, **config})
    with open(f"{path}/config.json", "w") as fh:
        json.dump(c, fh)
    return path


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_captured_decode_matches_eager_on_a_tiny_gemma3(tmp_path, softcap):
    """Prompts of 20-24 tokens, far past the local layers' window of 4."""
    tiny = tiny_gemma3(str(tmp_path / "gemma3"), final_logit_softcapping=softcap)
    outputs, paths = generate_both_ways(tiny, tiny_prompts(4), LOGPROBS, block_size=4)
    assert paths == BOTH_PATHS
    assert_same_decoding(outputs["paddle"], outputs["fused"])


def test_the_probe_sees_gemma3s_window_and_local_rope(tmp_path):
    """The load-time probe (6 tokens, window 4) rejects a description without the sliding
    window, or with the global RoPE tables on the local layers."""
    import dataclasses

    from engine.fallback.captured import describe_decoder, verify
    from engine.fallback.paddleformers import build_paddleformers_model

    wrapped = build_paddleformers_model(load_checkpoint(tiny_gemma3(str(tmp_path / "gemma3"))), "float32", "cpu")
    view = describe_decoder(wrapped)
    assert view.spec.sliding_windows == (4, 0, 4) and view.spec.grouped_qkv and view.spec.sandwich_norms
    assert view.spec.activation == "gelu_pytorch_tanh" and view.spec.attn_scale == 24 ** -0.5
    assert verify(wrapped, view) is None
    no_window = dataclasses.replace(view, spec=dataclasses.replace(view.spec, sliding_windows=()))
    assert "departs from the eager" in verify(wrapped, no_window)
    one_rope = dataclasses.replace(view, rope=[view.rope[1]] * 3)
    assert "departs from the eager" in verify(wrapped, one_rope)


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


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_captured_prefill_matches_eager_in_chunks_and_mixed_steps(tmp_path, arch):
    """Chunks of 5 tokens (a prompt spread over several steps, decodes of other requests in the same
    step) on prompts that share a prefix (prefix-cache hits): the captured prefill writes and reads
    the paged cache as the eager layers do; Gemma 3's local layers (window 4) see only their window."""
    tiny = (tiny_gemma3(str(tmp_path / "gemma3")) if arch == "Gemma3ForCausalLM"
            else make_tiny_model(str(tmp_path / "llama"), arch, seed=5))
    prompts = tiny_prompts(3) + tiny_prompts(1)   # the last repeats the first: a whole-prompt hit
    outputs, paths = generate_both_ways(tiny, prompts, LOGPROBS, block_size=4, max_num_batched_tokens=5,
                                        max_num_seqs=4)
    assert paths == BOTH_PATHS
    assert_same_decoding(outputs["paddle"], outputs["fused"])


def test_a_prefill_that_departs_stays_eager_while_decode_is_captured(tmp_path):
    """The probe checks the captured prefill on its own: a view whose gate/up product carries a bias
    the model does not have (the prefill adds a linear's bias, the decode kernel reads none there)
    keeps the captured decode and turns the captured prefill off."""
    from types import SimpleNamespace

    from engine.fallback.captured import describe_decoder, verify
    from engine.fallback.paddleformers import build_paddleformers_model

    wrapped = build_paddleformers_model(load_checkpoint(make_tiny_model(str(tmp_path / "llama"), seed=3)),
                                        "float32", "cpu")
    view = describe_decoder(wrapped)
    assert verify(wrapped, view) is None and view.fused_prefill
    mlp = view.layers[0].mlp
    width = int(mlp.gate_up_proj.weight.shape[1])
    mlp.gate_up_proj = SimpleNamespace(weight=mlp.gate_up_proj.weight, block_weight=None,
                                       bias=paddle.full([width], 0.5, dtype="float32"))
    assert verify(wrapped, view) is None          # the decode step still matches
    assert view.fused_prefill is False
