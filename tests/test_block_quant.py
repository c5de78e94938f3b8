"""GGUF weights kept in their quantized blocks, and the small-batch matmul that runs on them."""

import gguf
import numpy as np
import paddle
import pytest
from gguf import GGMLQuantizationType as QT
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_linear import BlockWeight
from engine.loader.gguf_blocks import KEPT_FORMATS, concat_rows, unpack
from gpu_kernels.cpu import block_matmul as cpu_block_matmul


def _quantized(rng, rows, cols, qtype):
    raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(rows, cols)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
def test_unpacked_blocks_dequantize_exactly_like_gguf(qtype):
    raw, expected = _quantized(np.random.default_rng(0), 12, 96, qtype)
    blocks = unpack(raw, qtype, (12, 96))
    assert blocks.kind == qtype.name and blocks.codes.dtype == np.int8 and blocks.shape == (12, 96)
    np.testing.assert_array_equal(blocks.dequantize(), expected)
    assert blocks.nbytes < expected.nbytes / 3  # 1.25 bytes per weight instead of 4


def test_q5_0_blocks_dequantize_exactly_like_gguf():
    raw, expected = _quantized(np.random.default_rng(3), 12, 96, QT.Q5_0)
    blocks = unpack(raw, QT.Q5_0, (12, 96))
    assert blocks.codes.min() >= -16 and blocks.codes.max() <= 15 and blocks.kind == "Q5_0"
    np.testing.assert_array_equal(blocks.dequantize(), expected)


