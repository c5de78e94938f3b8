"""The fused CPU decode step: a decoder's decode layers as one Numba call.

``cpu_decode="fused"`` (``EngineConfig``) runs steps in which every scheduled
sequence has exactly one new token through ``gpu_kernels.cpu.decode_step``
instead of the Paddle layers. The kernel reads the very memory the Paddle model
holds -- zero-copy views of its parameters, of the block-quantized weights
(``engine.block_linear``) and of the runner's KV-cache tensors -- so both paths
compute with the same weights and share one cache. Q4_0 / Q4_1 / Q4_K weights are read
as nibbles (half the bytes of their int8 codes), packed once at start-up.

What it computes is the model's `DecoderSpec` (``engine.models.spec``), the
description the Paddle layers are built from too: the spec picks the kernel's
flags and how the weights are packed (norm weights as multiplied, ``offset + w``).
A model offers the fused step its ``fused_decoder``: the native model itself, or
a borrowed model's view of its layers (``engine.fallback.captured``), each with
its ``spec``, ``layers``, ``embed_tokens``, ``norm``, ``rope`` (per layer) and
``lm_head_blocks``.

Paddle stays the reference: ``cpu_decode="paddle"`` runs every step through the
Paddle layers. Prefill and mixed steps run there too, except for a borrowed model
whose captured decoder offers `engine.fused_prefill` (the same arrays, prepared here).
`fused_decode_support` says why the fast path does not apply to a model (GPU,
half-precision, a model with no ``fused_decoder``).
"""

from __future__ import annotations

import threading
import weakref

import numba
import numpy as np
import paddle
from numba import njit, types
from numba.typed import List

from gpu_kernels.cpu import decode_step as kernel, gated
from gpu_kernels.cpu.blas import single_threaded_blas
from gpu_kernels.cpu.sync import CONTROL_SIZE, OPEN, STRIDE, close_step, open_step
from gpu_kernels.interop import host_view

from .attention import AttentionMetadata
from .models.spec import DecoderSpec

_F1 = types.float32[::1]  # the type of an empty list (no Q/K norms, no QKV bias)
ACTIVATIONS = {"silu": gated.SILU, "gelu_pytorch_tanh": gated.GELU_TANH}  # DecoderSpec.activation -> kernel
MAX_THREADS = 8  # team size cap: a decode step of a small model has little work per phase


def fused_decode_support(model, kv_dtype: str, device: str, attention_backend: str | None = None) -> str | None:
    """None when the fused step can run ``model``, else the reason it cannot."""
    if device != "cpu":
        return f"device is {device}; the fused decode step is a CPU kernel"
    if attention_backend not in (None, "cpu"):
        return f"attention_backend is {attention_backend}; the fused decode step has the cpu kernel inside"
    if kv_dtype != "float32":
        return f"dtype is {kv_dtype}; the fused decode step computes in float32"
    decoder = decoder_of(model)
    if isinstance(decoder, str):
        return decoder
    if decoder.embed_tokens.weight.dtype != paddle.float32:
        return f"dtype is {kv_dtype}; the fused decode step computes in float32"
    return None


def decoder_of(model):
    """What the fused step reads: the model's ``fused_decoder`` (the native model itself, or a
    borrowed model's view of its decoder: ``engine.fallback.captured``); else the reason there is none."""
    decoder = getattr(model, "fused_decoder", None)
    if decoder is None:
        return f"{type(model).__name__} has no decoder the fused step reads (no fused_decoder)"
    if not isinstance(decoder, str) and not isinstance(getattr(decoder, "spec", None), DecoderSpec):
        return f"{type(model).__name__}'s fused_decoder has no DecoderSpec"
    return decoder


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """int8 codes 0..15 [out, blocks, 32] -> uint8 [out, blocks, 16], code j low, code j + 16 high."""
    c = codes.view(np.uint8)
    return np.ascontiguousarray(c[..., :16] | (c[..., 16:] << 4))


