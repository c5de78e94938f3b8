"""The captured decode step of a borrowed model: its decode steps on the engine's fused CPU kernel.

Our analogue of FastDeploy's CUDA Graph for this backend. An eager decode
step of a PaddleFormers Llama runs ~1,600 Paddle ops (SmolLM2-135M, 30
layers), each dispatched from Python; the native model's decode step is one
Numba call (``engine.fused_decode``, ``gpu_kernels.cpu.decode_step``). That
kernel computes a decoder layer from a handful of arrays and flags (norm
weights, fused QKV / gate-up / O / down linears, optional QKV bias and Q/K
head norms, rotate-half RoPE tables per layer, a sliding window per layer,
SiLU or GELU, Llama's pre-norm layer or Gemma 3's norms around attention and
MLP, an embedding scale, the attention scale, logit soft-capping), and a
borrowed model whose layers are that computation can hand it those arrays:
`describe_decoder` reads them from the library's own modules (the Q/K/V and
gate/up products `fusion` fused, or the library's own fused ``qkv_proj`` /
``up_gate_proj``: the very parameters the eager forward multiplies by,
zero-copy) into a `DecoderView`, the duck-typed stand-in for the native model
that ``FusedDecode`` reads, and the facts into its `DecoderSpec` -- the same
description the native loader builds from a config (Gemma's ``1 + w`` norms as
``norm_offset=1``, which the fused step packs as the native model's are packed).

PaddleFormers stays the definition of the architecture. The reading is
gated twice:

1. **structure** -- every decoder layer holds exactly the kernel's parts
   (RMSNorms -- PaddleFormers' or Gemma 3's --, one Q/K/V and one gate/up
   product, unbiased O / down projections, a SiLU or tanh-GELU activation),
   all layers alike; the RoPE tables are what the model's own rotary
   embeddings (Gemma 3's local one on its sliding layers, `fixups`) return
   for positions ``0 .. max_position_embeddings - 1``;
2. **numbers** -- `verify` runs a few tokens of prefill and one decode step of
   the eager library forward and of the kernel on the same throwaway cache and
   requires the same hidden states (and of `engine.fused_prefill` on the same
   prefill, which else stays eager alone). An architecture that departs in anything
   the structure check cannot see (an embedding scale it does not expose,
   interleaved RoPE, a different residual) fails here, at load, and keeps the
   eager path, with the reason in the log and in the runner's ``decode_path``.

Prefill and mixed steps run the same view through `engine.fused_prefill`
(the products through the routines the eager layers call, the rest as host
kernels instead of some forty Paddle calls a layer); the engine's
``cpu_decode="paddle"`` setting runs every step through the library's eager
forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import paddle

from ..models.spec import DecoderSpec
from .fusion import FusedLinear, ProjectionSlice

logger = logging.getLogger("engine")

LAYER_PARTS = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
SANDWICH_PARTS = {"pre_feedforward_layernorm", "post_feedforward_layernorm"}  # Gemma 2/3
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "fused_qkv", "qkv_proj", "q_norm", "k_norm"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "fused_gate_up", "up_gate_proj", "act_fn"}
PROBE_TOKENS = 5
TOLERANCE = 1e-4  # max |hidden eager - hidden captured| relative to max |hidden eager|


@dataclass
class DecoderView:
    """What ``engine.fused_decode.FusedDecode`` reads from a native ``LlamaForCausalLM``, read from a borrowed one."""

    spec: DecoderSpec
    layers: list
    embed_tokens: SimpleNamespace
    norm: SimpleNamespace
    rope: list          # per layer: its cos/sin tables (shared between layers of one rotary embedding)
    lm_head_blocks: object | None
    fused_prefill: bool = True  # `engine.fused_prefill` runs its prefill steps (False when the probe says no)


def _linear(layer) -> SimpleNamespace:
    return SimpleNamespace(weight=layer.weight, bias=getattr(layer, "bias", None),
                           block_weight=getattr(layer, "block_weight", None))


def _norm(layer, kind: str) -> tuple[paddle.Tensor, float, float]:
    """An RMSNorm's weight, epsilon and offset (the spec's ``norm_offset``): PaddleFormers'
    ``RMSNorm`` (``x * w``: 0) or Gemma 3's (``x * (1 + w)``: 1)."""
    from paddleformers.nn.norm import RMSNorm

    if type(layer) is RMSNorm:
        if getattr(layer, "bias", None) is not None:
            raise _NotCapturable(f"{kind} has a bias")
        return layer.weight, float(layer.variance_epsilon), 0.0
    if type(layer) in _unit_offset_norms():
        return layer.weight, float(layer.eps), 1.0
    raise _NotCapturable(f"{kind} is {type(layer).__name__}, not an RMSNorm the kernel computes")


