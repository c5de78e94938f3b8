"""The captured decode step of a borrowed model: its decode steps on the engine's fused CPU kernel.

Our analogue of FastDeploy's CUDA Graph for this backend. An eager decode
step of a PaddleFormers Llama runs ~1,600 Paddle ops (SmolLM2-135M, 30
layers), each dispatched from Python; the native model's decode step is one
Numba call (``engine.fused_decode``, ``gpu_kernels.cpu.decode_step``). That
kernel computes a pre-norm decoder layer from a handful of arrays (norm
weights, fused QKV / gate-up / O / down linears, optional QKV bias and Q/K
head norms, rotate-half RoPE tables), and a borrowed model whose layers are
that computation can hand it those arrays: `describe_decoder` reads them from
the library's own modules (after `fusion` fused Q/K/V and gate/up, the very
parameters the eager forward multiplies by, zero-copy) into a `DecoderView`,
the duck-typed stand-in for the native model that ``FusedDecode`` reads.

PaddleFormers stays the definition of the architecture. The reading is
gated twice:

1. **structure** -- every decoder layer holds exactly the kernel's parts
   (pre-norm RMSNorms, the Q/K/V and gate/up products fused, an unbiased O
   projection, SiLU MLP), no sliding window, no soft-capping; the RoPE tables
   are what the model's own ``rotary_emb`` returns for positions
   ``0 .. max_position_embeddings - 1``;
2. **numbers** -- `verify` runs a few tokens of prefill and one decode step of
   the eager library forward and of the kernel on the same throwaway cache and
   requires the same hidden states. An architecture that departs in anything
   the structure check cannot see (embedding scale, interleaved RoPE, a
   different residual) fails here, at load, and keeps the eager path, with the
   reason in the log and in the runner's ``decode_path``.

Prefill and mixed steps always run the library's eager forward; the engine's
``cpu_decode="paddle"`` setting runs every step there.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import paddle

from ..models.llama import DecoderConfig
from .fusion import FusedLinear, ProjectionSlice

LAYER_PARTS = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "fused_qkv", "q_norm", "k_norm"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "fused_gate_up", "act_fn"}
PROBE_TOKENS = 5
TOLERANCE = 1e-4  # max |hidden eager - hidden captured| relative to max |hidden eager|


@dataclass
class DecoderView:
    """What ``engine.fused_decode.FusedDecode`` reads from a native ``LlamaForCausalLM``, read from a borrowed one."""

    cfg: DecoderConfig
    layers: list
    embed_tokens: SimpleNamespace
    norm: SimpleNamespace
    rope: SimpleNamespace
    lm_head_blocks: object | None


def _linear(layer) -> SimpleNamespace:
    return SimpleNamespace(weight=layer.weight, bias=getattr(layer, "bias", None),
                           block_weight=getattr(layer, "block_weight", None))


def _rms_norm_weight(layer, kind: str):
    from paddleformers.nn.norm import RMSNorm

    if type(layer) is not RMSNorm:
        raise _NotCapturable(f"{kind} is {type(layer).__name__}, not PaddleFormers' RMSNorm")
    if getattr(layer, "bias", None) is not None:
        raise _NotCapturable(f"{kind} has a bias")
    return layer.weight


class _NotCapturable(Exception):
    pass


def _sublayer_names(layer) -> set[str]:
    return {name for name, _ in layer.named_children()}


def describe_decoder(wrapped) -> DecoderView | str:
    """The borrowed model's decoder as the fused kernel reads it, or why it cannot be."""
    try:
        return _describe(wrapped)
    except _NotCapturable as exc:
        return str(exc)


