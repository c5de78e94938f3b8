"""The PaddleFleet adapter on stand-ins of PaddleFleet's classes (paddlefleet is not on PyPI).

Each stand-in sets the attributes its PaddleFleet class sets, as recorded from
PaddlePaddle/PaddleFleet (``src/paddlefleet/``) and FastDeploy:

* ``models/gpt/gpt_layer_specs.py`` @ 010506c199fe3656333a8dae917a75bb2fe0ec63:
  ``get_gpt_decoder_layers_spec`` numbers layers ``range(num_hidden_layers)``
  plus ``config.num_empty_layers_add_in_head`` (0-based);
* ``transformer/transformer_layer.py`` @ 016a57d186b3b2c6c64ea70001383d2b9de78a16:
  ``TransformerLayer`` keeps ``config``, ``layer_number`` as given, ``self_attn``;
* ``transformer/dot_product_attention.py`` @ 00a9f175a76aa0dc93c445746a3c90efa5566069:
  ``DotProductAttention`` keeps ``layer_number = max(1, layer_number)``, per-partition
  ``num_attention_heads_per_partition`` / ``num_query_groups_per_partition`` /
  ``hidden_size_per_attention_head``, ``softmax_scale`` (default ``1/sqrt(head_dim)``,
  divided by the layer number under ``apply_query_key_layer_scaling``) and
  ``scale_mask_softmax = FusedScaleMaskSoftmax(scale=that layer number or None,
  sliding_window=config.sliding_window if is_layer_window_attention(...))``; its
  fp32 path computes ``softmax(scale * (softmax_scale * q.k))``;
* ``fusions/fused_softmax.py`` @ 751ba01542a382a802055a82b7cc1b77bdeb3950:
  ``FusedScaleMaskSoftmax`` keeps ``scale`` and ``sliding_window``; its forward scales the
  scores by ``scale``, masks them with ``get_sliding_window_causal_mask(sq, sk, sliding_window)``
  when there is a window (else the causal mask when ``sq > 1``) through ``attention_mask_func``
  (``masked_fill_(mask, -10000.0)``), then softmax;
* ``transformer/utils.py`` @ d2a7743e5c125c706fcc4b988fde056ab05d367e:
  ``is_layer_window_attention`` (0-based layer number, ``window_attn_skip_freq``);
  ``get_sliding_window_causal_mask`` reads an int ``W`` as ``(left=W, right=0)``, masks (True)
  all but ``triu(diagonal=skv - sq - left)`` and ``tril(diagonal=skv - sq + right)``, and skips
  the ``triu`` for ``left < 0``; ``startend_row_indices_add_sliding_window`` takes
  ``left`` of either form (``get_sliding_window_left_size``), returns the rows unchanged for
  ``left <= 0``, else caps each key column's lower-triangle start row at ``column + left``;
* Paddle 3.3.1 ``paddle/nn/functional/flash_attention.py`` (installed), ``flashmask_attention``:
  with ``causal=True`` and one row index per key column ``j``, rows from
  ``startend_row_indices[..., j, 0]`` down are masked (its ``flashmask_to_densemask``);
* ``models/gpt/gpt_model.py`` @ 0031070c7db389c69c1d913272f893f666e910e5: ``run_function``
  is embedding, head empty layers, transformer layers, final norm, (MTP), LM head;
* ``models/gpt/gpt_embedding.py`` @ 016a57d186b3b2c6c64ea70001383d2b9de78a16:
  ``GPTEmbedding.forward(dict_args, decoder_input=None)`` returns a dict with ``hidden_states``;
* ``transformer/attention.py`` @ 0642f935cd6cc069f99b9055197b2fef7ac154fb: ``SelfAttention``
  holds ``core_attention``, applies RoPE by ``position_ids``, calls the core attention with
  ``[b, s, heads, D]`` tensors; sliding-window layers may have their own ``swa_head_dim`` /
  ``swa_num_key_value_heads``;
* paddleformers 1.2 ``transformers/gpt_provider.py`` (installed): ``get_input_embeddings()``
  is the ``GPTEmbedding``'s ``embedding.embed_tokens``, ``get_lm_head()`` the ``GPTLMHead``;
* FastDeploy ``fastdeploy/model_executor/models/paddleformers/base_fleet.py`` @
  07fdfbe6321c749aaddbe9276a1ebc63d00d90fb: the cache id is the ``TransformerLayer``'s
  ``layer_number``; the model is fed ``{"input_ids": None, "position_ids": positions}``
  with the embeddings as ``decoder_input``; the LM head takes ``[s, b, h]``.
"""
import math
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from engine.fallback.paddlefleet import PaddleFleetModel, patch_core_attention
from engine.models import EngineModel
from tiny_models import packed_prefill_step


