"""One description of a decoder (`DecoderSpec`), read by the Paddle layers and the fused decode step alike.

* every behaviour field of the spec, flipped on a tiny model, changes the Paddle layers' decode
  step and the fused kernel's identically (logits within 1e-4 of each other) and changes the
  output (or, for ``grouped_qkv`` and ``norm_offset``, other storage of the same numbers, leaves
  it unchanged) -- a field that one path read and the other ignored would diverge here; a field
  without a flip fails;
* the spec the PaddleFormers backend reads from a borrowed Gemma 3 (`captured.describe_decoder`),
  given to the native builder with the checkpoint's weights, computes the library's eager logits;
* a spec that cannot be computed is refused, naming the field, before any model is built.
"""

import dataclasses
import zlib

import numpy as np
import paddle
import pytest

from engine.attention import AttentionMetadata
from engine.fused_decode import FusedDecode
from engine.models import build_native_model
from engine.models.spec import BEHAVIOUR, DecoderSpec
from tiny_models import make_tiny_model, packed_prefill_step

BASE = DecoderSpec(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position_embeddings=64)
# field -> (flipped value, other fields set on both sides of the comparison, whether the output changes)
FLIPS = {
    "rms_norm_eps": (0.5, {}, True),
    "norm_offset": (1.0, {}, False),  # the same multipliers, stored as w - 1 (`hf_weights`)
    "sandwich_norms": (True, {}, True),
    "qkv_bias": (True, {}, True),
    "qk_norm": (True, {}, True),
    "grouped_qkv": (True, {"qkv_bias": True}, False),  # the same weights laid out per KV head
    "attn_scale": (0.05, {}, True),
    "sliding_windows": ((4, 0), {}, True),
    "rope_theta": (50.0, {}, True),
    "rope_scaling": ({"rope_type": "linear", "factor": 4.0}, {}, True),
    "local_rope_theta": (7.0, {"sliding_windows": (4, 0)}, True),
    "rope_interleaved": (True, {}, True),
    "activation": ("gelu_pytorch_tanh", {}, True),
    "embed_scale": (3.0, {}, True),
    "tie_word_embeddings": (True, {}, True),
    "final_logit_softcapping": (2.0, {}, True),
}
PROMPT = 10  # past the window of 4