def _describe(wrapped) -> DecoderView:
    model, body, config = wrapped.model, wrapped.body, wrapped.config
    if wrapped.softcap:
        raise _NotCapturable("final_logit_softcapping")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise _NotCapturable(f"hidden_act is {config.hidden_act}")
    embed = getattr(body, "embed_tokens", None)
    norm = getattr(body, "norm", None)
    rotary = getattr(body, "rotary_emb", None)
    if embed is None or norm is None or rotary is None:
        raise _NotCapturable(f"{type(body).__name__} has no embed_tokens / norm / rotary_emb")
    layers, eps, qk_norm, qkv_bias = [], None, None, None
    for i, layer in enumerate(body.layers):
        extra = _sublayer_names(layer) - LAYER_PARTS
        if extra or not LAYER_PARTS <= _sublayer_names(layer):
            raise _NotCapturable(f"decoder layer {i} ({type(layer).__name__}) has parts {sorted(_sublayer_names(layer))}")
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "sliding_window", None):
            raise _NotCapturable(f"layer {i} attends through a sliding window")
        if _sublayer_names(attn) - ATTENTION_PARTS or _sublayer_names(mlp) - MLP_PARTS:
            raise _NotCapturable(f"layer {i}'s attention / MLP has parts the kernel lacks: "
                                 f"{sorted((_sublayer_names(attn) - ATTENTION_PARTS) | (_sublayer_names(mlp) - MLP_PARTS))}")
        qkv, gate_up = getattr(attn, "fused_qkv", None), getattr(mlp, "fused_gate_up", None)
        if not isinstance(qkv, FusedLinear) or not isinstance(gate_up, FusedLinear):
            raise _NotCapturable(f"layer {i}'s Q/K/V or gate/up are not fused (engine.fallback.fusion)")
        if not all(isinstance(getattr(attn, n), ProjectionSlice) for n in ("q_proj", "k_proj", "v_proj")):
            raise _NotCapturable(f"layer {i}'s q/k/v projections are not the fused product's slices")
        if gate_up.bias is not None or getattr(attn.o_proj, "bias", None) is not None \
                or getattr(mlp.down_proj, "bias", None) is not None:
            raise _NotCapturable(f"layer {i} has biases outside Q/K/V")
        if type(getattr(mlp, "act_fn", paddle.nn.Silu())) is not paddle.nn.Silu:
            raise _NotCapturable(f"layer {i}'s MLP activation is {type(mlp.act_fn).__name__}, not SiLU")
        if type(attn.o_proj) is not paddle.nn.Linear or type(mlp.down_proj) is not paddle.nn.Linear:
            raise _NotCapturable(f"layer {i}'s o_proj / down_proj are not paddle.nn.Linear")
        has_norms = hasattr(attn, "q_norm")
        qk_norm = has_norms if qk_norm is None else qk_norm
        qkv_bias = (qkv.bias is not None) if qkv_bias is None else qkv_bias
        if has_norms != qk_norm or (qkv.bias is not None) != qkv_bias:
            raise _NotCapturable("layers differ in Q/K norms or QKV bias")
        view = SimpleNamespace(
            input_layernorm=SimpleNamespace(weight=_rms_norm_weight(layer.input_layernorm, f"layer {i} input norm")),
            post_attention_layernorm=SimpleNamespace(
                weight=_rms_norm_weight(layer.post_attention_layernorm, f"layer {i} post-attention norm")),
            self_attn=SimpleNamespace(qkv_proj=_linear(qkv), o_proj=_linear(attn.o_proj)),
            mlp=SimpleNamespace(gate_up_proj=_linear(gate_up), down_proj=_linear(mlp.down_proj)))
        if has_norms:
            view.self_attn.q_norm = SimpleNamespace(weight=_rms_norm_weight(attn.q_norm, f"layer {i} q_norm"))
            view.self_attn.k_norm = SimpleNamespace(weight=_rms_norm_weight(attn.k_norm, f"layer {i} k_norm"))
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([attn.q_norm, attn.k_norm] if has_norms else [])
        for n in norms:
            eps = n.variance_epsilon if eps is None else eps
            if n.variance_epsilon != eps:
                raise _NotCapturable("norms differ in epsilon")
        layers.append(view)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = wrapped.head_dim
    if layers and tuple(layers[0].self_attn.qkv_proj.weight.shape)[1] != (heads + 2 * kv_heads) * head_dim:
        raise _NotCapturable("the fused Q/K/V width is not (heads + 2 kv_heads) * head_dim")
    cfg = DecoderConfig(
        vocab_size=int(embed.weight.shape[0]), hidden_size=config.hidden_size,
        intermediate_size=int(layers[0].mlp.gate_up_proj.weight.shape[1]) // 2 if layers else 0,
        num_layers=len(layers), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(_rms_norm_epsilon(norm) if eps is None else eps), rope_theta=0.0, rope_scaling=None,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bool(qkv_bias), qk_norm=bool(qk_norm))
    if _rms_norm_epsilon(norm) != cfg.rms_norm_eps:
        raise _NotCapturable("the final norm's epsilon differs from the layers'")
    _rms_norm_weight(norm, "the final norm")
    head = getattr(model, "lm_head", None)
    head_blocks = wrapped.lm_head_blocks if getattr(head, "bias", None) is None else None
    return DecoderView(cfg=cfg, layers=layers, embed_tokens=SimpleNamespace(weight=embed.weight),
                       norm=SimpleNamespace(weight=norm.weight), rope=_rope_tables(rotary, embed.weight,
                                                                                    config.max_position_embeddings),
                       lm_head_blocks=head_blocks)


