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
import math

import numpy as np
from numba import cuda

from . import decode_mma
from .decode import MAX_SPLITS, ML_PAD, build_decode_kernel, stage_shape
from .launch import launcher
from . import mma
from .prefill import PrefillTile, build_prefill_kernel, default_tile
from .prefill_mma import MmaTile, build_prefill_mma_kernel, default_mma_tile
from .primitives import F32, SIMULATED, from_f32, kind_of, to_f32

THREADS = 64 if SIMULATED else 128    # threads per block (write_kv)
DECODE_THREADS = 64 if SIMULATED else 128
DECODE_STAGES = 2                      # decode: ring slots per warp (cp.async pipeline depth)
#: decode on the tensor-core stage with few (sequence, head block) pairs (at most one per
#: multiprocessor): (threads, ring slots per warp, blocks per SM aimed at) -- larger blocks
#: with deeper rings and fewer, longer splits keep more bytes in flight per pair; None: the
#: shape above. Not in the simulator (it has no multiprocessor count)
DECODE_FEW_PAIRS_SHAPE: tuple | None = (256, 3, 1)
DECODE_STAGE_BYTES = 512 if SIMULATED else 4096   # decode: K + V bytes per warp stage
DECODE_TABLE = 8 if SIMULATED else 512  # decode: block-table entries a block keeps (chunk limit)
DECODE_BLOCKS_PER_SM = 4               # decode: split-K aims at this many blocks per SM
#: decode: beyond DECODE_MERGE_SPLITS splits, a split has at least DECODE_MIN_CHUNK keys (the
#: last block's merge reads every split's partial: many short splits cost more than they hide),
#: and such long splits fill at most DECODE_LONG_SHARE of the blocks aimed at
DECODE_MERGE_SPLITS = 16
DECODE_MIN_CHUNK = 0 if SIMULATED else 256
DECODE_LONG_SHARE = 0.5
#: decode: L2 qualifiers of the K/V copies (``shared_memory.cp_async16_hinted``): the
#: stream is read once. ``("evict_first",)`` is added while the K/V bytes a launch can read
#: are at most DECODE_EVICT_FIRST_L2 times the L2 size (0: never; past ~4x it costs)
DECODE_L2_HINT: tuple = ()
DECODE_EVICT_FIRST_L2 = 0
DECODE_MAX_REGISTERS = 128             # decode, <= 4 heads per block: 4 blocks of 128 per SM
PREFILL_MAX_REGISTERS = None           # prefill: no cap (shared memory allows 1-2 blocks per SM)
#: prefill tile (threads, query rows, keys) by head_dim; absent: prefill.default_tile
PREFILL_TILES: dict = {} if SIMULATED else {64: (256, 128, 64), 128: (256, 128, 64),
                                            256: (256, 64, 64)}
#: tensor-core prefill tile (warps, 16-row tiles per warp, keys[, stages[, register cap]]) by
#: head_dim; absent:
#: prefill_mma.default_mma_tile
PREFILL_MMA_TILES: dict = {}
#: prefill of float16/bfloat16 queries on float16/bfloat16 caches: "auto" (tensor cores where
#: the GPU has mma.sync, else the same tiling in plain Numba), "numba" (that plain-Numba twin),
#: "off" (the float32 CUDA-core kernel, as for float32 caches or queries)
prefill_mma_mode = "auto"
#: decode of float16/bfloat16 queries on a cache of the same format (head_dim 64 or 128):
#: "auto" (a stage's products on tensor cores where the GPU has mma.sync, else the same
#: layout in plain Numba), "numba" (that plain-Numba twin), "off" (the CUDA-core stage)
decode_mma_mode = "auto"
SPLIT_GRAIN = 16 if SIMULATED else 64  # decode: split lengths are multiples of this
LOG2E = 1.4426950408889634

#: decode launches about this many blocks (split-K) when sequences are few;
#: None = DECODE_BLOCKS_PER_SM per multiprocessor of the current device
decode_target_blocks = 8 if SIMULATED else None

#: the kernels the last calls launched, by operation (for the benchmark's resource report)
last_kernels: dict = {}


# --------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=None)
def _num_sms():
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


@functools.lru_cache(maxsize=None)
def _l2_bytes():
    return cuda.get_current_device().L2_CACHE_SIZE


_word_views: dict = {}


