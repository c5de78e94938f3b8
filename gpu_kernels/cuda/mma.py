"""The prefill kernel's two matrix products of a key tile, per warp, in two implementations.

``mma_ops(kind, mt, nt, head_dim, use_mma)`` returns ``(qk, pv)``, device functions with one
contract (layouts in ``mma.cu``'s header):

``qk(s, smem, q_word, k_word, scratch)``
    ``s`` (a local float32 array of ``mt * nt * 4``) = the warp's ``16 mt`` query rows (shared
    words from ``q_word``) times the tile's ``8 nt`` keys (from ``k_word``), in the
    ``mma.m16n8k16`` accumulator layout: lane ``4 g + t`` holds rows ``g, g + 8`` x keys
    ``2 t, 2 t + 1`` of each 16 x 8 tile.
``pv(o, alpha, p, smem, v_word, scratch)``
    ``o`` (float32 ``mt * head_dim / 8 * 4``, the same layout over head dims) = ``o`` times
    ``alpha`` (per row: ``alpha[2 m + h]`` for row ``g + 8 h`` of m-tile ``m``) + ``p`` (in
    ``s``'s layout, rounded to the cache's half format) times the V tile at ``v_word``.

``use_mma``: tensor cores -- ``mma.cu`` (inline-PTX ``ldmatrix`` + ``mma.sync``) linked into
the Numba kernel through ``cuda.declare_device``, templates instantiated per shape in a
generated source; the kernel is built with link-time optimization so that these calls inline
and the arrays stay in registers. Otherwise plain Numba with the same layouts (each lane
computes its own accumulator entries as dot products out of shared memory; ``pv`` gathers
P from the lanes that hold it by shuffles): the CUDA simulator's path, and GPUs without
``mma.sync`` (compute capability < 8.0). The GPU tests check that the two agree.
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile

from numba import cuda, float32

from .primitives import BF16, F16, SIMULATED, pack2, shfl_idx, word_elem

CU_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mma.cu")

#: link-time optimization for kernels that call mma.cu (inlines the calls); False links PTX
#: (calls stay calls, the fragment arrays go through local memory: slower, same results)
LTO = True


def mma_supported():
    """A GPU with ``mma.sync`` for fp16 and bf16 (compute capability >= 8.0), not the simulator."""
    if SIMULATED:
        return False
    try:
        return cuda.get_current_device().compute_capability >= (8, 0)
    except Exception:                       # pragma: no cover - no usable device
        return False


if SIMULATED:
    def data_ptr(arr):                      # pragma: no cover - only the mma path uses it
        raise NotImplementedError("the simulator cannot call linked CUDA C++")
else:
    from numba import types
    from numba.core.extending import intrinsic

    @intrinsic
    def data_ptr(typingctx, arr):
        """Pointer to an array's first element (global, shared or local memory)."""
        sig = types.CPointer(arr.dtype)(arr)

        def codegen(context, builder, signature, args):
            return context.make_array(signature.args[0])(context, builder, args[0]).data
        return sig, codegen