def is_layer_window_attention(sliding_window, window_attn_skip_freq, layer_number):
    if not sliding_window:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    return bool(window_attn_skip_freq[layer_number])


def sliding_window_causal_mask(sq, skv, sliding_window):
    """``get_sliding_window_causal_mask`` in NumPy: ``[sq, skv]``, True where masked."""
    left, right = (sliding_window, 0) if isinstance(sliding_window, int) else sliding_window
    m = np.ones((sq, skv), dtype=bool)
    mu = m if left < 0 else np.triu(m, k=skv - sq - left)
    return ~np.tril(mu, k=skv - sq + right)


def default_causal_mask(sq):
    """``get_default_causal_mask``: True above the diagonal."""
    return np.triu(np.ones((sq, sq), dtype=bool), k=1)


def flashmask_sliding_window_mask(seq, sliding_window, lts=None):
    """The dense mask (True where masked) of ``startend_row_indices_add_sliding_window`` applied to
    causal ``[..., seq, 1]`` row indices ``lts`` (default ``seq``: nothing below the diagonal), as
    ``flashmask_attention`` reads them with ``causal=True``."""
    lts = np.full(seq, seq, dtype=np.int64) if lts is None else np.asarray(lts)
    left = sliding_window if isinstance(sliding_window, int) else sliding_window[0]
    if sliding_window and left > 0:
        lts = np.minimum(lts, np.arange(left, seq + left))
    mask = default_causal_mask(seq)
    for j in range(seq):
        mask[lts[j]:, j] = True
    return mask


class FusedScaleMaskSoftmax:
    def __init__(self, scale, sliding_window=None):
        self.scale, self.sliding_window = scale, sliding_window

    def __call__(self, scores):  # [np, sq, sk] float32, the fp32 path
        if self.scale is not None:
            scores = scores * self.scale
        sq, sk = scores.shape[1:]
        if self.sliding_window is not None:
            mask = sliding_window_causal_mask(sq, sk, self.sliding_window)
        else:
            mask = default_causal_mask(sq) if sq > 1 else None
        if mask is not None:
            scores = np.where(mask, np.float32(-10000.0), scores)
        e = np.exp(scores - scores.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)


class DotProductAttention:
    """The library's core attention (fp32 path, window included): what an unpatched layer computes."""

    def __init__(self, config, layer_number, softmax_scale=None):
        self.config = config
        self.layer_number = max(1, layer_number)
        projection = config.head_dim * config.num_attention_heads
        self.hidden_size_per_partition = projection            # tensor-parallel world size 1
        self.hidden_size_per_attention_head = projection // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.num_query_groups_per_partition = config.num_key_value_heads
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        coeff = None
        if config.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.softmax_scale /= coeff
        window = (config.sliding_window if is_layer_window_attention(
            config.sliding_window, config.window_attn_skip_freq, layer_number) else None)
        self.scale_mask_softmax = FusedScaleMaskSoftmax(coeff, window)

    def __call__(self, query, key, value, attention_mask, *args, **kwargs):
        q, k, v = (t.numpy()[0].transpose(1, 0, 2) for t in (query, key, value))  # [heads, s, D]
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        k, v = np.repeat(k, groups, axis=0), np.repeat(v, groups, axis=0)  # repeat_interleave on heads
        probs = self.scale_mask_softmax(self.softmax_scale * (q @ k.transpose(0, 2, 1)))
        out = (probs @ v).transpose(1, 0, 2)  # [s, heads, D]
        return paddle.to_tensor(out.reshape(1, out.shape[0], -1).astype(np.float32))