def _words(arr):
    """The array's memory as a flat uint32 device array (cached per array object: the views
    ``interop`` hands out are the same objects call after call)."""
    if isinstance(arr, np.ndarray):                       # simulator
        return arr.reshape(-1).view(np.uint32)
    entry = _word_views.get(id(arr))
    if entry is not None and entry[0] is arr:
        return entry[1]
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    view = DeviceNDArray(shape=(arr.nbytes // 4,), strides=(4,), dtype=np.dtype(np.uint32),
                         gpu_data=arr.gpu_data)
    if len(_word_views) > 256:
        _word_views.clear()
    _word_views[id(arr)] = (arr, view)                    # holds arr: its id stays its own
    return view


def _c_contiguous(arr):
    """A NumPy array (simulator) or a Numba device array laid out in C order."""
    return arr.flags.c_contiguous if isinstance(arr, np.ndarray) else arr.is_c_contiguous()


def heads_per_block(group, limit=8):
    """The largest divisor of the GQA group that is <= limit (query heads sharing one block)."""
    return max(h for h in range(1, min(group, limit) + 1) if group % h == 0)


def decode_heads_per_block(group):
    """Decode keeps a query slice and accumulators per head in registers: at most 4 heads
    per block when the group splits that way with 3 or 4 (each KV byte is then read by
    group / hpb blocks, mostly from L2), else up to 8."""
    hpb = heads_per_block(group, 4)
    return hpb if hpb >= 3 or hpb == group else heads_per_block(group)


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


_plans: dict = {}


def _remember_plan(key, plan):
    if len(_plans) >= 256:
        _plans.clear()
    _plans[key] = plan
    return plan


def paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale, window, out, *,
                 stream=0):
    """One query per sequence; see decode.py. The launch plan (kernel, grid, split sizes,
    scratch) depends only on shapes, formats and the tunables, and is cached by them."""
    key = ("decode", query.shape, query.dtype, k_cache.shape, k_cache.dtype, out.dtype,
           block_tables.shape[1], window, decode_target_blocks, DECODE_THREADS, DECODE_STAGES,
           DECODE_STAGE_BYTES, DECODE_MAX_REGISTERS, DECODE_BLOCKS_PER_SM, DECODE_MIN_CHUNK,
           DECODE_MERGE_SPLITS, DECODE_LONG_SHARE, decode_mma_mode, DECODE_FEW_PAIRS_SHAPE,
           DECODE_L2_HINT, DECODE_EVICT_FIRST_L2)
    plan = _plans.get(key) or _remember_plan(key, _decode_plan(
        query, k_cache, block_tables, window, out))
    launch, kernel, grid, threads, scratch, tail = plan
    last_kernels["decode"] = kernel
    last_kernels["decode_threads"] = threads
    launch(grid, threads, stream, query, _words(k_cache), _words(v_cache), block_tables,
           context_lens, out, *scratch, np.float32(scale * LOG2E), np.int32(window), *tail)