def test_q4_k_super_blocks_dequantize_exactly_like_gguf():
    """Q4_K (gguf-py has no quantizer for it): random super-blocks -- any bytes are valid codes,
    scales and mins -- with small f16 d / dmin, against ``gguf.quants.dequantize``."""
    rng = np.random.default_rng(4)
    rows, cols = 5, 512
    raw = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    for at in (0, 2):  # d, dmin
        raw[:, at:at + 2] = (rng.random((len(raw), 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    blocks = unpack(raw, QT.Q4_K, (rows, cols))
    assert blocks.codes.min() >= 0 and blocks.codes.max() <= 15 and blocks.shape == (rows, cols)
    np.testing.assert_array_equal(blocks.dequantize(), gguf.quants.dequantize(raw, QT.Q4_K).reshape(rows, cols))


def _q6_k(rng, rows, cols):
    """Random Q6_K super-blocks (any bytes are valid codes and int8 scales) with a small f16 ``d``;
    gguf-py has no Q6_K quantizer. The raw rows and ``gguf.quants.dequantize``'s weights."""
    raw = rng.integers(0, 256, (rows * cols // 256, 210), dtype=np.uint8)
    raw[:, 208:210] = (rng.random((len(raw), 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    return raw, gguf.quants.dequantize(raw, QT.Q6_K).reshape(rows, cols)


def test_q6_k_super_blocks_dequantize_exactly_like_gguf():
    """Q6_K's scale per 16 inputs is kept as two scales per block of 32 codes."""
    raw, expected = _q6_k(np.random.default_rng(5), 3, 512)
    blocks = unpack(raw, QT.Q6_K, (3, 512))
    assert blocks.group == 16 and blocks.scales.shape == (3, 32) and blocks.shape == (3, 512)
    assert blocks.codes.min() >= -32 and blocks.codes.max() <= 31
    np.testing.assert_array_equal(blocks.dequantize(), expected)
    assert blocks.nbytes < expected.nbytes / 2  # int8 codes and a float32 scale per 16: 1.5 bytes a weight


def test_formats_without_a_kernel_are_not_kept():
    assert unpack(np.zeros((4, 256), np.uint8), QT.F32, (4, 64)) is None
    assert unpack(np.zeros((4, 220), np.uint8), QT.Q5_K, (4, 256)) is None
    assert unpack(np.zeros((4, 210 * 3 // 2), np.uint8), QT.Q6_K, (4, 384)) is None  # not whole super-blocks
    assert set(KEPT_FORMATS) == {"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}


@pytest.mark.parametrize("tokens", [1, 3, 5, 16, 40, 70])
@pytest.mark.parametrize("nibbles", [False, True])
def test_every_kernel_path_scales_groups_of_16(tokens, nibbles):
    """A weight with a scale per 16 inputs (Q6_K; and Q4_K stacked with it, offsets included) on each
    path of `block_matmul` (dot products, the micro-kernel, dequantized tiles through BLAS), as int8
    codes and as packed nibbles: the product of its dequantized weights. A kernel that read one
    scale per block of 32 would be off by the ratio of the two halves' scales."""
    rng = np.random.default_rng(tokens + 100 * nibbles)
    q6_raw, _ = _q6_k(rng, 20, 256)
    q6 = unpack(q6_raw, QT.Q6_K, (20, 256))
    q4_raw = rng.integers(0, 256, (9, 144), dtype=np.uint8)  # 9 rows of one Q4_K super-block
    for at in (0, 2):
        q4_raw[:, at:at + 2] = (rng.random((9, 1)) * 0.01).astype(np.float16).view(np.uint8)
    q4 = unpack(q4_raw, QT.Q4_K, (9, 256))
    stacked = concat_rows([q6, q4])
    assert stacked.group == 16 and stacked.kind == "Q6_K+Q4_K"
    w = stacked.dequantize()
    np.testing.assert_array_equal(w, np.concatenate([q6.dequantize(), q4.dequantize()]))
    codes = stacked.codes
    if nibbles:  # codes 0..15 only: shift Q6_K's into range, the shift folded into the offsets
        codes = np.concatenate([q6.codes % 16, q4.codes]).astype(np.int8)
        w = (stacked.scales.reshape(29, -1, 1) * codes.reshape(29, -1, 16)
             + stacked.offsets.reshape(29, -1, 1)).reshape(29, 256)
        c = codes.view(np.uint8)
        codes = np.ascontiguousarray(c[..., :16] | (c[..., 16:] << 4))
    x = rng.standard_normal((tokens, 256)).astype(np.float32)
    y = cpu_block_matmul.block_matmul(x, codes, stacked.scales, stacked.offsets)
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_row_operations_follow_the_dequantized_rows():
    rng = np.random.default_rng(1)
    parts = [unpack(_quantized(rng, r, 64, QT.Q4_1)[0], QT.Q4_1, (r, 64)) for r in (8, 4)]
    stacked = concat_rows(parts)
    np.testing.assert_array_equal(stacked.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    flipped = stacked.map_rows(lambda a: a[::-1])
    np.testing.assert_array_equal(flipped.dequantize(), stacked.dequantize()[::-1])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), out=st.integers(1, 70), in_blocks=st.integers(1, 6),
       qtype=st.sampled_from([QT.Q4_0, QT.Q4_1, QT.Q8_0]), seed=st.integers(0, 2**16))
def test_block_matmul_matches_float_matmul(rows, out, in_blocks, qtype, seed):
    rng = np.random.default_rng(seed)
    raw, w = _quantized(rng, out, 32 * in_blocks, qtype)
    blocks = unpack(raw, qtype, w.shape)
    x = rng.standard_normal((rows, w.shape[1])).astype(np.float32)
    y = cpu_block_matmul.block_matmul(x, blocks.codes, blocks.scales, blocks.offsets)
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_one_row_is_computed_the_same_with_or_without_threads(monkeypatch):
    rng = np.random.default_rng(2)
    raw, w = _quantized(rng, 300, 128, QT.Q4_1)
    blocks = unpack(raw, QT.Q4_1, w.shape)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    serial = cpu_block_matmul.block_matmul(x, blocks.codes, blocks.scales, blocks.offsets)
    monkeypatch.setattr(cpu_block_matmul, "PARALLEL_MIN_WEIGHTS", 1)  # now the threaded kernel
    np.testing.assert_array_equal(cpu_block_matmul.block_matmul(x, blocks.codes, blocks.scales, blocks.offsets),
                                  serial)


@pytest.mark.parametrize("rows", [1, 5])
def test_packed_nibbles_compute_like_their_int8_codes(rows):
    """Q4 codes packed two a byte (byte j of a block: code j low, code j + 16 high) give the
    product of the int8 codes they pack."""
    rng = np.random.default_rng(7)
    raw, w = _quantized(rng, 40, 128, QT.Q4_1)
    blocks = unpack(raw, QT.Q4_1, w.shape)
    c = blocks.codes.view(np.uint8)
    nibbles = np.ascontiguousarray(c[..., :16] | (c[..., 16:] << 4))
    x = rng.standard_normal((rows, 128)).astype(np.float32)
    from_codes = cpu_block_matmul.block_matmul(x, blocks.codes, blocks.scales, blocks.offsets)
    from_nibbles = cpu_block_matmul.block_matmul(x, nibbles, blocks.scales, blocks.offsets)
    np.testing.assert_allclose(from_nibbles, from_codes, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(from_nibbles, x @ w.T, rtol=1e-5, atol=1e-4)


def _rows_of(blocks, qtype):
    """A weight's 2-d rows as the kernels read them: nibbles for Q4 formats, int8 codes for Q8_0."""
    codes = blocks.codes
    if qtype != QT.Q8_0:
        if qtype == QT.Q4_0:  # the fused step's shift to codes 0..15: d * (q - 8) = d * q + (-8 d)
            codes, offsets = codes + np.int8(8), blocks.offsets - 8 * blocks.scales
        else:
            offsets = blocks.offsets
        c = codes.view(np.uint8)
        return np.ascontiguousarray(c[..., :16] | (c[..., 16:] << 4)).reshape(len(c), -1), blocks.scales, offsets
    return np.ascontiguousarray(codes).reshape(len(codes), -1), blocks.scales, blocks.offsets


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
@pytest.mark.parametrize("tokens", [4, 16, 21, 40])
def test_register_blocked_kernel_matches_the_blas_path(qtype, tokens):
    """The micro-kernel on the codes (several tokens, full and partial tiles of rows and tokens)
    against the dequantized tiles through BLAS it replaces for decode batches."""
    rng = np.random.default_rng(int(qtype) * 100 + tokens)
    out_features = 70  # 17 tiles of 4 rows and 2 single rows
    raw, w = _quantized(rng, out_features, 96, qtype)
    codes, scales, offsets = _rows_of(unpack(raw, qtype, w.shape), qtype)
    x = rng.standard_normal((tokens, 96)).astype(np.float32)
    tiled = np.full((tokens, out_features), np.nan, np.float32)
    xt = cpu_block_matmul.padded_transpose(x)
    cpu_block_matmul.tiled_rows(xt, codes, scales, offsets, np.empty((out_features, xt.shape[1]), np.float32),
                                tiled, 0, out_features)
    blas = np.full((tokens, out_features), np.nan, np.float32)
    cpu_block_matmul.blas_rows(np.ascontiguousarray(x.T), codes, scales, offsets,
                               np.empty((out_features, 96), np.float32), blas, 0, out_features)
    np.testing.assert_allclose(tiled, blas, rtol=1e-5, atol=1e-5 * np.abs(blas).max())
    np.testing.assert_allclose(tiled, x @ w.T, rtol=1e-5, atol=1e-4)


def test_a_tokens_product_does_not_depend_on_the_batch_beside_it():
    """Within the register-blocked kernel every output sums its products in the same order, so a
    token gets the same numbers, bit for bit, in a batch of 5 and in a batch of 37."""
    rng = np.random.default_rng(9)
    raw, w = _quantized(rng, 64, 128, QT.Q4_1)
    blocks = unpack(raw, QT.Q4_1, w.shape)
    x = rng.standard_normal((37, 128)).astype(np.float32)
    small = cpu_block_matmul.block_matmul(x[:5], blocks.codes, blocks.scales, blocks.offsets)
    large = cpu_block_matmul.block_matmul(x, blocks.codes, blocks.scales, blocks.offsets)
    assert 5 > cpu_block_matmul.MATVEC_T and 37 <= cpu_block_matmul.SMALL_T  # both on the micro-kernel
    np.testing.assert_array_equal(small, large[:5])


def test_block_matmul_rejects_mismatched_inputs():
    blocks = unpack(_quantized(np.random.default_rng(3), 4, 64, QT.Q8_0)[0], QT.Q8_0, (4, 64))
    with pytest.raises(ValueError, match="does not match"):
        cpu_block_matmul.block_matmul(np.zeros((1, 96), np.float32), blocks.codes, blocks.scales, blocks.offsets)
    with pytest.raises(ValueError, match="float32"):
        cpu_block_matmul.block_matmul(np.zeros((1, 64), np.float64), blocks.codes, blocks.scales, blocks.offsets)
    with pytest.raises(ValueError, match="does not match"):  # nibbles hold 16 bytes a block, not 32
        cpu_block_matmul.block_matmul(np.zeros((1, 64), np.float32), blocks.codes.view(np.uint8), blocks.scales,
                                      blocks.offsets)


def test_block_weight_multiplies_float32_paddle_tensors():
    raw, w = _quantized(np.random.default_rng(4), 16, 64, QT.Q4_0)
    bw = BlockWeight(unpack(raw, QT.Q4_0, w.shape))
    x = paddle.randn([1, 3, 64])
    assert bw.accepts(x) and not bw.accepts(x.astype("float64"))
    y = bw.matmul(x)
    assert y.shape == [1, 3, 16]
    np.testing.assert_allclose(y.numpy(), x.numpy() @ w.T, rtol=1e-5, atol=1e-4)


def test_a_prefill_sized_product_runs_on_the_float_weight_when_given():
    """More than SMALL_T rows with the float ``[in, out]`` weight at hand: one BLAS product on it (the
    same numbers as NumPy's), not the blocks; fewer rows, or no weight, stay on the blocks."""
    rng = np.random.default_rng(5)
    raw, w = _quantized(rng, 48, 64, QT.Q4_0)
    bw = BlockWeight(unpack(raw, QT.Q4_0, w.shape))
    weight = paddle.to_tensor(np.ascontiguousarray(w.T))
    many = paddle.randn([1, cpu_block_matmul.SMALL_T + 1, 64])
    np.testing.assert_array_equal(bw.matmul(many, weight).numpy()[0], many.numpy()[0] @ w.T)
    for x, given in ((many, None), (many[:, :cpu_block_matmul.SMALL_T], weight)):
        blocks = cpu_block_matmul.block_matmul(x.numpy()[0], bw.codes, bw.scales, bw.offsets)
        np.testing.assert_array_equal(bw.matmul(x, given).numpy()[0], blocks)


def test_smollm2_blocks_equal_its_dequantized_weights(smollm2_checkpoint, smollm2_state_dict):
    blocks = smollm2_checkpoint.quantized_blocks()
    # every linear of the 30 layers (Q4_1) and the embedding / tied LM head (Q8_0)
    assert len(blocks) == 30 * 7 + 1
    assert {b.kind for b in blocks.values()} == {"Q4_1", "Q8_0"}
    for name, b in blocks.items():  # Q/K rows come un-permuted, like the float weights
        np.testing.assert_array_equal(b.dequantize(), smollm2_state_dict[name], err_msg=name)


def test_quantized_decode_keeps_greedy_output_and_logprobs(smollm2_llm):
    """quantization='auto' (the shared LLM) vs 'none': same greedy tokens, logprobs within 1e-3,
    for one request (the dot kernel) and for a batch of three (the tiled kernel)."""
    from engine import LLM, SamplingParams

    model = smollm2_llm.engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.block_weight is not None and model.lm_head_blocks is not None
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    prompts = ["The three primary colors are", "Water boils at", "The largest planet is"]
    auto = [o.outputs[0] for o in smollm2_llm.generate(prompts[:1], params) + smollm2_llm.generate(prompts, params)]
    plain_llm = LLM(model="smollm2-135m-instruct", quantization="none")
    try:
        assert plain_llm.engine.runner.model.layers[0].self_attn.qkv_proj.block_weight is None
        plain = [o.outputs[0] for o in plain_llm.generate(prompts[:1] + prompts, params)]
    finally:
        plain_llm.shutdown()
    for a, p in zip(auto, plain):
        assert a.token_ids == p.token_ids
        deltas = [abs(x[t].logprob - y[t].logprob) for t, x, y in zip(a.token_ids, a.logprobs, p.logprobs)]
        assert max(deltas) <= 1e-3


def test_bad_quantization_mode_is_rejected():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of auto, none; got 'int4'"):
        EngineConfig(quantization="int4")