class SelfAttention:
    def __init__(self, config, layer_number, rng):
        self.config = config
        self.core_attention = DotProductAttention(config, layer_number)
        c = config
        self.w = {name: paddle.to_tensor(rng.standard_normal((c.hidden_size, n * c.head_dim)).astype(np.float32) * 0.3)
                  for name, n in (("q", c.num_attention_heads), ("k", c.num_key_value_heads),
                                  ("v", c.num_key_value_heads))}

    def __call__(self, hidden):  # [1, s, h] -> q/k/v [1, s, heads, D] (the stand-in has no RoPE)
        c, s = self.config, hidden.shape[1]
        q, k, v = (paddle.matmul(hidden, self.w[n]).reshape([1, s, -1, c.head_dim]) for n in "qkv")
        return self.core_attention(q, k, v, None)


class TransformerLayer:
    def __init__(self, config, layer_number, rng):
        self.config, self.layer_number = config, layer_number
        self.self_attn = SelfAttention(config, layer_number, rng)
        self.o = paddle.to_tensor(rng.standard_normal((config.num_attention_heads * config.head_dim,
                                                       config.hidden_size)).astype(np.float32) * 0.3)

    def __call__(self, state):
        h = state["hidden_states"]
        return {**state, "hidden_states": h + paddle.matmul(self.self_attn(h), self.o)}


class EmptyLayer:
    def __call__(self, state):
        return state


class GPTEmbedding:
    def __init__(self, config, rng):
        embed_tokens = paddle.nn.Embedding(config.vocab_size, config.hidden_size)
        embed_tokens.weight.set_value(rng.standard_normal((config.vocab_size, config.hidden_size)).astype(np.float32))
        self.embedding = SimpleNamespace(embed_tokens=embed_tokens)

    def __call__(self, dict_args, decoder_input=None):
        assert dict_args["input_ids"] is None and dict_args["position_ids"].ndim == 1
        return {"hidden_states": decoder_input, "position_ids": dict_args["position_ids"]}


class WrappedPaddleNormPipe(EmptyLayer):
    pass


class GPTLMHead:
    def __init__(self, weight):
        self.weight = weight

    def __call__(self, state):  # [s, b, h] -> [s, b, vocab]
        return paddle.matmul(state["hidden_states"], self.weight, transpose_y=True)


class GPTModel:
    def __init__(self, num_layers, *, empty_head_layers=0, qk_layer_scaling=False, sliding_window=None,
                 window_attn_skip_freq=None, heads=4, kv_heads=2, head_dim=8, hidden=16, vocab=32, seed=0):
        rng = np.random.default_rng(seed)
        self.config = SimpleNamespace(
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
            vocab_size=vocab, apply_query_key_layer_scaling=qk_layer_scaling, sliding_window=sliding_window,
            window_attn_skip_freq=window_attn_skip_freq, num_empty_layers_add_in_head=empty_head_layers)
        embedding = GPTEmbedding(self.config, rng)
        layers = [TransformerLayer(self.config, i + empty_head_layers, rng) for i in range(num_layers)]
        self.run_function = [embedding, *[EmptyLayer() for _ in range(empty_head_layers)], *layers,
                             WrappedPaddleNormPipe(), GPTLMHead(embedding.embedding.embed_tokens.weight)]

    def get_input_embeddings(self):
        return self.run_function[0].embedding.embed_tokens

    def get_lm_head(self):
        return self.run_function[-1]

    def layers(self):
        return [m for m in self.run_function if isinstance(m, TransformerLayer)]


def test_cache_index_comes_from_the_transformer_layer_where_layers_0_and_1_share_a_core_number():
    model = GPTModel(3)
    assert [layer.self_attn.core_attention.layer_number for layer in model.layers()] == [1, 1, 2]
    assert [a.layer_index for a in patch_core_attention(model)] == [0, 1, 2]
    shifted = GPTModel(3, empty_head_layers=2)  # transformer layers numbered 2, 3, 4
    assert [layer.layer_number for layer in shifted.layers()] == [2, 3, 4]
    adapters = patch_core_attention(shifted)
    assert [a.layer_index for a in adapters] == [0, 1, 2]
    assert all(layer.self_attn.core_attention is a for layer, a in zip(shifted.layers(), adapters))
    first = adapters[0]
    assert (first.num_heads, first.num_kv_heads, first.head_dim) == (4, 2, 8)