def _unit_offset_norms() -> tuple[type, ...]:
    try:
        from paddleformers.transformers.gemma3_text.modeling import Gemma3RMSNorm, Gemma3RMSNormPipe
    except ImportError:
        return ()
    return Gemma3RMSNorm, Gemma3RMSNormPipe  # the Pipe variant's forward unwraps a tuple, then is its parent's


def _activation(mlp, i: int) -> str:
    """The gated MLP's activation by its module: SiLU, or GELU's tanh approximation (Gemma)."""
    from paddleformers.transformers.activations import PaddleGELUTanh

    act = getattr(mlp, "act_fn", None)
    if getattr(mlp, "fuse_swiglu", False) or act is None or type(act) is paddle.nn.Silu:
        return "silu"
    if type(act) is PaddleGELUTanh:
        return "gelu_pytorch_tanh"
    raise _NotCapturable(f"layer {i}'s MLP activation is {type(act).__name__}, not SiLU or GELU (tanh)")


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


def _qkv(attn, i: int) -> tuple[object, bool]:
    """Layer ``i``'s one Q/K/V linear and whether its outputs are grouped per KV head.

    Ours (`fusion`: ``fused_qkv``, all queries | all keys | all values), or the library's own
    ``qkv_proj`` (Gemma 3, ERNIE 4.5), which holds per KV head its query heads, key and value
    (``weights.fuse_qkv``, the ``fused_qkv`` rule it splits by)."""
    fused = getattr(attn, "fused_qkv", None)
    if isinstance(fused, FusedLinear):
        if not all(isinstance(getattr(attn, n, None), ProjectionSlice) for n in ("q_proj", "k_proj", "v_proj")):
            raise _NotCapturable(f"layer {i}'s q/k/v projections are not the fused product's slices")
        return fused, False
    own = getattr(attn, "qkv_proj", None)
    if type(own) is paddle.nn.Linear and not hasattr(attn, "q_proj"):
        return own, True
    raise _NotCapturable(f"layer {i}'s Q/K/V are not fused (engine.fallback.fusion)")


def _gate_up(mlp, i: int):
    """Layer ``i``'s one gate/up linear (``[gate | up]``): ours (`fusion`) or the library's ``up_gate_proj``."""
    fused = getattr(mlp, "fused_gate_up", None)
    if isinstance(fused, FusedLinear):
        return fused
    own = getattr(mlp, "up_gate_proj", None)
    if type(own) is paddle.nn.Linear and not hasattr(mlp, "gate_proj"):
        return own
    raise _NotCapturable(f"layer {i}'s gate/up are not fused (engine.fallback.fusion)")


