"""The PaddleFormers backend, sharded: each rank builds the borrowed ``*ForCausalLM`` (Gemma 3, Llama,
...) with its share of heads, KV heads, MLP and vocab, loads only its slices, and gets the same
three collectives as the native decoder (`layers`):

* the library's model is *constructed small*: its config says ``H / N`` query heads, the rank's KV
  heads (one, replicated, when ``K < N``), ``I / N`` MLP columns and ``V' / N`` vocab rows, with
  ``head_dim`` stated so that it does not shrink with the heads. The library's own layers then have
  exactly a rank's shapes, and its forwards run unchanged;
* the HF weights stream through `ShardPlan.shard` (one tensor at a time, the rest dropped) *before*
  the backend fuses them (``engine.fallback.weights``: Q/K/V grouped per KV head, ``[gate, up]``),
  so the fused ``qkv_proj`` / ``up_gate_proj`` of a rank are its column-parallel slices, grouped
  by its own KV heads;
* `RowParallel` wraps every ``self_attn.o_proj`` and ``mlp.down_proj``: the library's linear on the
  rank's inputs, then an all-reduce (a bias is rank 0's alone: `ShardPlan.shard` zeroes it
  elsewhere);
* `VocabParallelLookup` wraps the library's embedding (Gemma's scaled one included): ids outside
  the rank's vocab rows look up row 0 and are zeroed, and an all-reduce assembles the rows;
* `TensorParallelPaddleFormers.compute_logits`: the (tied or own) LM head's rows of the rank, the
  final soft-capping (elementwise) applied, then a gather of the logits on rank 0, padding cut.

The embedding is vocab-parallel rather than replicated: Gemma 3 270M's 262,144 x 640 table is
two thirds of the model (671 MB in float32), and a replicated table would put it whole in every
rank to save one of the ``2 L + 2`` collectives of a step (one in 38 for Gemma 3's 18 layers).
"""

from __future__ import annotations

import paddle
from paddle import nn

from .sharding import ShardPlan


class RowParallel(nn.Layer):
    """A library linear holding a rank's slice of its inputs; the ranks' partial outputs are summed."""

    def __init__(self, inner: nn.Layer, group):
        super().__init__()
        self.inner, self.group = inner, group

    @property
    def weight(self):
        return self.inner.weight

    def forward(self, x):
        return self.group.all_reduce(self.inner(x))


class VocabParallelLookup(nn.Layer):
    """A library embedding holding the vocab rows ``[start, start + rows)``: exact after the all-reduce."""

    def __init__(self, inner: nn.Layer, start: int, rows: int, group):
        super().__init__()
        self.inner, self.start, self.rows, self.group = inner, start, rows, group

    @property
    def weight(self):
        return self.inner.weight

    def forward(self, ids):
        local = ids - self.start
        inside = paddle.logical_and(local >= 0, local < self.rows)
        out = self.inner(paddle.where(inside, local, paddle.zeros_like(local)))
        out = out * inside.astype(out.dtype).unsqueeze(-1)
        return self.group.all_reduce(out)


class TensorParallelPaddleFormers:
    """One rank's `PaddleFormersModel` (everything else is the wrapped model's): logits gathered on rank 0."""

    def __init__(self, inner, plan: ShardPlan, group):
        self.inner, self.plan, self.group = inner, plan, group

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def kv_layout(self) -> tuple[int, int, int]:
        return self.inner.kv_layout()

    def forward(self, input_ids, positions, meta, kv_caches):
        return self.inner.forward(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden):
        local = self.inner.compute_logits(hidden)                     # [rows, vocab / N], soft-capped
        parts = self.group.gather(local)                              # rank 0: [N, rows, vocab / N]
        if parts is None:                                             # the others sample nothing
            return local[:0]
        full = paddle.transpose(parts, [1, 0, 2]).reshape([local.shape[0], -1])
        return full[:, : self.plan.cfg.vocab_size]


def local_hf_config(plan: ShardPlan, hf_config: dict) -> dict:
    """The HF config of a rank's model: its heads, KV heads, MLP width and vocab rows."""
    local = plan.local_config()
    return {**hf_config, "num_attention_heads": local.num_heads, "num_key_value_heads": local.num_kv_heads,
            "intermediate_size": local.intermediate_size, "head_dim": local.head_dim,
            "vocab_size": local.vocab_size}


def check_buildable(checkpoint, plan: ShardPlan, device: str) -> None:
    """Construct the library's class at a rank's sizes without memory (``paddle.LazyGuard``): a class
    that cannot be built at them (PaddleFormers' Llama asserts ``hidden_size == heads * head_dim``)
    is refused here, before any rank starts or any weight is read."""
    from ..fallback import attention_adapter
    from ..fallback.hf_config import paddleformers_class, paddleformers_config

    model_cls = paddleformers_class(checkpoint.architecture)
    config = paddleformers_config(model_cls, local_hf_config(plan, checkpoint.config), device,
                                  attention_adapter.register())
    try:
        with paddle.LazyGuard():
            model_cls(config)
    except (AssertionError, ValueError) as exc:
        raise ValueError(f"tensor_parallel_size={plan.world}: PaddleFormers' {model_cls.__name__} cannot be built "
                         f"with a rank's share of the model ({plan.heads} query heads, {plan.kv_heads} KV heads of "
                         f"{plan.cfg.head_dim}, hidden size {plan.cfg.hidden_size}): {exc}. Use "
                         f"model_impl='native' where the architecture has it, or tensor_parallel_size=1") from None


def build_sharded_paddleformers(checkpoint, dtype: str, device: str, plan: ShardPlan, group):
    """Rank ``plan.rank``'s PaddleFormers model: constructed at a rank's sizes, loaded from its slices
    of the checkpoint's tensors, its row-parallel linears and embedding joined by the collectives."""
    from ..fallback.paddleformers import build_paddleformers_model

    weights = plan.shard_weights(checkpoint.weights("float32", progress=plan.rank == 0))
    wrapped = build_paddleformers_model(checkpoint, dtype, device, None,
                                        hf_config=local_hf_config(plan, checkpoint.config), weights=weights)
    body = wrapped.body
    rows = 0
    for name, layer in list(body.named_sublayers()):
        for attr in ("o_proj", "down_proj"):
            inner = getattr(layer, attr, None)
            if isinstance(inner, nn.Linear) and (name.endswith(".self_attn") or name.endswith(".mlp")):
                setattr(layer, attr, RowParallel(inner, group))
                rows += 1
    if rows != 2 * plan.cfg.num_layers:
        raise ValueError(f"tensor parallelism on PaddleFormers' {type(wrapped.model).__name__} needs a "
                         f"self_attn.o_proj and an mlp.down_proj (paddle.nn.Linear) in each of its "
                         f"{plan.cfg.num_layers} layers; found {rows} of {2 * plan.cfg.num_layers}")
    embedding = getattr(body, "embed_tokens", None)
    if embedding is None:
        raise ValueError(f"tensor parallelism on PaddleFormers' {type(wrapped.model).__name__} needs its "
                         f"embedding as {wrapped.model.base_model_prefix}.embed_tokens")
    body.embed_tokens = VocabParallelLookup(embedding, plan.vocab_start, plan.vocab_per_rank, group)
    return TensorParallelPaddleFormers(wrapped, plan, group)
