"""The model-impl fallback: selection, the attention adapters, and borrowed models on the paged cache.

* ``auto``/explicit ``model_impl`` resolution and its errors;
* the PaddleFormers attention function against dense attention (the PaddleFleet
  adapter has its own file, test_paddlefleet_adapter.py);
* SmolLM2 through PaddleFormers vs the native model (alignment), and the
  fallback's greedy output under prefix caching, chunked prefill, preemption;
* (Gemma 3 270M through PaddleFormers vs HF transformers: test_fallback_gemma3.py)
* the PaddleFleet backend end to end, wherever paddlefleet is installed.
"""

import importlib.util
import json
import os
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from engine import LLM, SamplingParams
from engine.align import compare_backends
from engine.attention import AttentionMetadata, dense_causal_attention
from engine.fallback.attention_adapter import paged_attention_forward
from engine.fallback.step_context import bind_step
from engine.model_impl import resolve_model_impl
from engine.models import EngineModel
from tiny_models import make_tiny_model, packed_prefill_step, tiny_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SHARED = ("You are a helpful assistant. Answer briefly and precisely, in one sentence, "
          "without any preamble or apology. ")
PROMPTS = [SHARED + q for q in ("What is the capital of Italy?", "Name a primary colour.",
                                "How many legs has a spider?", "What do bees make?")]
SMOL_BLOCK_BYTES = 2 * 30 * 3 * 16 * 64 * 4  # K+V x layers x KV heads x block_size x head_dim x fp32


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


# ---------------------------------------------------------------- selection


def test_auto_prefers_native_and_falls_back_to_paddleformers():
    assert resolve_model_impl("auto", "LlamaForCausalLM") == "native"
    assert resolve_model_impl("auto", "Qwen3ForCausalLM") == "native"
    assert resolve_model_impl("auto", "Gemma3ForCausalLM") == "paddleformers"
    assert resolve_model_impl("paddleformers", "LlamaForCausalLM") == "paddleformers"


def test_native_without_implementation_lists_native_architectures():
    with pytest.raises(ValueError) as err:
        resolve_model_impl("native", "Gemma3ForCausalLM")
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)


def test_paddleformers_without_the_class_says_so():
    from engine.fallback.hf_config import paddleformers_class

    with pytest.raises(ValueError, match="no NotAModelForCausalLM class"):
        paddleformers_class("NotAModelForCausalLM")