class FusedDecode:
    """Runs decode-only steps of a model's ``fused_decoder`` on its paged KV cache in one kernel call."""

    def __init__(self, model, kv_caches):
        model = decoder_of(model)
        if isinstance(model, str):
            raise ValueError(f"no fused decode step: {model}")
        spec = model.spec
        self.spec = spec
        if spec.activation not in ACTIVATIONS:
            raise ValueError(f"activation {spec.activation!r}: the fused decode step computes "
                             f"{sorted(ACTIVATIONS)}")
        single_threaded_blas()  # the kernel's work items already use every core
        self._keep = []  # tensors and arrays whose memory the kernel reads
        formats, float_w, codes, nibbles, scales, offsets = [], [], [], [], [], []  # per linear
        self._linears = (float_w, codes, nibbles, scales, offsets)
        placeholder_f2 = np.zeros((1, 1), np.float32)
        placeholder_i8 = np.zeros((1, 1), np.int8)
        placeholder_u8 = np.zeros((1, 1), np.uint8)
        norms, qk_norms, bias = [], [], []
        norm_names = ["input_layernorm", "post_attention_layernorm"] + (
            ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if spec.sandwich_norms else [])
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms += [self._norm(getattr(layer, name, None), f"layer {i} {name}") for name in norm_names]
            if spec.qk_norm:
                qk_norms += [self._norm(getattr(attn, name, None), f"layer {i} {name}") for name in ("q_norm", "k_norm")]
            if (attn.qkv_proj.bias is not None) != spec.qkv_bias:
                raise ValueError(f"layer {i}'s Q/K/V projection {'has' if attn.qkv_proj.bias is not None else 'lacks'}"
                                 f" a bias; the spec says qkv_bias={spec.qkv_bias}")
            if spec.qkv_bias:
                bias.append(self._view(attn.qkv_proj.bias))
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                fmt, w, c, n, s, o = self._linear(linear, placeholder_f2, placeholder_i8, placeholder_u8)
                formats.append(fmt)
                self._append(w, c, n, s, o)
        # the LM head joins the stack when it is in blocks (a float head runs as Paddle's matmul)
        self.has_head = getattr(model, "lm_head_blocks", None) is not None
        if self.has_head:
            fmt, w, c, n, s, o = self._blocks(model.lm_head_blocks, placeholder_f2, placeholder_i8, placeholder_u8)
            formats.append(fmt)
            self._append(w, c, n, s, o)
        self.formats = np.asarray(formats, np.int64)
        self.partial_at, size = kernel.float_partials(
            [w.shape if fmt == kernel.FLOAT else (0, 0) for fmt, w in zip(formats, float_w)])
        self.partials = np.empty(size, np.float32)  # shared by the team: the float linears' partial products
        self.float_w, self.codes, self.nibbles = typed_list(float_w), typed_list(codes), typed_list(nibbles)
        self._scales, self._offsets = _kernel_params(scales, offsets)
        self.scales, self.offsets = typed_list(self._scales), typed_list(self._offsets)
        self.norms, self.qk_norms, self.qkv_bias = typed_list(norms), typed_list(qk_norms), typed_list(bias)
        self.embed = self._view(model.embed_tokens.weight)
        self.final_norm = self._norm(model.norm, "the final norm")
        ropes = [model.rope[i] for i in range(len(model.layers))]
        self.cos = typed_list([self._view(r.cos) for r in ropes])  # per layer (the same arrays where shared)
        self.sin = typed_list([self._view(r.sin) for r in ropes])
        self.windows = np.array([spec.window(i) for i in range(len(model.layers))], np.int64)
        self.activation = ACTIVATIONS[spec.activation]
        self.k_caches = typed_list([self._view(k) for k, _ in kv_caches])
        self.v_caches = typed_list([self._view(v) for _, v in kv_caches])
        self._num_layers = len(kv_caches)
        self.scale = np.float32(spec.softmax_scale)
        self.counters = np.zeros(kernel.num_phases(len(model.layers)) * STRIDE, np.int64)
        self.marks = np.zeros((kernel.num_phases(len(model.layers)), 0), np.int64)
        self.epoch = 0
        self._max_rows = max(s.shape[0] for s in scales)
        self._max_float_items = max([kernel.float_items(w.shape[0]) for fmt, w in zip(formats, float_w)
                                     if fmt == kernel.FLOAT], default=0)  # a float linear's items of input rows
        self._buffer = np.empty(0, np.float32)  # the per-layer results of a step, grown to the largest batch
        self._team = None
        self.threads = min(numba.get_num_threads(), MAX_THREADS)

    @property
    def threads(self) -> int:
        """Threads that run a step together (the caller and ``threads - 1`` team members)."""
        return 1 if self._team is None else self._team.size

    @threads.setter
    def threads(self, n: int) -> None:
        if self._team is not None:
            self._team.close()
            self._team = None
        if n > 1:
            self._team = _Team(n)
            weakref.finalize(self, self._team.close)

    def _buffers(self, num_tokens: int):
        """The step's shared per-layer result buffers for ``num_tokens`` sequences (views of one array)."""
        spec, layers = self.spec, self._num_layers
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        widths = (q_size + 2 * kv_size, q_size, spec.hidden_size, 2 * spec.intermediate_size, spec.hidden_size)
        need = layers * num_tokens * sum(widths)
        if self._buffer.size < need:
            self._buffer = np.empty(need, np.float32)
        views, at = [], 0
        for width in widths:
            n = layers * num_tokens * width
            views.append(self._buffer[at:at + n].reshape(layers, num_tokens, width))
            at += n
        views[1] = views[1].reshape(layers, num_tokens, spec.num_heads, spec.head_dim)
        return views

    def _view(self, tensor: paddle.Tensor) -> np.ndarray:
        self._keep.append(tensor)
        return host_view(tensor)

    def _norm(self, norm, what: str) -> np.ndarray:
        """An RMSNorm's weight as the kernel multiplies by it: ``spec.norm_offset + w`` (computed once
        where the offset is not 0, else the parameter's own memory)."""
        if norm is None:
            raise ValueError(f"{what} is missing; the spec (sandwich_norms={self.spec.sandwich_norms}, "
                             f"qk_norm={self.spec.qk_norm}) computes it")
        if not self.spec.norm_offset:
            return self._view(norm.weight)
        weight = np.ascontiguousarray(self._view(norm.weight), np.float32) + np.float32(self.spec.norm_offset)
        self._keep.append(weight)
        return weight

    def _append(self, *arrays):
        for lst, a in zip(self._linears, arrays):
            lst.append(a)

    def _linear(self, linear, f2, i8, u8):
        if linear.block_weight is None:
            return kernel.FLOAT, self._view(linear.weight), i8, u8, f2, f2
        return self._blocks(linear.block_weight, f2, i8, u8)

    @staticmethod
    def _blocks(blocks, f2, i8, u8):
        rows = blocks.codes.shape[0]
        scales = np.ascontiguousarray(blocks.scales)
        kinds = set(blocks.kind.split("+"))  # fused linears join their parts' formats with "+"
        if kinds == {"Q4_0"} or kinds <= {"Q4_1", "Q4_K"}:  # codes 0 .. 15 (Q4_0's after the shift)
            codes, offsets = blocks.codes, blocks.offsets
            if blocks.kind == "Q4_0":  # codes q - 8: d * (q - 8) = d * q + (-8 d), exactly
                codes, offsets = codes + np.int8(8), offsets - 8 * blocks.scales
            return kernel.NIBBLE, f2, i8, _pack_nibbles(codes).reshape(rows, -1), scales, np.ascontiguousarray(offsets)
        codes = np.ascontiguousarray(blocks.codes).reshape(rows, -1)
        offsets = np.ascontiguousarray(blocks.offsets)
        if not offsets.any():  # Q8_0: none to read (the kernels take a last dimension of 0 as zeros)
            offsets = np.zeros((rows, 0), np.float32)
        return kernel.INT8, f2, codes, u8, scales, offsets

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one step reads (block formats as stored for the kernel)."""
        float_w, codes, nibbles, scales, offsets = self._linears
        total = 0
        for k, fmt in enumerate(self.formats):
            arrays = {kernel.FLOAT: (float_w[k],), kernel.INT8: (codes[k],), kernel.NIBBLE: (nibbles[k],)}[fmt]
            total += sum(a.nbytes for a in arrays)
            if fmt != kernel.FLOAT:  # as the kernel reads them (float16 bits where exact, `_kernel_params`)
                total += self._scales[k].nbytes + self._offsets[k].nbytes
        return total

    def forward(self, input_ids: paddle.Tensor, meta: AttentionMetadata) -> paddle.Tensor:
        """Hidden states [num_seqs, hidden] after the final norm; the step's K/V land in the cache."""
        hidden, _ = self.step(host_view(input_ids), host_view(meta.positions), host_view(meta.slot_mapping),
                              host_view(meta.block_tables), host_view(meta.context_lens), np.zeros(0, np.int64))
        return paddle.to_tensor(hidden)

    def step(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray,
             context_lens: np.ndarray, logit_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """One decode step on NumPy metadata (as `AttentionMetadata` holds it): the hidden states
        [num_seqs, hidden] after the final norm, and the logits of the hidden rows ``logit_rows``
        (None when the LM head is not in blocks: `LlamaForCausalLM.compute_logits` then computes
        them); the step's K/V land in the cache."""
        num_tokens = len(token_ids)
        out = np.empty((num_tokens, self.spec.hidden_size), np.float32)
        rows = np.asarray(logit_rows, np.int64)
        logits = np.empty((len(rows) if self.has_head else 0, self.spec.vocab_size), np.float32)
        self.counters[:] = 0
        self.epoch += 1
        # bounds any phase's items (`decode_step.split_rows`: at most ~TAIL_ITEMS more than whole items)
        items = max(-(-self._max_rows // min(kernel.DOT_ROWS, kernel.TILE)) + 8 + num_tokens * self.spec.num_kv_heads,
                    self._max_float_items)
        if self.marks.shape[1] < items:
            self.marks = np.zeros((self.marks.shape[0], items), np.int64)
        args = (self.counters, self.marks, self.epoch, token_ids, positions, slots, block_tables, context_lens,
                self.embed, np.float32(self.spec.embed_scale), self.norms, self.qk_norms, self.qkv_bias,
                self.final_norm, self.cos, self.sin, self.windows, self.spec.grouped_qkv, self.activation,
                self.formats, self.float_w, self.codes, self.nibbles, self.scales, self.offsets, self.partials,
                self.partial_at, self.k_caches, self.v_caches, self.spec.num_heads, self.spec.num_kv_heads,
                np.float32(self.spec.rms_norm_eps), self.scale, *self._buffers(num_tokens), out, rows, logits)
        if self._team is None:
            kernel.decode_step(0, 1, *args)
        else:
            self._team.run(args)
        cap = self.spec.final_logit_softcapping
        if cap and self.has_head:
            logits = np.tanh(logits / np.float32(cap)) * np.float32(cap)
        return out, (logits if self.has_head else None)


def _kernel_params(scales: list, offsets: list) -> tuple[list, list]:
    """The linears' scales and offsets as the kernel reads them: float16 bits (uint16 arrays)
    where every value is exactly a float16 (GGUF stores them so: the same numbers in half the
    bytes, and a decode step is bound by the bytes it reads), else float32."""
    exact = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in scales + offsets)

    def as_read(a):
        return np.ascontiguousarray(a, np.float16).view(np.uint16) if exact else np.ascontiguousarray(a)

    return [as_read(a) for a in scales], [as_read(a) for a in offsets]


def typed_list(arrays: list):
    """``arrays`` (all of one Numba type; float32 vectors where empty) as the typed list the kernel takes.

    Built by the cached functions below: the typed list's own methods, called from Python, are
    compiled anew in every process (Numba caches no compilation of theirs)."""
    if not arrays:
        return _empty_vectors()
    lst = _list_of(arrays[0])
    for a in arrays[1:]:
        _push(lst, a)
    return lst


@njit(cache=True)
def _list_of(first):
    lst = List()
    lst.append(first)
    return lst


@njit(cache=True)
def _push(lst, item):
    lst.append(item)


@njit(cache=True)
def _empty_vectors():
    return List.empty_list(_F1)


class _Team:
    """Threads 1 .. size - 1 of the decode step (the caller is thread 0), each parked until a step.

    The kernel releases the GIL, so the members compute while the caller does; they share the
    step's work through its counters (`gpu_kernels.cpu.sync`). A member needs the interpreter
    lock to wake and to return, which the app's threads hold at times: the caller waits for
    neither. It opens the step, wakes the members and runs its part; then it closes the step
    and waits only for members still inside the step's Numba code (``sync.close_step``). A
    member that wakes after the close leaves without touching the step (``member_step``).
    """

    def __init__(self, size: int):
        self.size = size
        self._args = None
        self._control = np.zeros(CONTROL_SIZE, np.int64)
        self._control[OPEN] = -1
        self._go = [threading.Event() for _ in range(size - 1)]
        self._closed = False
        for tid in range(1, size):
            threading.Thread(target=self._member, args=(tid,), name=f"fused-decode-{tid}", daemon=True).start()

    def _member(self, tid: int) -> None:
        go = self._go[tid - 1]
        while True:
            go.wait()
            go.clear()
            args = self._args
            if self._closed:
                return
            if args is not None:
                kernel.member_step(self._control, tid, self.size, *args)

    def run(self, args) -> None:
        """One step on the whole team; returns when no member is inside the step any more."""
        self._args = args
        open_step(self._control, args[2])
        for go in self._go:
            go.set()
        try:
            kernel.decode_step(0, self.size, *args)
        finally:
            close_step(self._control)
            self._args = None

    def close(self) -> None:
        """Let the members exit."""
        self._closed = True
        for go in self._go:
            go.set()