def hf_weights(spec: DecoderSpec):
    """HF-named weights for ``spec``, each tensor the same whichever spec asks for it (seeded by name)."""
    def w(name, *shape, std=0.2, mean=0.0):
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        return (mean + rng.standard_normal(shape) * std).astype(np.float32)

    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    norm_mean = 1.0 - spec.norm_offset  # multiplied near 1 either way
    out = {"model.embed_tokens.weight": w("embed", spec.vocab_size, h, std=1.0),
           "model.norm.weight": w("norm", h, mean=norm_mean, std=0.1)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = w("lm_head", spec.vocab_size, h, std=0.5)
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        out.update({p + "self_attn.q_proj.weight": w(p + "q", spec.num_heads * d, h),
                    p + "self_attn.k_proj.weight": w(p + "k", spec.num_kv_heads * d, h),
                    p + "self_attn.v_proj.weight": w(p + "v", spec.num_kv_heads * d, h),
                    p + "self_attn.o_proj.weight": w(p + "o", h, spec.num_heads * d),
                    p + "mlp.gate_proj.weight": w(p + "gate", i, h), p + "mlp.up_proj.weight": w(p + "up", i, h),
                    p + "mlp.down_proj.weight": w(p + "down", h, i)})
        norms = ["input_layernorm", "post_attention_layernorm"] + (
            ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if spec.sandwich_norms else [])
        out.update({p + n + ".weight": w(p + n, h, mean=norm_mean, std=0.1) for n in norms})
        if spec.qkv_bias:
            for proj, heads in (("q", spec.num_heads), ("k", spec.num_kv_heads), ("v", spec.num_kv_heads)):
                out[p + f"self_attn.{proj}_proj.bias"] = w(p + proj + "b", heads * d, std=0.3)
        if spec.qk_norm:
            for n in ("q_norm", "k_norm"):
                out[p + f"self_attn.{n}.weight"] = w(p + n, d, mean=norm_mean, std=0.2)
    return list(out.items())


def _meta(positions, slots, table, context):
    return AttentionMetadata(
        positions=paddle.to_tensor(np.asarray(positions, np.int64)),
        slot_mapping=paddle.to_tensor(np.asarray(slots, np.int64)),
        block_tables=paddle.to_tensor(np.asarray([table], np.int32)),
        context_lens=paddle.to_tensor(np.asarray([context], np.int32)),
        query_start_loc=paddle.to_tensor(np.asarray([0, len(positions)], np.int32)),
        decode_only=len(positions) == 1, num_tokens=len(positions))


def decode_both_ways(spec: DecoderSpec) -> tuple[np.ndarray, np.ndarray]:
    """Logits of one decode step after a ``PROMPT``-token prefill: the Paddle layers' and the fused kernel's."""
    model = build_native_model("LlamaForCausalLM", {}, hf_weights(spec), "float32", spec=spec)
    ids = (np.arange(PROMPT + 1) * 37 + 5) % spec.vocab_size
    meta, caches = packed_prefill_step([PROMPT], spec.num_kv_heads, spec.head_dim, block_size=4,
                                       layers=spec.num_layers)
    table = list(range(int(meta.block_tables.shape[1])))
    step = _meta([PROMPT], [PROMPT], table, PROMPT + 1)
    with paddle.no_grad():
        model(paddle.to_tensor(ids[:PROMPT]), meta.positions, meta, caches)
        copies = [(paddle.to_tensor(k.numpy()), paddle.to_tensor(v.numpy())) for k, v in caches]
        token = paddle.to_tensor(ids[PROMPT:])
        paddle_logits = model.compute_logits(model(token, step.positions, step, caches)).numpy()
        fused = FusedDecode(model, copies)
        fused.threads = 1
        fused_logits = model.compute_logits(fused.forward(token, step)).numpy()
    return paddle_logits, fused_logits


def test_every_behaviour_field_has_a_flip():
    assert set(FLIPS) == set(BEHAVIOUR), "a DecoderSpec field without a flip here is read by no test"


@pytest.mark.parametrize("field", sorted(FLIPS))
def test_a_flipped_field_changes_both_paths_identically(field):
    value, both, changes = FLIPS[field]
    base = dataclasses.replace(BASE, **both)
    flipped = dataclasses.replace(base, **{field: value})
    base_paddle, base_fused = decode_both_ways(base)
    paddle_out, fused_out = decode_both_ways(flipped)
    scale = np.abs(paddle_out).max()
    assert np.abs(fused_out - paddle_out).max() <= 1e-4 * max(scale, 1.0)
    assert np.abs(base_fused - base_paddle).max() <= 1e-4 * max(np.abs(base_paddle).max(), 1.0)
    moved = np.abs(paddle_out - base_paddle).max()
    if changes:
        assert moved > 1e-3, f"{field}={value!r} did not change the output"
    else:
        assert moved <= 1e-4 * max(scale, 1.0)


def test_the_fallbacks_gemma3_spec_builds_the_native_decoder_of_the_same_numbers(tmp_path):
    """`describe_decoder` on PaddleFormers' Gemma 3 (sandwich and (1 + w) norms, Q/K norms, GELU,
    scaled embedding, query_pre_attn_scalar, Q/K/V grouped per KV head, window 4 and a local RoPE base
    on layers 0 and 2, soft-capped logits): the native decoder built from that spec and the
    checkpoint's weights computes the library's logits over a 12-token prompt."""
    import json

    from engine.fallback.captured import describe_decoder
    from engine.fallback.paddleformers import build_paddleformers_model
    from engine.loader import load_checkpoint

    path = make_tiny_model(str(tmp_path / "gemma3"), "Gemma3ForCausalLM", seed=3, sliding_window=4, layers=3)
    with open(f"{path}/config.json") as fh:
        config = json.load(fh)
    config.update(rope_theta=1_000_000.0, query_pre_attn_scalar=24, final_logit_softcapping=3.0)
    with open(f"{path}/config.json", "w") as fh:
        json.dump(config, fh)
    checkpoint = load_checkpoint(path)
    wrapped = build_paddleformers_model(checkpoint, "float32", "cpu")
    spec = describe_decoder(wrapped).spec
    assert (spec.norm_offset, spec.sandwich_norms, spec.grouped_qkv, spec.sliding_windows) == (1.0, True, True,
                                                                                               (4, 0, 4))
    assert spec.local_rope_theta == 10000.0 and spec.rope_theta == 1_000_000.0
    native = build_native_model("Gemma3ForCausalLM", checkpoint.config, checkpoint.weights("float32"), "float32",
                                spec=spec)
    ids = paddle.to_tensor((np.arange(12) * 29 + 7) % spec.vocab_size)
    logits = []
    for model in (wrapped, native):
        meta, caches = packed_prefill_step([12], spec.num_kv_heads, spec.head_dim, layers=spec.num_layers)
        with paddle.no_grad():
            logits.append(model.compute_logits(model.forward(ids, meta.positions, meta, caches)).numpy())
    assert np.abs(logits[0] - logits[1]).max() <= 1e-4 * np.abs(logits[0]).max()
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()


@pytest.mark.parametrize("change,message", [
    (dict(num_kv_heads=3), "num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(head_dim=0), "head_dim must be a positive integer; got 0"),
    (dict(activation="relu"), "activation 'relu' is not computed here; accepted: gelu_pytorch_tanh, silu"),
    (dict(sliding_windows=(4,)), "sliding_windows must be \\(\\) or 2 integers"),
    (dict(rope_theta=float("nan")), "rope_theta must be a finite number > 0"),
    (dict(attn_scale=-1.0), "attn_scale must be a finite number > 0 or None"),
])
def test_a_spec_that_cannot_be_computed_names_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **change)


def test_a_config_is_refused_by_field_before_any_model_is_built(monkeypatch):
    import engine.models as models

    built = []
    monkeypatch.setattr(models, "NATIVE_ARCHITECTURES", {name: built.append for name in models.NATIVE_ARCHITECTURES})
    config = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ValueError, match="no native implementation for MysteryForCausalLM; native architectures: "
                                         "LlamaForCausalLM, Qwen2ForCausalLM"):
        build_native_model("MysteryForCausalLM", config, iter(()), "float32")
    with pytest.raises(ValueError, match="LlamaForCausalLM config is missing num_attention_heads"):
        build_native_model("LlamaForCausalLM", {k: v for k, v in config.items() if k != "num_attention_heads"},
                           iter(()), "float32")
    with pytest.raises(ValueError, match="hidden_act='relu' has no native implementation"):
        build_native_model("Qwen2ForCausalLM", dict(config, hidden_act="relu"), iter(()), "float32")
    assert built == []