@functools.lru_cache(maxsize=None)
def _linked_source(kind, mt, nt, head_dim):
    """A .cu file: mma.cu plus extern "C" wrappers of one instantiation; (path, names)."""
    tag = f"{kind}_{mt}_{nt}_{head_dim}"
    qk_name, pv_name = f"prefill_qk_{tag}", f"prefill_pv_{tag}"
    with open(CU_SOURCE) as f:
        text = f.read()
    text += (
        f'\nextern "C" __device__ int {qk_name}(int* ret, float* s, const u32* smem, int q_word,'
        f' int k_word) {{\n  qk_tile<{kind}, {mt}, {nt}, {head_dim}>(s, smem, q_word, k_word);'
        f'\n  *ret = 0;\n  return 0;\n}}\n'
        f'extern "C" __device__ int {pv_name}(int* ret, float* o, const float* alpha, const float* p,'
        f' const u32* smem, int v_word) {{\n  pv_tile<{kind}, {mt}, {nt}, {head_dim}>(o, alpha, p,'
        f' smem, v_word);'
        f'\n  *ret = 0;\n  return 0;\n}}\n')
    folder = os.path.join(tempfile.gettempdir(), f"gpu_kernels_mma_{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"prefill_mma_{tag}_{hashlib.sha1(text.encode()).hexdigest()[:12]}.cu")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return path, qk_name, pv_name


@functools.lru_cache(maxsize=None)
def mma_ops(kind, mt, nt, head_dim, use_mma):
    """(qk, pv) for one shape; see the module docstring."""
    if kind not in (F16, BF16):
        raise NotImplementedError("tensor-core prefill takes float16 or bfloat16 caches")
    if head_dim % 16 or nt % 2:
        raise NotImplementedError(f"tensor-core prefill: head_dim ({head_dim}) must be a multiple "
                                  f"of 16 and keys per tile ({8 * nt}) of 16")
    if use_mma:
        return _mma_ops(kind, mt, nt, head_dim)
    return _numba_ops(kind, mt, nt, head_dim)


def _mma_ops(kind, mt, nt, head_dim):
    from numba import types
    path, qk_name, pv_name = _linked_source(kind, mt, nt, head_dim)
    f32p, u32p = types.CPointer(types.float32), types.CPointer(types.uint32)
    qk_c = cuda.declare_device(qk_name, types.int32(f32p, u32p, types.int32, types.int32),
                               link=[path])
    pv_c = cuda.declare_device(pv_name, types.int32(f32p, f32p, f32p, u32p, types.int32),
                               link=[path])

    @cuda.jit(device=True, inline="always")
    def qk(s, smem, q_word, k_word, scratch):
        qk_c(data_ptr(s), data_ptr(smem), q_word, k_word)

    @cuda.jit(device=True, inline="always")
    def pv(o, alpha, p, smem, v_word, scratch):
        pv_c(data_ptr(o), data_ptr(alpha), data_ptr(p), data_ptr(smem), v_word)

    return qk, pv


def _numba_ops(kind, mt, nt, head_dim):
    SW = (head_dim + 8) // 2           # words per shared row
    HW = head_dim // 2                 # words holding a row's head_dim halves
    DT = head_dim // 8

    @cuda.jit(device=True, inline="always")
    def qk(s, smem, q_word, k_word, scratch):
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        t = lane % 4
        for m in range(mt):
            for n in range(nt):
                for c in range(4):
                    qrow = q_word + (m * 16 + g + 8 * (c // 2)) * SW
                    krow = k_word + (n * 8 + 2 * t + c % 2) * SW
                    acc = float32(0.0)
                    for w in range(HW):
                        qv = smem[qrow + w]
                        kv = smem[krow + w]
                        acc += word_elem(qv, 0, kind) * word_elem(kv, 0, kind)
                        acc += word_elem(qv, 1, kind) * word_elem(kv, 1, kind)
                    s[(m * nt + n) * 4 + c] = acc

    @cuda.jit(device=True, inline="always")
    def pv(o, alpha, p, smem, v_word, scratch):
        lane = cuda.threadIdx.x % 32
        g = lane // 4
        t = lane % 4
        for m in range(mt):
            for n in range(DT):
                for c in range(4):
                    o[(m * DT + n) * 4 + c] *= alpha[2 * m + c // 2]
        for m in range(mt):
            for key in range(8 * nt):
                src = 4 * g + (key % 8) // 2        # the lane holding (row g, key)
                vrow = v_word + key * SW
                for h in range(2):
                    x = shfl_idx(p[(m * nt + key // 8) * 4 + 2 * h + key % 2], src, scratch)
                    x = word_elem(pack2(x, float32(0.0), kind), 0, kind)   # as mma rounds P
                    for n in range(DT):
                        w = smem[vrow + n * 4 + t]          # dims 8 n + 2 t, + 1
                        o[(m * DT + n) * 4 + 2 * h] += x * word_elem(w, 0, kind)
                        o[(m * DT + n) * 4 + 2 * h + 1] += x * word_elem(w, 1, kind)

    return qk, pv