@pytest.fixture
def no_paddlefleet(monkeypatch):
    """Make `paddlefleet` look uninstalled, whatever this machine has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] == "paddlefleet" else real(name, *a, **k))


def test_missing_paddlefleet_explains_and_breaks_nothing(no_paddlefleet, tmp_path):
    from engine.fallback.paddlefleet import build_paddlefleet_model

    tiny = make_tiny_model(str(tmp_path / "llama"), "LlamaForCausalLM", seed=3)
    for attempt in (lambda: LLM(model=tiny, model_impl="paddlefleet"),
                    lambda: build_paddlefleet_model(None, "float32", "cpu")):
        with pytest.raises(ValueError) as err:
            attempt()
        message = str(err.value)
        assert "paddlefleet" in message and "Paddle's own package index" in message
    prompts = tiny_prompts(2)
    native_llm = LLM(model=tiny, model_impl="native")
    native = native_llm.generate(prompts, GREEDY)
    borrowed = LLM(model=tiny, model_impl="paddleformers")
    assert borrowed.model_impl == "paddleformers"
    assert isinstance(native_llm.engine.runner.model, EngineModel)
    assert isinstance(borrowed.engine.runner.model, EngineModel)
    assert token_ids(borrowed.generate(prompts, GREEDY)) == token_ids(native)


# ---------------------------------------------------------------- adapters vs reference




def _dense_reference(q, k, v, lengths, scale, window):
    """q/k/v packed [T, heads, D]: plain causal attention per sequence, concatenated."""
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(dense_causal_attention(q[sl], k[sl], v[sl], scale=scale, sliding_window=window).numpy())
        start += n
    return np.concatenate(outs)


@pytest.mark.parametrize("window", [None, 3])
def test_paddleformers_attention_function_matches_dense_attention(window):
    rng = np.random.default_rng(0)
    lengths, heads, kv_heads, dim = [5, 9], 4, 2, 8
    q, k, v = (rng.standard_normal((sum(lengths), h, dim)).astype(np.float32) for h in (heads, kv_heads, kv_heads))
    meta, caches = packed_prefill_step(lengths, kv_heads, dim)
    layer = SimpleNamespace(layer_idx=1, sliding_window=window, scaling=0.3)
    as_library = lambda x: paddle.to_tensor(x).transpose([1, 0, 2]).unsqueeze(0)  # [1, heads, T, D]
    with bind_step(meta, caches):
        out, weights = paged_attention_forward(layer, as_library(q), as_library(k), as_library(v),
                                               attention_mask=None, scaling=0.3)
    assert weights is None and out.shape == [1, sum(lengths), heads * dim]
    ref = _dense_reference(paddle.to_tensor(q), paddle.to_tensor(k), paddle.to_tensor(v), lengths, 0.3, window)
    np.testing.assert_allclose(out.numpy()[0], ref.reshape(sum(lengths), -1), atol=1e-5)
    assert float(paddle.abs(caches[1][0]).sum()) > 0  # this layer's cache was written...
    assert float(paddle.abs(caches[0][0]).sum()) == 0 and float(paddle.abs(caches[2][0]).sum()) == 0  # ...only it


def test_attention_outside_a_step_is_an_explicit_error():
    x = paddle.zeros([1, 2, 3, 8])
    with pytest.raises(RuntimeError, match="outside an engine step"):
        paged_attention_forward(SimpleNamespace(layer_idx=0), x, x, x)


def test_a_model_bypassing_our_attention_is_refused(tmp_path):
    from engine.fallback.paddleformers import _probe_step, build_paddleformers_model
    from engine.loader import load_checkpoint

    wrapped = build_paddleformers_model(load_checkpoint(make_tiny_model(str(tmp_path / "llama"), seed=3)),
                                        "float32", "cpu")  # its load-time probe passed
    wrapped.model.config._attn_implementation = "sdpa"  # as if the class ignored the interface
    with paddle.no_grad(), pytest.raises(RuntimeError, match="bypasses PaddleFormers' attention interface"):
        wrapped.forward(*_probe_step(wrapped))


def test_speedups_compute_what_the_library_layers_compute():
    from paddleformers.nn.norm import RMSNorm
    from paddleformers.transformers import LlamaConfig
    from paddleformers.transformers.gemma3_text.configuration import Gemma3TextConfig
    from paddleformers.transformers.gemma3_text.modeling import Gemma3RMSNorm, Gemma3RMSNormPipe

    from engine.fallback.speedups import apply_speedups

    rng = np.random.default_rng(2)
    layers = [RMSNorm(LlamaConfig(hidden_size=64, rms_norm_eps=1e-5, fuse_rms_norm=False)),
              Gemma3RMSNorm(64, eps=1e-6), Gemma3RMSNormPipe(Gemma3TextConfig(hidden_size=64))]
    x = paddle.to_tensor(rng.standard_normal((1, 7, 64)).astype(np.float32) * 3)
    for layer in layers:
        layer.weight.set_value(rng.standard_normal(64).astype(np.float32))
        expected = type(layer).forward(layer, x).numpy()  # the library's own forward
        assert apply_speedups(layer) == [type(layer).__name__]
        np.testing.assert_allclose(layer(x).numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layers[-1]((x, None)).numpy(), expected, rtol=1e-5, atol=1e-5)  # a pipeline tuple


def test_a_prefill_sized_linear_computes_what_paddle_computes():
    from engine.fallback.speedups import apply_speedups
    from gpu_kernels.cpu.block_matmul import SMALL_T

    rng = np.random.default_rng(3)
    layer = paddle.nn.Linear(64, 40)
    for rows in (3, SMALL_T + 5):
        x = paddle.to_tensor(rng.standard_normal((1, rows, 64)).astype(np.float32))
        expected = paddle.nn.functional.linear(x, layer.weight, layer.bias).numpy()
        if rows > SMALL_T:  # on NumPy's BLAS: the same product as NumPy's
            expected_blas = x.numpy() @ layer.weight.numpy() + layer.bias.numpy()
        assert apply_speedups(layer) == ["Linear"]
        np.testing.assert_allclose(layer(x).numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(layer(x).numpy(), expected_blas)


def test_rotary_embedding_speedup_is_bit_identical_to_the_library():
    """Gemma 3's ``apply_rotary_pos_emb`` with its cos/sin broadcast over the heads expanded first:
    the same numbers bit for bit, on the strided query/key views the attention layer passes."""
    import paddleformers.transformers.gemma3_text.modeling as gemma3

    from engine.fallback.speedups import apply_speedups

    rng = np.random.default_rng(6)
    tokens, heads, dim = 9, 4, 16
    mix = paddle.to_tensor(rng.standard_normal((1, tokens, 1, (heads + 2) * dim)).astype(np.float32))
    q, k, _ = paddle.split(mix, [heads * dim, dim, dim], axis=-1)
    q, k = q.reshape([1, tokens, heads, dim]).transpose([0, 2, 1, 3]), k.transpose([0, 2, 1, 3])
    cos, sin = (paddle.to_tensor(rng.standard_normal((1, tokens, dim)).astype(np.float32)) for _ in range(2))
    original = getattr(gemma3.apply_rotary_pos_emb, "original", gemma3.apply_rotary_pos_emb)
    expected = original(q, k, cos, sin)
    model = gemma3.Gemma3ForCausalLM.__new__(gemma3.Gemma3ForCausalLM)  # only its class is looked at
    paddle.nn.Layer.__init__(model)
    assert apply_speedups(model) == ["gemma3_text.apply_rotary_pos_emb"]
    assert gemma3.apply_rotary_pos_emb.original is original
    for got, want in zip(gemma3.apply_rotary_pos_emb(q, k, cos, sin), expected):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    half = gemma3.apply_rotary_pos_emb(q, k, cos.astype("float16"), sin.astype("float16"))  # not float32: the library's
    np.testing.assert_array_equal(half[0].numpy(), original(q, k, cos.astype("float16"), sin.astype("float16"))[0].numpy())


def test_rope_kernel_is_the_library_formula_bit_for_bit():
    """``gpu_kernels.cpu.rope`` against PaddleFormers' Llama ``apply_rotary_pos_emb`` (its own
    ``rotate_half``): contiguous and strided inputs, cos/sin of batch 1 broadcast over a batch of 2."""
    import paddleformers.transformers.llama.modeling as llama

    from gpu_kernels.cpu.rope import rope_rotate_half

    library = getattr(llama.apply_rotary_pos_emb, "original", llama.apply_rotary_pos_emb)
    rng = np.random.default_rng(7)
    x = paddle.to_tensor(rng.standard_normal((2, 5, 3, 10)).astype(np.float32))
    cos, sin = (paddle.to_tensor(rng.standard_normal((1, 5, 10)).astype(np.float32)) for _ in range(2))
    for q in (x.transpose([0, 2, 1, 3]), x.transpose([0, 2, 1, 3]).contiguous()):
        want = library(q, q, cos, sin)[0].numpy()
        got = rope_rotate_half(q.numpy(), cos.numpy(), sin.numpy(), np.empty(q.shape, np.float32))
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="head_dim even"):
        rope_rotate_half(np.zeros((1, 1, 2, 3), np.float32), np.zeros((1, 2, 3), np.float32),
                         np.zeros((1, 2, 3), np.float32), np.zeros((1, 1, 2, 3), np.float32))


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_mlp_speedup_computes_what_the_library_mlp_computes(arch, monkeypatch):
    """The gated activation in one pass (``gpu_kernels.cpu.gated``) against the library's
    ``MLP.forward``: Gemma 3's tanh GELU on its own ``up_gate_proj``, and Llama's SiLU behind
    ``gate_proj``/``up_proj`` fused by `fusion`; rows past a multiple of 8 wide included."""
    from paddleformers.nn.mlp import MLP
    from paddleformers.transformers import LlamaConfig
    from paddleformers.transformers.gemma3_text.configuration import Gemma3TextConfig
    from paddleformers.transformers.gemma3_text.modeling import Gemma3MLP

    from engine.fallback.fusion import fuse_projections
    from engine.fallback.speedups import apply_speedups

    rng = np.random.default_rng(8)
    hidden, inter = 24, 44   # 44: the vector routine's last 4 columns are the scalar tail
    if arch == "gemma3":
        mlp = Gemma3MLP(Gemma3TextConfig(hidden_size=hidden, intermediate_size=inter,
                                         hidden_activation="gelu_pytorch_tanh"), fuse_up_gate=True)
    else:
        mlp = MLP(LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu"))
    for p in mlp.parameters():
        p.set_value(rng.standard_normal(p.shape).astype(np.float32) * 0.5)
    x = paddle.to_tensor(rng.standard_normal((1, 37, hidden)).astype(np.float32))
    expected = MLP.forward(mlp, x).numpy()
    assert apply_speedups(mlp) == sorted(["Linear", type(mlp).__name__])
    if arch == "llama":
        assert fuse_projections(mlp)["fused_gate_up"] == 1
    got = mlp(x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    monkeypatch.setattr("gpu_kernels.cpu.gated.PARALLEL_MIN_ELEMENTS", 0)  # rows in blocks on the threads
    np.testing.assert_array_equal(mlp(x).numpy(), got)
    mlp.act_fn = paddle.nn.ReLU()  # an activation the kernel does not run: the library's forward
    np.testing.assert_array_equal(mlp(x).numpy(), MLP.forward(mlp, x).numpy())


def test_sliding_row_indices_speedup_matches_the_library_loop():
    """``prepare_sliding_window_startend_row_indices`` on the packed row indices the backend passes
    (two requests, a window shorter than the pack): the library's integers exactly."""
    from paddleformers.transformers import masking_utils
    from paddleformers.transformers.gemma3_text.configuration import Gemma3TextConfig

    from engine.fallback.speedups import apply_speedups

    config = Gemma3TextConfig(num_hidden_layers=2, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    model = paddle.nn.Layer()
    model.config = config
    assert apply_speedups(model) == ["masking_utils.prepare_sliding_window_startend_row_indices"]
    fast = masking_utils.prepare_sliding_window_startend_row_indices
    rows = paddle.to_tensor(np.repeat([9, 9, 9, 9, 9, 9, 9, 9, 9, 13, 13, 13, 13], 1).reshape(1, 1, -1, 1)
                            .astype(np.int32))
    want = fast.original(rows, window_size=4)
    got = fast(rows, window_size=4)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert not np.array_equal(got.numpy(), rows.numpy())  # the window did change some rows


def test_fused_qkv_rows_come_apart_the_way_gemma3_splits_them():
    from engine.fallback.weights import fuse_qkv

    rng = np.random.default_rng(4)
    heads, kv_heads, dim, hidden, tokens = 4, 2, 8, 16, 3
    q, k, v = (rng.standard_normal((n * dim, hidden)) for n in (heads, kv_heads, kv_heads))
    x = rng.standard_normal((tokens, hidden))
    mix = (x @ fuse_qkv(q, k, v, heads, kv_heads).T).reshape(tokens, kv_heads, (heads // kv_heads + 2) * dim)
    q_out, k_out, v_out = np.split(mix, [heads // kv_heads * dim, (heads // kv_heads + 1) * dim], axis=-1)
    np.testing.assert_allclose(q_out.reshape(tokens, heads, dim), (x @ q.T).reshape(tokens, heads, dim))
    np.testing.assert_allclose(k_out, (x @ k.T).reshape(tokens, kv_heads, dim))
    np.testing.assert_allclose(v_out, (x @ v.T).reshape(tokens, kv_heads, dim))


def test_export_hf_directory_round_trips(tmp_path):
    from engine.fallback.hf_export import export_hf_directory
    from engine.loader import load_checkpoint

    from safetensors.numpy import load_file

    original = load_checkpoint(make_tiny_model(str(tmp_path / "src"), "Qwen2ForCausalLM", seed=2))
    out = export_hf_directory(original, str(tmp_path / "out"))
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["architectures"] == ["Qwen2ForCausalLM"]
    a, b = original.state_dict(), load_file(os.path.join(out, "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


# ---------------------------------------------------------------- SmolLM2 through PaddleFormers


@pytest.fixture(scope="module")
def smollm2_pf():
    llm = LLM(model="smollm2-135m-instruct", model_impl="paddleformers", dtype="float32")
    assert llm.model_impl == "paddleformers" and llm.snapshot().model_impl == "paddleformers"
    return llm


@pytest.fixture(scope="module")
def pf_baseline(smollm2_pf):
    return token_ids(smollm2_pf.generate(PROMPTS, GREEDY))


def test_smollm2_native_and_paddleformers_align(smollm2_llm, smollm2_pf):
    prompts = ["Question: What is 2+3?\nAnswer:", "The capital of France is",
               [{"role": "user", "content": "Name three fruits."}]]
    text_prompts = [p if isinstance(p, str) else smollm2_llm.get_tokenizer().apply_chat_template(
        p, add_generation_prompt=True) for p in prompts]  # the chat turn holds <|im_end|>, SmolLM2's pad id
    report = compare_backends(smollm2_llm, smollm2_pf, text_prompts, max_tokens=32)
    print("\n" + report.table())
    assert (report.impl_a, report.impl_b) == ("native", "paddleformers")
    assert report.top1_agreement == 1.0
    assert report.max_abs_logprob_diff <= 1e-3
    assert all(r.greedy_identical and r.greedy_tokens >= 32 for r in report.rows)


def test_fallback_greedy_with_prefix_caching_off_and_on(smollm2_pf, pf_baseline):
    off = LLM(model="smollm2-135m-instruct", model_impl="paddleformers", enable_prefix_caching=False)
    assert token_ids(off.generate(PROMPTS, GREEDY)) == pf_baseline
    smollm2_pf.generate(PROMPTS[0], GREEDY)  # its prompt's full blocks are now cached
    outs = smollm2_pf.generate(PROMPTS, GREEDY)
    assert token_ids(outs) == pf_baseline
    assert all(o.num_cached_tokens >= 16 for o in outs)  # the shared prefix came from the cache


def test_fallback_streams_the_same_tokens_with_logprobs(smollm2_pf, pf_baseline):
    deltas = list(smollm2_pf.stream(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                               logprobs=2)))
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == pf_baseline[1]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(logprobs) == 24 and all(lp[t].rank == 1 for lp, t in zip(logprobs, pf_baseline[1]))


def test_fallback_greedy_with_chunked_prefill(pf_baseline):
    llm = LLM(model="smollm2-135m-instruct", model_impl="paddleformers", max_num_batched_tokens=7)
    sizes = []
    llm.subscribe(lambda e: sizes.append(e.data["num_tokens"]) if e.kind == "step" else None)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == pf_baseline
    assert max(sizes) <= 7


def test_fallback_greedy_under_preemption(pf_baseline):
    llm = LLM(model="smollm2-135m-instruct", model_impl="paddleformers", kv_cache_memory=7 * SMOL_BLOCK_BYTES)
    kinds = []
    llm.subscribe(lambda e: kinds.append(e.kind))
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == pf_baseline
    assert "request_preempted" in kinds
    assert not llm.snapshot().requests


# ---------------------------------------------------------------- PaddleFleet (where installed)


@pytest.mark.paddlefleet
def test_paddlefleet_backend_matches_native(tmp_path):
    pytest.importorskip("paddlefleet", reason="paddlefleet installs from Paddle's own index, not PyPI")
    tiny = make_tiny_model(str(tmp_path / "qwen3"), "Qwen3ForCausalLM", seed=3)
    prompts = tiny_prompts(3)
    native = LLM(model=tiny, model_impl="native").generate(prompts, GREEDY)
    fleet = LLM(model=tiny, model_impl="paddlefleet")
    assert fleet.model_impl == "paddlefleet"
    assert token_ids(fleet.generate(prompts, GREEDY)) == token_ids(native)
