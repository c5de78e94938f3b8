"""The native decoder, sharded: each rank builds `LlamaForCausalLM` with its share of heads, MLP
and vocab (`ShardPlan.local_config`) and three layers swapped in:

* `RowParallelLinear` for ``o_proj`` and ``down_proj``: the local matmul gives a partial sum of
  the full output, and an all-reduce adds the ranks' parts;
* `VocabParallelEmbedding`: a rank looks up only the ids in its vocab range (zero rows for the
  rest) and an all-reduce assembles the embeddings;
* `TensorParallelLlama.compute_logits`: each rank's logits cover its vocab range; a gather on
  rank 0 (the one that samples) lays them side by side, and the padding past the vocab is cut.

The QKV and gate/up projections need no layer of their own: holding only their rank's columns
(column parallel), they are the plain `Linear` with fewer outputs, and attention runs on the
rank's heads against the rank's own paged KV cache.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from ..models import interleaved_to_half, load_hf_weights
from ..models.llama import Linear, LlamaForCausalLM
from .sharding import ShardPlan


class RowParallelLinear(Linear):
    """``x_r @ W_r`` on the rank's slice of the inputs, summed over ranks (all-reduce)."""

    def __init__(self, in_features: int, out_features: int, group):
        super().__init__(in_features, out_features)
        self.group = group

    def forward(self, x):
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Layer):
    """The embedding rows ``[start, start + rows)`` of the (padded) vocab; other ids give zeros
    here and their row on the rank that holds it, so the all-reduce is an exact lookup."""

    def __init__(self, rows: int, dim: int, start: int, group):
        super().__init__()
        self.start, self.rows, self.group = start, rows, group
        self.weight = self.create_parameter([rows, dim])

    def forward(self, ids):
        local = ids - self.start
        inside = paddle.logical_and(local >= 0, local < self.rows)
        out = F.embedding(paddle.where(inside, local, paddle.zeros_like(local)), self.weight)
        out = out * inside.astype(out.dtype).unsqueeze(-1)
        return self.group.all_reduce(out)


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's `LlamaForCausalLM`: its heads, KV heads, MLP columns and vocab rows."""

    def __init__(self, plan: ShardPlan, group):
        super().__init__(plan.local_config())
        self.plan, self.group = plan, group
        cfg = self.spec
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, plan.vocab_start, group)
        for layer in self.layers:
            layer.self_attn.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, group)
            layer.mlp.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, group)

    def compute_logits(self, hidden):
        local = super().compute_logits(hidden)                        # [rows, vocab / N]
        parts = self.group.gather(local)                              # rank 0: [N, rows, vocab / N]
        if parts is None:                                             # the others sample nothing
            return local[:0]
        full = paddle.transpose(parts, [1, 0, 2]).reshape([local.shape[0], -1])
        return full[:, : self.plan.cfg.vocab_size]


def build_sharded_model(architecture: str, hf_config: dict, weights, dtype: str, plan: ShardPlan,
                        group) -> TensorParallelLlama:
    """Rank ``plan.rank``'s model, its slices taken from ``weights`` (HF ``(name, array)`` pairs read
    one at a time from the checkpoint file): the rank keeps its slice of each and drops the rest."""
    model = TensorParallelLlama(plan, group)
    if plan.cfg.rope_interleaved:
        weights = interleaved_to_half(weights, plan.cfg.head_dim)
    load_hf_weights(model, plan.shard_weights(weights))
    if dtype != "float32":
        model.to(dtype=dtype)
    model.eval()
    return model