def _decode_plan(query, k_cache, block_tables, window, out):
    num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    kind_kv = kind_of(k_cache.dtype)
    _check_row(head_dim, kind_kv)
    group = num_heads // num_kv_heads
    kind_q = kind_of(query.dtype)
    tensor_cores = _decode_tensor_cores(kind_q, kind_kv, head_dim, heads_per_block(group))
    hpb = heads_per_block(group) if tensor_cores else decode_heads_per_block(group)
    head_blocks = num_kv_heads * (group // hpb)
    threads, stages, per_sm = DECODE_THREADS, DECODE_STAGES, DECODE_BLOCKS_PER_SM
    if tensor_cores and DECODE_FEW_PAIRS_SHAPE and not SIMULATED \
            and num_seqs * head_blocks <= _num_sms():
        threads, stages, per_sm = DECODE_FEW_PAIRS_SHAPE
    _, keys_per_pass, passes = stage_shape(head_dim, k_cache.dtype.itemsize, DECODE_STAGE_BYTES)
    kpw = keys_per_pass * passes                      # keys per warp stage; chunks align to it
    if tensor_cores:
        kpw = decode_mma.STAGE_KEYS
    max_keys = block_tables.shape[1] * block_size
    if window:                                        # the window's start is rounded down
        max_keys = min(max_keys, window + kpw - 1)
    hint = tuple(DECODE_L2_HINT)
    kv_bytes = 2 * num_seqs * max_keys * num_kv_heads * head_dim * k_cache.dtype.itemsize
    if DECODE_EVICT_FIRST_L2 and not SIMULATED and "evict_first" not in hint \
            and kv_bytes <= DECODE_EVICT_FIRST_L2 * _l2_bytes():
        hint += ("evict_first",)
    kernel = build_decode_kernel(threads, group, hpb, head_dim, kind_q,
                                 kind_kv, kind_of(out.dtype), block_size, DECODE_TABLE,
                                 stages, DECODE_STAGE_BYTES,
                                 DECODE_MAX_REGISTERS if hpb <= 4 or tensor_cores else None,
                                 tensor_cores, tuple(sorted(hint)))
    grain = SPLIT_GRAIN * kpw // math.gcd(SPLIT_GRAIN, kpw)
    target = decode_target_blocks or per_sm * _num_sms()
    # whole waves: at most `target` blocks (rounding up would leave a second, thin wave)
    most = MAX_SPLITS
    if DECODE_MIN_CHUNK:
        long_splits = min(-(-max_keys // DECODE_MIN_CHUNK),
                          int(target * DECODE_LONG_SHARE) // (num_seqs * head_blocks))
        most = max(DECODE_MERGE_SPLITS, long_splits)
    splits = max(1, min(target // (num_seqs * head_blocks), -(-max_keys // grain), most,
                        MAX_SPLITS))
    chunk = -(-max(1, -(-max_keys // splits)) // grain) * grain
    cap = DECODE_TABLE * block_size                   # the block keeps its chunk's table
    chunk = min(chunk, cap - cap % kpw if cap >= kpw else cap)
    splits = max(1, -(-max_keys // chunk))
    if splits > MAX_SPLITS:
        raise NotImplementedError(f"cuda decode: {max_keys} keys need {splits} splits of at most "
                                  f"{chunk} keys (> {MAX_SPLITS}); raise DECODE_TABLE")
    scratch = _split_scratch(num_seqs, head_blocks, splits, hpb, head_dim)
    return (launcher(kernel), kernel, (splits, head_blocks, num_seqs), threads, scratch,
            (np.int32(num_kv_heads), np.int32(splits), np.int32(chunk)))


def _decode_tensor_cores(kind_q, kind_kv, head_dim, hpb):
    """0: the CUDA-core stage; 1: the tensor-core layout in plain Numba; 2: with mma.sync."""
    if decode_mma_mode not in ("auto", "numba", "off"):
        raise ValueError(f"cuda backend: decode_mma_mode must be 'auto', 'numba' or 'off', got "
                         f"{decode_mma_mode!r}")
    if decode_mma_mode == "off" or not decode_mma.supported(kind_q, kind_kv, head_dim, hpb):
        return 0
    return 2 if decode_mma_mode == "auto" and mma.mma_supported() else 1


def paged_prefill(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                  window, out, *, stream=0):
    """Packed query chunks (mixed with decodes); see prefill.py. Plans cached as for decode."""
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    key = ("prefill", query.shape, query.dtype, _c_contiguous(query), k_cache.shape,
           k_cache.dtype, out.dtype, _c_contiguous(out), context_lens.shape[0], prefill_mma_mode,
           PREFILL_MMA_TILES.get(query.shape[2]), PREFILL_TILES.get(query.shape[2]),
           PREFILL_MAX_REGISTERS)
    plan = _plans.get(key) or _remember_plan(key, _prefill_plan(
        query, k_cache, context_lens.shape[0], out))
    launch, kernel, grid, threads, q_words, o_words, tail = plan
    last_kernels["prefill"] = kernel
    launch(grid, threads, stream, query,
           _words(query) if q_words else _words(k_cache),   # (unused then)
           _words(k_cache), _words(v_cache), block_tables, query_start_loc, context_lens, out,
           _words(out) if o_words else _words(k_cache),     # (read-only, unused then)
           np.float32(scale * LOG2E), np.int32(window), *tail)


def _prefill_plan(query, k_cache, num_seqs, out):
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    kind_kv = kind_of(k_cache.dtype)
    _check_row(head_dim, kind_kv)
    group = num_heads // num_kv_heads
    hpb = heads_per_block(group)
    kind_q = kind_of(query.dtype)
    q_words = _c_contiguous(query)
    o_words = False
    if _use_mma_prefill(kind_q, kind_kv, head_dim):
        shape = PREFILL_MMA_TILES.get(head_dim)
        tile = MmaTile(*shape[:3], head_dim, *shape[3:]) if shape else default_mma_tile(head_dim)
        o_words = _c_contiguous(out) and kind_of(out.dtype) != F32
        kernel, tile_tokens, shared = build_prefill_mma_kernel(
            tile, group, hpb, kind_q, kind_kv, kind_of(out.dtype), block_size, q_words,
            prefill_mma_mode == "auto" and mma.mma_supported(), mma.LTO, o_words)
    else:
        shape = PREFILL_TILES.get(head_dim)
        tile = PrefillTile(*shape, head_dim) if shape else default_tile(head_dim)
        kernel, tile_tokens, shared = build_prefill_kernel(
            tile, group, hpb, kind_q, kind_kv, kind_of(out.dtype), block_size,
            q_words, PREFILL_MAX_REGISTERS)
    max_tiles = -(-num_tokens // tile_tokens) + num_seqs
    head_blocks = num_kv_heads * (group // hpb)
    return (launcher(kernel, shared), kernel, max_tiles * head_blocks, tile.threads, q_words,
            o_words, (np.int32(num_kv_heads), np.int32(head_blocks), np.int32(max_tiles)))


def _use_mma_prefill(kind_q, kind_kv, head_dim):
    """Half queries on half caches, head_dim a multiple of 16 (at most 256), unless turned off."""
    if prefill_mma_mode not in ("auto", "numba", "off"):
        raise ValueError(f"cuda backend: prefill_mma_mode must be 'auto', 'numba' or 'off', got "
                         f"{prefill_mma_mode!r}")
    return (prefill_mma_mode != "off" and kind_q != F32 and kind_kv != F32 and head_dim % 16 == 0
            and head_dim <= 256)


def prefill_flops(query_lens, context_lens, num_heads, head_dim, window=0):
    """Useful FLOPs of a prefill (2 matmuls x 2 FLOP per multiply-add, masked pairs excluded)."""
    pairs = 0
    for n, length in zip(query_lens, context_lens):
        for pos in range(length - n, length):
            pairs += min(pos + 1, window) if window else pos + 1
    return 4 * pairs * num_heads * head_dim

