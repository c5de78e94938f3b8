"""The ``cuda`` backend: picks kernel shapes, owns scratch buffers, launches.

Arguments are Numba device arrays (``interop.device_view``) in the device
representation: float32, float16, or uint16 holding bfloat16. The caches
are read by the kernels as flat arrays of 32-bit words (``_words``), so a
cache's ``head_dim * itemsize`` must be a multiple of 16 bytes (head_dim a
multiple of 8 for half caches, of 4 for float32).

Nothing here copies to or from the host: sizes come from array shapes, not
from ``context_lens``. Decode therefore sizes its split-K grid for the
longest context the block table can describe; splits past a sequence's end
exit at once.

Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run in the simulator with
smaller blocks (``THREADS``), and NumPy arrays are accepted as device arrays.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .cuda_decode import ML_PAD, build_decode_kernel
from .cuda_launch import launcher
from .cuda_prefill import build_prefill_kernel
from .cuda_primitives import F32, SIMULATED, from_f32, kind_of, to_f32

THREADS = 64 if SIMULATED else 128    # threads per block (prefill, write_kv)
DECODE_THREADS = 64 if SIMULATED else 128
SEGMENT = 32 if SIMULATED else 512     # decode: keys per block-table prefetch
SPLIT_GRAIN = 16 if SIMULATED else 64  # decode: split lengths are multiples of this
UNROLL = 1 if SIMULATED else 2         # decode: K loads (of 32 / lanes_per_token keys) per step
DECODE_MAX_REGISTERS = None            # decode: register cap (None: the compiler's choice)
DECODE_QREGS = 64                      # decode: registers for each lane's query slice
LOG2E = 1.4426950408889634

#: decode launches about this many blocks (split-K) when sequences are few;
#: None = 4 per multiprocessor of the current device
decode_target_blocks = 8 if SIMULATED else None


# --------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=None)
def _num_sms():
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


_word_views: dict = {}


def _words(arr):
    """The array's memory as a flat uint32 device array (cached per pointer and size)."""
    if isinstance(arr, np.ndarray):                       # simulator
        return arr.reshape(-1).view(np.uint32)
    ptr = arr.__cuda_array_interface__["data"][0]
    key = (ptr, arr.nbytes)
    view = _word_views.get(key)
    if view is None:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        view = DeviceNDArray(shape=(arr.nbytes // 4,), strides=(4,), dtype=np.dtype(np.uint32),
                             gpu_data=arr.gpu_data)
        if len(_word_views) > 256:
            _word_views.clear()
        _word_views[key] = view
    return view


def heads_per_block(group):
    """The largest divisor of the GQA group that is <= 8 (query heads sharing one block)."""
    return max(h for h in range(1, min(group, 8) + 1) if group % h == 0)


def lanes_per_token(row_vecs, hpb, dpv, qregs=64):
    """Threads sharing one key row in the decode K pass (power of two dividing row_vecs).

    At least 8 when the row allows (wide coalesced reads), more while the
    query slice each lane keeps in registers (hpb * dims per lane) exceeds ``qregs``.
    """
    tg = 1
    while tg < 8 and row_vecs % (2 * tg) == 0:
        tg *= 2
    while tg < 32 and row_vecs % (2 * tg) == 0 and hpb * (row_vecs // tg) * dpv > qregs:
        tg *= 2
    return tg


def _check_row(head_dim, kind):
    if head_dim * (4 if kind == F32 else 2) % 16:
        raise NotImplementedError(f"cuda backend: head_dim {head_dim} rows are not a multiple "
                                  "of 16 bytes")


_scratch: dict = {}


def _split_scratch(num_seqs, head_blocks, splits, hpb, head_dim):
    """(part_ml, part_acc, counters) for split-K decode, reused across calls of one shape."""
    key = (num_seqs, head_blocks, splits, hpb, head_dim)
    bufs = _scratch.get(key)
    if bufs is None:
        ml_len = -(-splits * hpb * 2 // ML_PAD) * ML_PAD
        bufs = (cuda.device_array((num_seqs, head_blocks, ml_len), np.float32),
                cuda.device_array((num_seqs, head_blocks, splits, hpb, head_dim), np.float32),
                cuda.to_device(np.zeros(num_seqs * head_blocks, np.int32)))
        _scratch[key] = bufs
    return bufs


# --------------------------------------------------------------------------- write_kv


@functools.lru_cache(maxsize=None)
def _build_write_kernel(kind_in, kind_cache):
    @cuda.jit
    def write(key, value, k_cache, v_cache, slot_mapping):
        t = cuda.blockIdx.x
        slot = slot_mapping[t]
        if slot < 0:
            return
        block_size = k_cache.shape[2]
        blk = slot // block_size
        off = slot - blk * block_size
        head_dim = key.shape[2]
        for idx in range(cuda.threadIdx.x, key.shape[1] * head_dim, cuda.blockDim.x):
            h = idx // head_dim
            d = idx - h * head_dim
            k_cache[blk, h, off, d] = from_f32(to_f32(key[t, h, d], kind_in), kind_cache)
            v_cache[blk, h, off, d] = from_f32(to_f32(value[t, h, d], kind_in), kind_cache)
    return write


def write_kv(key, value, k_cache, v_cache, slot_mapping, *, stream=0):
    """Scatter key/value rows into the paged caches (one block per token)."""
    if key.shape[0] == 0:
        return
    kernel = _build_write_kernel(kind_of(key.dtype), kind_of(k_cache.dtype))
    launcher(kernel)(key.shape[0], THREADS, stream, key, value, k_cache, v_cache, slot_mapping)


# --------------------------------------------------------------------------- attention


def paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale, window, out, *,
                 stream=0):
    """One query per sequence; see cuda_decode.py."""
    num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    kind_kv = kind_of(k_cache.dtype)
    _check_row(head_dim, kind_kv)
    group = num_heads // num_kv_heads
    hpb = heads_per_block(group)
    dpv = 4 if kind_kv == F32 else 8
    row_vecs = head_dim // dpv
    threads = DECODE_THREADS
    tg = lanes_per_token(row_vecs, hpb, dpv, DECODE_QREGS)
    kernel = build_decode_kernel(threads, group, hpb, head_dim, kind_of(query.dtype), kind_kv,
                                 kind_of(out.dtype), block_size, SEGMENT, tg, UNROLL,
                                 DECODE_MAX_REGISTERS)
    head_blocks = num_kv_heads * (group // hpb)
    max_keys = block_tables.shape[1] * block_size
    if window:
        max_keys = min(max_keys, window)
    target = decode_target_blocks or 4 * _num_sms()
    splits = min(-(-target // (num_seqs * head_blocks)), max(1, -(-max_keys // SPLIT_GRAIN)))
    splits = max(1, splits)
    chunk = -(-max(1, -(-max_keys // splits)) // SPLIT_GRAIN) * SPLIT_GRAIN
    splits = max(1, -(-max_keys // chunk))
    part_ml, part_acc, counters = _split_scratch(num_seqs, head_blocks, splits, hpb, head_dim)
    launcher(kernel)(
        (splits, head_blocks, num_seqs), threads, stream, query, _words(k_cache), _words(v_cache), block_tables, context_lens, out,
        part_ml, part_acc, counters, np.float32(scale * LOG2E), np.int32(window),
        np.int32(num_kv_heads), np.int32(splits), np.int32(chunk))


def paged_prefill(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                  window, out, *, stream=0):
    """Packed query chunks (mixed with decodes); see cuda_prefill.py."""
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    kind_kv = kind_of(k_cache.dtype)
    _check_row(head_dim, kind_kv)
    group = num_heads // num_kv_heads
    hpb = heads_per_block(group)
    kernel, tile_tokens = build_prefill_kernel(THREADS, group, hpb, head_dim,
                                               kind_of(query.dtype), kind_kv,
                                               kind_of(out.dtype))
    num_seqs = context_lens.shape[0]
    max_tiles = -(-num_tokens // tile_tokens) + num_seqs
    if num_tokens == 0:
        return
    launcher(kernel)(
        (max_tiles, num_kv_heads * (group // hpb)), THREADS, stream, query, _words(k_cache), _words(v_cache), block_tables, query_start_loc, context_lens,
        out, np.float32(scale * LOG2E), np.int32(window), np.int32(num_kv_heads),
        np.int32(block_size))


def prefill_flops(query_lens, context_lens, num_heads, head_dim, window=0):
    """Useful FLOPs of a prefill (2 matmuls x 2 FLOP per multiply-add, masked pairs excluded)."""
    pairs = 0
    for n, length in zip(query_lens, context_lens):
        for pos in range(length - n, length):
            pairs += min(pos + 1, window) if window else pos + 1
    return 4 * pairs * num_heads * head_dim