def test_query_key_layer_scaling_is_multiplied_back_like_the_layers_softmax():
    model = GPTModel(3, qk_layer_scaling=True)
    assert [layer.self_attn.core_attention.softmax_scale for layer in model.layers()] == pytest.approx(
        [8 ** -0.5, 8 ** -0.5, 8 ** -0.5 / 2])
    assert [a.scale for a in patch_core_attention(model)] == pytest.approx([8 ** -0.5] * 3)


@pytest.mark.parametrize("window, expected", [(3, [None, 4, None, 4]), ((3, 0), [None, 4, None, 4]),
                                              (2, [None, 3, None, 3]), ((2, 0), [None, 3, None, 3]),
                                              (-1, [None] * 4), ((-1, 0), [None] * 4)])
def test_sliding_window_is_read_as_each_layer_decided(window, expected):
    """An int ``W`` and ``(W, 0)`` are the same window of ``W + 1`` keys (the engine's ``w``: keys > p - w)."""
    model = GPTModel(4, sliding_window=window, window_attn_skip_freq=2)  # layers 1 and 3 slide
    assert [a.sliding_window for a in patch_core_attention(model)] == expected


def test_a_window_that_sees_later_keys_is_refused():
    with pytest.raises(NotImplementedError, match=r"\(2, 1\) lets queries see 1 later keys"):
        patch_core_attention(GPTModel(2, sliding_window=(2, 1)))