def _describe(wrapped) -> DecoderView:
    model, body, config = wrapped.model, wrapped.body, wrapped.config
    embed = getattr(body, "embed_tokens", None)
    norm = getattr(body, "norm", None)
    rotary = getattr(body, "rotary_emb", None)
    if embed is None or norm is None or rotary is None:
        raise _NotCapturable(f"{type(body).__name__} has no embed_tokens / norm / rotary_emb")
    local_rotary = getattr(body, "rotary_emb_local", None)  # Gemma 3's sliding layers' (`fixups`)
    layers, rotaries, windows, eps, offsets = [], [], [], set(), set()
    kinds = dict(qk_norm=set(), qkv_bias=set(), grouped=set(), sandwich=set(), activation=set(), scale=set())
    for i, layer in enumerate(body.layers):
        names = _sublayer_names(layer)
        sandwich = SANDWICH_PARTS <= names
        if names != LAYER_PARTS | (SANDWICH_PARTS if sandwich else set()):
            raise _NotCapturable(f"decoder layer {i} ({type(layer).__name__}) has parts {sorted(names)}")
        attn, mlp = layer.self_attn, layer.mlp
        if _sublayer_names(attn) - ATTENTION_PARTS or _sublayer_names(mlp) - MLP_PARTS:
            raise _NotCapturable(f"layer {i}'s attention / MLP has parts the kernel lacks: "
                                 f"{sorted((_sublayer_names(attn) - ATTENTION_PARTS) | (_sublayer_names(mlp) - MLP_PARTS))}")
        qkv, grouped = _qkv(attn, i)
        gate_up = _gate_up(mlp, i)
        if gate_up.bias is not None or getattr(attn.o_proj, "bias", None) is not None \
                or getattr(mlp.down_proj, "bias", None) is not None:
            raise _NotCapturable(f"layer {i} has biases outside Q/K/V")
        if type(attn.o_proj) is not paddle.nn.Linear or type(mlp.down_proj) is not paddle.nn.Linear:
            raise _NotCapturable(f"layer {i}'s o_proj / down_proj are not paddle.nn.Linear")
        has_norms = hasattr(attn, "q_norm")
        sliding = getattr(layer, "attention_type", None) == "sliding_attention"
        windows.append(int(getattr(attn, "sliding_window", None) or 0))
        rotaries.append(local_rotary if sliding and local_rotary is not None else rotary)
        for key, value in (("qk_norm", has_norms), ("qkv_bias", qkv.bias is not None), ("grouped", grouped),
                           ("sandwich", sandwich), ("activation", _activation(mlp, i)),
                           ("scale", getattr(attn, "scaling", None))):
            kinds[key].add(value)
        norm_names = ["input_layernorm", "post_attention_layernorm"] + (
            ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if sandwich else [])
        view = SimpleNamespace(self_attn=SimpleNamespace(qkv_proj=_linear(qkv), o_proj=_linear(attn.o_proj)),
                               mlp=SimpleNamespace(gate_up_proj=_linear(gate_up), down_proj=_linear(mlp.down_proj)))
        for name in norm_names:  # input, post-attention[, pre-feedforward, post-feedforward]
            weight, e, offset = _norm(getattr(layer, name), f"layer {i} {name}")
            setattr(view, name, SimpleNamespace(weight=weight))
            eps.add(e)
            offsets.add(offset)
        if has_norms:
            for name in ("q_norm", "k_norm"):
                weight, e, offset = _norm(getattr(attn, name), f"layer {i} {name}")
                setattr(view.self_attn, name, SimpleNamespace(weight=weight))
                eps.add(e)
                offsets.add(offset)
        layers.append(view)
    mixed = [key for key, values in kinds.items() if len(values) > 1]
    if mixed:
        raise _NotCapturable(f"layers differ in {', '.join(mixed)}")
    final_weight, final_eps, final_offset = _norm(norm, "the final norm")
    eps.add(final_eps)
    offsets.add(final_offset)
    if len(eps) > 1:
        raise _NotCapturable(f"norms differ in epsilon ({sorted(eps)})")
    if len(offsets) > 1:
        raise _NotCapturable(f"norms differ in their weight's offset ({sorted(offsets)})")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = wrapped.head_dim
    if layers and tuple(layers[0].self_attn.qkv_proj.weight.shape)[1] != (heads + 2 * kv_heads) * head_dim:
        raise _NotCapturable("the fused Q/K/V width is not (heads + 2 kv_heads) * head_dim")
    one = {key: next(iter(values)) if values else None for key, values in kinds.items()}
    embed_scale = getattr(embed, "embed_scale", None)  # Gemma's scaled embedding (a float32 buffer)
    spec = DecoderSpec(
        vocab_size=int(embed.weight.shape[0]), hidden_size=config.hidden_size,
        intermediate_size=int(layers[0].mlp.gate_up_proj.weight.shape[1]) // 2 if layers else 0,
        num_layers=len(layers), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=eps.pop(), norm_offset=offsets.pop(), sandwich_norms=bool(one["sandwich"]),
        qkv_bias=bool(one["qkv_bias"]), qk_norm=bool(one["qk_norm"]), grouped_qkv=bool(one["grouped"]),
        attn_scale=None if one["scale"] is None else float(one["scale"]),
        sliding_windows=tuple(windows) if any(windows) else (), **_rope_facts(config, local_rotary),
        activation=one["activation"] or "silu",
        embed_scale=1.0 if embed_scale is None else float(embed_scale.astype("float32")),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        final_logit_softcapping=float(wrapped.softcap) if wrapped.softcap else None)
    head = getattr(model, "lm_head", None)
    head_blocks = wrapped.lm_head_blocks if getattr(head, "bias", None) is None else None
    tables = {}
    for r in rotaries:
        if id(r) not in tables:
            tables[id(r)] = _rope_tables(r, embed.weight, config.max_position_embeddings)
    return DecoderView(spec=spec, layers=layers, embed_tokens=SimpleNamespace(weight=embed.weight),
                       norm=SimpleNamespace(weight=final_weight), rope=[tables[id(r)] for r in rotaries],
                       lm_head_blocks=head_blocks)