def _rms_norm_epsilon(norm) -> float:
    return norm.variance_epsilon


def _rope_tables(rotary, like: paddle.Tensor, max_positions: int) -> SimpleNamespace:
    """cos/sin ``[max_positions, head_dim]`` from the model's own rotary embedding."""
    with paddle.no_grad():
        positions = paddle.arange(max_positions, dtype="int64").unsqueeze(0)
        cos, sin = rotary(like[:1].unsqueeze(0), positions)
    cos, sin = cos.reshape([max_positions, -1]), sin.reshape([max_positions, -1])
    return SimpleNamespace(cos=cos.astype("float32").contiguous(), sin=sin.astype("float32").contiguous())


def verify(wrapped, view: DecoderView) -> str | None:
    """None when the kernel's decode step gives the eager forward's hidden states on a probe, else why not."""
    from ..attention import AttentionMetadata
    from ..fused_decode import FusedDecode

    layers, kv_heads, head_dim = wrapped.kv_layout()
    block = 8
    caches = [(paddle.zeros([1, kv_heads, block, head_dim], dtype="float32"),
               paddle.zeros([1, kv_heads, block, head_dim], dtype="float32")) for _ in range(layers)]
    vocab = view.cfg.vocab_size
    tokens = (np.arange(PROBE_TOKENS + 1, dtype=np.int64) * 7919 + 11) % vocab

    def meta(lo, hi):
        pos = np.arange(lo, hi, dtype=np.int64)
        return AttentionMetadata(
            positions=paddle.to_tensor(pos), slot_mapping=paddle.to_tensor(pos),
            block_tables=paddle.zeros([1, 1], dtype="int32"),
            context_lens=paddle.to_tensor(np.array([hi], np.int32)),
            query_start_loc=paddle.to_tensor(np.array([0, hi - lo], np.int32)),
            decode_only=hi - lo == 1, num_tokens=hi - lo)

    with paddle.no_grad():
        m = meta(0, PROBE_TOKENS)
        wrapped.forward(paddle.to_tensor(tokens[:PROBE_TOKENS]), m.positions, m, caches)
        m = meta(PROBE_TOKENS, PROBE_TOKENS + 1)
        last = paddle.to_tensor(tokens[PROBE_TOKENS:])
        eager = wrapped.forward(last, m.positions, m, caches).numpy()
        fused = FusedDecode(SimpleNamespace(fused_decoder=view), caches)
        fused.threads = 1
        captured = fused.forward(last, m).numpy()
    scale = max(float(np.abs(eager).max()), 1e-6)
    err = float(np.abs(eager - captured).max()) / scale
    if not np.isfinite(err) or err > TOLERANCE:
        return (f"the captured decode step departs from the eager PaddleFormers forward on a probe "
                f"(max |Δ hidden| / max |hidden| = {err:.2e} > {TOLERANCE:.0e})")
    return None


def capture(wrapped) -> DecoderView | str:
    """`describe_decoder` then `verify`: the view the fused step reads, or why the eager path stays."""
    try:
        view = describe_decoder(wrapped)
        if isinstance(view, str):
            return view
        return verify(wrapped, view) or view
    except Exception as exc:  # noqa: BLE001 -- any failure keeps the eager path, and says why
        return f"the captured decode step could not be built: {exc!r}"