def test_fleet_mask_rules_window_forms_and_key_counts():
    """Both forms of a window give one mask in each of PaddleFleet's paths: the fp32 mask keeps the query
    and the ``W`` keys before it, the flashmask row indices keep ``W`` keys (Paddle's own sliding-window
    example: row indices ``j + 3`` keep 3 keys); the adapter follows the fp32 mask its
    ``DotProductAttention`` applies."""
    fp32 = sliding_window_causal_mask(4, 4, 2)
    np.testing.assert_array_equal(~fp32, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]])
    np.testing.assert_array_equal(sliding_window_causal_mask(2, 4, 1), [[1, 0, 0, 1], [1, 1, 0, 0]])  # sq < skv
    np.testing.assert_array_equal(sliding_window_causal_mask(4, 4, (-1, 0)), default_causal_mask(4))
    paddle_example = [[1, 0, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
                      [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]] + [[0] * (i - 2) + [1, 1, 1] + [0] * (9 - i) for i in range(3, 10)]
    np.testing.assert_array_equal(~flashmask_sliding_window_mask(10, 3), paddle_example)
    for w in (1, 2, 5):
        np.testing.assert_array_equal(sliding_window_causal_mask(8, 8, w), sliding_window_causal_mask(8, 8, (w, 0)))
        np.testing.assert_array_equal(flashmask_sliding_window_mask(8, w), flashmask_sliding_window_mask(8, (w, 0)))
        assert (~sliding_window_causal_mask(8, 8, w)).sum(-1)[-1] == w + 1
        assert (~flashmask_sliding_window_mask(8, w)).sum(-1)[-1] == w
        (adapter,) = patch_core_attention(GPTModel(1, sliding_window=w))
        assert adapter.sliding_window == w + 1


@pytest.mark.parametrize("window", [2, (2, 0), 4])
def test_windowed_packed_batch_matches_the_library_fp32_mask(window):
    """Every layer slides; the sequences are longer than the window, so the window cuts keys off."""
    lengths, ids = [6, 9], [[3, 9, 1, 4, 4, 8], [7, 7, 2, 30, 5, 11, 0, 19, 6]]
    expected = np.concatenate([_library_hidden(GPTModel(2, sliding_window=window), s) for s in ids])
    unwindowed = np.concatenate([_library_hidden(GPTModel(2), s) for s in ids])
    assert np.abs(expected - unwindowed).max() > 1e-3  # the window changes the output
    wrapped = PaddleFleetModel(GPTModel(2, sliding_window=window), vocab_size=30)
    meta, caches = packed_prefill_step(lengths, 2, 8, layers=2)
    hidden = wrapped.forward(paddle.to_tensor(np.concatenate(ids).astype(np.int64)), meta.positions, meta, caches)
    np.testing.assert_allclose(hidden.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_layers_that_cannot_map_to_caches_are_refused():
    model = GPTModel(2)
    model.run_function[1], model.run_function[2] = model.run_function[2], model.run_function[1]
    with pytest.raises(ValueError, match=r"indices \[1, 0\]"):
        patch_core_attention(model)




def _library_hidden(model, ids):
    """One sequence through the unpatched stand-in, the library's own attention."""
    state = {"input_ids": None, "position_ids": paddle.arange(len(ids))}
    embeds = model.get_input_embeddings()(paddle.to_tensor(np.array([ids], np.int64)))
    for layer in model.run_function[:-1]:
        state = layer(state, decoder_input=embeds) if isinstance(layer, GPTEmbedding) else layer(state)
    return state["hidden_states"][0].numpy()


def test_packed_batch_on_the_paged_cache_matches_the_library_per_sequence():
    lengths, ids = [5, 7], [[3, 9, 1, 4, 4], [7, 7, 2, 30, 5, 11, 0]]
    expected = np.concatenate([_library_hidden(GPTModel(2, qk_layer_scaling=True), s) for s in ids])
    wrapped = PaddleFleetModel(GPTModel(2, qk_layer_scaling=True), vocab_size=30)
    assert isinstance(wrapped, EngineModel) and wrapped.kv_layout() == (2, 2, 8)
    meta, caches = packed_prefill_step(lengths, 2, 8, layers=2)
    hidden = wrapped.forward(paddle.to_tensor(np.concatenate(ids).astype(np.int64)), meta.positions, meta, caches)
    np.testing.assert_allclose(hidden.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert all(float(paddle.abs(k).sum()) > 0 for k, _ in caches)  # both layers wrote their own cache
    logits = wrapped.compute_logits(hidden)
    assert logits.shape == [12, 30] and logits.dtype == paddle.float32  # the padded vocabulary cut


def test_a_layer_left_on_the_library_attention_fails_the_step():
    model = GPTModel(2)
    wrapped = PaddleFleetModel(model, vocab_size=32)
    model.layers()[1].self_attn.core_attention = DotProductAttention(model.config, 1)
    meta, caches = packed_prefill_step([4], 2, 8, layers=2)
    with pytest.raises(RuntimeError, match=r"1 attention calls .* for 2 layers .*not the engine's adapter"):
        wrapped.forward(paddle.to_tensor(np.arange(4, dtype=np.int64)), meta.positions, meta, caches)


def test_layers_with_different_kv_layouts_are_refused():
    model = GPTModel(2)
    model.layers()[1].self_attn.core_attention.hidden_size_per_attention_head = 16  # a swa_head_dim layer
    with pytest.raises(NotImplementedError, match=r"different KV layouts .* \[\(2, 8\), \(2, 16\)\]"):
        PaddleFleetModel(model, vocab_size=32)


def test_single_device_parallel_state(monkeypatch):
    """``init_single_device`` does what FastDeploy's ``_init_paddlefleet_parallel_state`` does with
    every degree 1: ``fleet.init(is_collective=True, strategy)`` and, when PaddleFleet has no
    tensor-parallel group yet, a one-rank group in ``parallel_state._TENSOR_MODEL_PARALLEL_GROUP``
    (the module attributes FastDeploy sets)."""
    import sys
    import types

    import paddle.distributed as dist
    from paddle.distributed import fleet

    from engine.fallback.paddlefleet import init_single_device

    calls = []
    monkeypatch.setattr(fleet, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(dist, "new_group", lambda ranks: ("group", tuple(ranks)))
    state = types.ModuleType("paddlefleet.parallel_state")
    state._TENSOR_MODEL_PARALLEL_GROUP, state._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = None, None
    package = types.ModuleType("paddlefleet")
    package.parallel_state = state
    monkeypatch.setitem(sys.modules, "paddlefleet", package)
    monkeypatch.setitem(sys.modules, "paddlefleet.parallel_state", state)

    init_single_device()
    (kwargs,) = calls
    assert kwargs["is_collective"] is True
    degrees = {k: v for k, v in kwargs["strategy"].hybrid_configs.items() if k.endswith("_degree")}
    assert set(degrees.values()) == {1} and {"mp_degree", "pp_degree", "dp_degree"} <= set(degrees)
    assert state._TENSOR_MODEL_PARALLEL_GROUP == ("group", (0,)) and state._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS == [0]
    state._TENSOR_MODEL_PARALLEL_GROUP = "existing"
    init_single_device()
    assert state._TENSOR_MODEL_PARALLEL_GROUP == "existing"  # an initialised group is left alone
