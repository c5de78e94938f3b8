"""Random paged-attention problems, shared by the tests and the benchmark.

A :class:`Problem` is a batch of sequences with ragged context lengths whose
blocks are scattered over the cache in random order (so block tables are
not the identity), a query chunk per sequence (length 1 = a decode), and
everything the three operations take, as NumPy arrays in the *user* dtypes
(``np.float16``, ``np.float32``, or ``"bfloat16"`` given as uint16 bits).

Index arrays use the engine's dtypes: ``slot_mapping`` int64, the rest int32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .formats import from_float32, to_float32


def np_dtype(name: str):
    """'float32' | 'float16' | 'bfloat16' -> the NumPy dtype used for such arrays."""
    return {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[name]


def random_array(rng, shape, dtype_name, scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return from_float32(x, np_dtype(dtype_name))


@dataclass
class Problem:
    query: np.ndarray          # [num_tokens, num_heads, head_dim]
    key: np.ndarray            # [num_tokens, num_kv_heads, head_dim] (this step's new tokens)
    value: np.ndarray
    k_cache: np.ndarray        # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: np.ndarray
    block_tables: np.ndarray   # int32 [num_seqs, max_blocks]
    context_lens: np.ndarray   # int32 [num_seqs]
    query_start_loc: np.ndarray  # int32 [num_seqs + 1]
    slot_mapping: np.ndarray   # int64 [num_tokens]: slots of the query tokens (-1 = padding)
    scale: float

    def out(self):
        """A fresh output array, poisoned with NaN so unwritten rows show."""
        return np.full_like(self.query, np.nan) if self.query.dtype.kind == "f" else \
            np.full_like(self.query, 0x7FC0)


def make_problem(rng, *, context_lens, query_lens, num_kv_heads=2, group=4, head_dim=64,
                 block_size=16, dtype="float32", query_dtype=None, spare_blocks=3,
                 pad_tokens=0) -> Problem:
    """Build a problem; sequence i has ``context_lens[i]`` tokens, its last ``query_lens[i]`` are queries.

    ``pad_tokens`` extra query rows with slot -1 are appended (they must not touch the cache).
    """
    context_lens = np.asarray(context_lens, np.int32)
    query_lens = np.asarray(query_lens, np.int32)
    assert (query_lens <= context_lens).all()
    num_seqs = len(context_lens)
    blocks_per_seq = np.maximum(1, -(-context_lens // block_size))
    num_blocks = int(blocks_per_seq.sum()) + spare_blocks
    order = rng.permutation(num_blocks)
    max_blocks = int(blocks_per_seq.max()) + 1
    block_tables = np.full((num_seqs, max_blocks), -7, np.int32)   # junk past the end
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = order[used:used + n]
        used += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = random_array(rng, shape, dtype)
    v_cache = random_array(rng, shape, dtype)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    slots = []
    for i in range(num_seqs):
        pos = np.arange(context_lens[i] - query_lens[i], context_lens[i])
        slots.append(block_tables[i, pos // block_size].astype(np.int64) * block_size
                     + pos % block_size)
    slots.append(np.full(pad_tokens, -1, np.int64))
    slot_mapping = np.concatenate(slots).astype(np.int64)
    num_tokens = len(slot_mapping)
    qd = query_dtype or dtype
    return Problem(
        query=random_array(rng, (num_tokens, num_kv_heads * group, head_dim), qd),
        key=random_array(rng, (num_tokens, num_kv_heads, head_dim), dtype),
        value=random_array(rng, (num_tokens, num_kv_heads, head_dim), dtype),
        k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        context_lens=context_lens, query_start_loc=query_start_loc,
        slot_mapping=slot_mapping, scale=float(head_dim) ** -0.5)


def tolerance(dtype_name: str) -> dict:
    """assert_allclose tolerances for outputs of ``dtype_name`` (values are O(1))."""
    return {"float32": dict(rtol=1e-4, atol=1e-5),
            "float16": dict(rtol=5e-3, atol=5e-3),
            "bfloat16": dict(rtol=3e-2, atol=3e-2)}[dtype_name]


def assert_close(actual, expected, dtype_name):
    """Compare two outputs of one format as float32; NaN (unwritten) never passes."""
    a, e = to_float32(np.asarray(actual)), to_float32(np.asarray(expected))
    assert np.isfinite(a).all(), "output has NaN/inf (unwritten rows?)"
    np.testing.assert_allclose(a, e, **tolerance(dtype_name))