def _rope_facts(config, local_rotary) -> dict:
    """The spec's RoPE facts as the config states them (the kernel reads the tables the library's
    rotary embeddings compute, `_rope_tables`; the probe checks them)."""
    theta = getattr(config, "rope_theta", None)
    scaling = getattr(config, "rope_scaling", None)
    local = getattr(config, "rope_local_base_freq", None) if local_rotary is not None else None
    return dict(rope_theta=float(theta) if isinstance(theta, (int, float)) and theta > 0 else 10000.0,
                rope_scaling=scaling if isinstance(scaling, dict) else None,
                local_rope_theta=float(local) if local else None)


def _rope_tables(rotary, like: paddle.Tensor, max_positions: int) -> SimpleNamespace:
    """cos/sin ``[max_positions, head_dim]`` from the model's own rotary embedding."""
    with paddle.no_grad():
        positions = paddle.arange(max_positions, dtype="int64").unsqueeze(0)
        cos, sin = rotary(like[:1].unsqueeze(0), positions)
    cos, sin = cos.reshape([max_positions, -1]), sin.reshape([max_positions, -1])
    return SimpleNamespace(cos=cos.astype("float32").contiguous(), sin=sin.astype("float32").contiguous())


def verify(wrapped, view: DecoderView) -> str | None:
    """None when the kernel's decode step gives the eager forward's hidden states on a probe, else why not.
    The captured prefill (`engine.fused_prefill`) is checked on the probe's prefill too; where it departs,
    ``view.fused_prefill`` becomes False and prefill steps stay eager."""
    from ..attention import AttentionMetadata
    from ..fused_decode import FusedDecode
    from ..fused_prefill import FusedPrefill
    from ..step_record import StepRecord

    layers, kv_heads, head_dim = wrapped.kv_layout()
    block = 8
    caches = [(paddle.zeros([1, kv_heads, block, head_dim], dtype="float32"),
               paddle.zeros([1, kv_heads, block, head_dim], dtype="float32")) for _ in range(layers)]
    vocab = view.spec.vocab_size
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
        eager_prefill = wrapped.forward(paddle.to_tensor(tokens[:PROBE_TOKENS]), m.positions, m, caches).numpy()
        m = meta(PROBE_TOKENS, PROBE_TOKENS + 1)
        last = paddle.to_tensor(tokens[PROBE_TOKENS:])
        eager = wrapped.forward(last, m.positions, m, caches).numpy()
        fused = FusedDecode(SimpleNamespace(fused_decoder=view), caches)
        fused.threads = 1
        captured = fused.forward(last, m).numpy()
        # the prefill on the decode step's arrays, rewriting the probe's first K/V (the decode is compared)
        pos = np.arange(PROBE_TOKENS, dtype=np.int64)   # one request in block 0, as `meta(0, PROBE_TOKENS)`
        captured_prefill = FusedPrefill(view, fused).forward(StepRecord(
            ids=tokens[:PROBE_TOKENS], positions=pos, slots=pos, block_tables=np.zeros((1, 1), np.int32),
            context_lens=np.array([PROBE_TOKENS], np.int32), starts=np.array([0, PROBE_TOKENS], np.int32),
            rows=np.zeros(0, np.int64), num_prompt_rows=0))
    err = _departure(eager, captured)
    if err > TOLERANCE:
        return (f"the captured decode step departs from the eager PaddleFormers forward on a probe "
                f"(max |Δ hidden| / max |hidden| = {err:.2e} > {TOLERANCE:.0e})")
    err = _departure(eager_prefill, captured_prefill)
    if err > TOLERANCE:
        view.fused_prefill = False
        logger.info("prefill steps stay eager: the captured prefill departs from the eager forward on a probe "
                    "(max |Δ hidden| / max |hidden| = %.2e > %.0e)", err, TOLERANCE)
    return None


def _departure(eager: np.ndarray, captured: np.ndarray) -> float:
    """max |eager - captured| / max |eager| (inf when not finite)."""
    scale = max(float(np.abs(eager).max()), 1e-6)
    err = float(np.abs(eager - captured).max()) / scale
    return err if np.isfinite(err) else float("inf")


def capture(wrapped) -> DecoderView | str:
    """`describe_decoder` then `verify`: the view the fused step reads, or why the eager path stays."""
    try:
        view = describe_decoder(wrapped)
        if isinstance(view, str):
            return view
        return verify(wrapped, view) or view
    except Exception as exc:  # noqa: BLE001 -- any failure keeps the eager path, and says why
        return f"the captured decode step could not be built: {exc!r}"
