"""Which slice of each weight a rank holds (Megatron's layout, as FastDeploy and PaddleFleet load it).

Per decoder layer, with ``N`` ranks (HF names; HF stores linears ``[out, in]``):

| weight | split | rank ``r`` holds | after it |
|---|---|---|---|
| ``q_proj`` | column (outputs) | query heads ``r*H/N ... (r+1)*H/N`` | |
| ``k_proj``, ``v_proj`` | column | KV heads ``r*K/N ...``; when ``K < N``, KV head ``r*K // N`` (replicated) | |
| ``o_proj`` | row (inputs) | the columns of its query heads | all-reduce |
| ``gate_proj``, ``up_proj`` | column | ``r*I/N ... (r+1)*I/N`` | |
| ``down_proj`` | row | the same range of inputs | all-reduce |
| ``embed_tokens`` | vocab | rows ``r*V'/N ...`` of the vocab padded to ``V'`` | all-reduce |
| ``lm_head`` (or the tied embedding) | vocab | the same rows | gather of logits on rank 0 |
| ``o_proj`` / ``down_proj`` biases | rank 0 | the bias; zeros elsewhere | (added once) |
| norms, q/k norms | replicated | everything | |

References followed: FastDeploy ``fastdeploy/model_executor/layers/linear.py``
(``QKVParallelLinear``: ``kv_num_heads_per_rank = 1`` and
``num_kv_head_replicas = tp_size // kv_num_heads`` when ``kv_num_heads < tp_size``, a rank
loading KV head ``rank * kv_num_heads // tp_size``; ``MergedColumnParallelLinear`` for
gate/up; ``RowParallelLinear`` with ``tensor_model_parallel_all_reduce`` after the matmul)
and ``fastdeploy/model_executor/layers/embeddings.py`` (``VocabParallelEmbedding``: a
contiguous, padded vocab range per rank), which are PaddleFleet's / Paddle's
``fleet.meta_parallel`` ``ColumnParallelLinear``, ``RowParallelLinear`` and
``VocabParallelEmbedding``.

Every check here runs on the checkpoint's config before a weight is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..models.spec import DecoderSpec

@dataclass(frozen=True)
class ShardPlan:
    """The slice rank ``rank`` of ``world`` holds, for a decoder of config ``cfg``."""

    cfg: DecoderSpec
    rank: int
    world: int

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        """KV heads a rank holds: its share, or one (replicated) when there are fewer KV heads than ranks."""
        return max(self.cfg.num_kv_heads // self.world, 1)

    @property
    def kv_replicas(self) -> int:
        return max(self.world // self.cfg.num_kv_heads, 1)

    @property
    def first_kv_head(self) -> int:
        if self.cfg.num_kv_heads < self.world:
            return self.rank * self.cfg.num_kv_heads // self.world  # FastDeploy's sharedkv_index
        return self.rank * self.kv_heads

    @property
    def intermediate(self) -> int:
        return self.cfg.intermediate_size // self.world

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.cfg.vocab_size // self.world)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self) -> DecoderSpec:
        """The decoder a rank builds: its heads, KV heads, MLP width and vocab range."""
        from dataclasses import replace

        return replace(self.cfg, num_heads=self.heads, num_kv_heads=self.kv_heads,
                       intermediate_size=self.intermediate, vocab_size=self.vocab_per_rank)

    def shard(self, name: str, array: np.ndarray) -> np.ndarray:
        """This rank's slice of the HF-named, ``[out, in]`` tensor ``array``."""
        d = self.cfg.head_dim
        m = _LAYER.match(name)
        part = m.group(1) if m else None
        if part == "q_proj":
            return array[self.rank * self.heads * d:(self.rank + 1) * self.heads * d]
        if part in ("k_proj", "v_proj"):
            lo = self.first_kv_head * d
            return array[lo:lo + self.kv_heads * d]
        if part in ("o_proj", "down_proj") and m.group(2) == "bias":  # added once, after the all-reduce
            return array if self.rank == 0 else np.zeros_like(array)
        if part == "o_proj":
            return array[:, self.rank * self.heads * d:(self.rank + 1) * self.heads * d]
        if part in ("gate_proj", "up_proj"):
            return array[self.rank * self.intermediate:(self.rank + 1) * self.intermediate]
        if part == "down_proj":
            return array[:, self.rank * self.intermediate:(self.rank + 1) * self.intermediate]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = array[self.vocab_start:self.vocab_start + self.vocab_per_rank]
            if len(rows) < self.vocab_per_rank:  # the last rank's range runs past the vocab: zero rows
                rows = np.concatenate([rows, np.zeros((self.vocab_per_rank - len(rows),) + array.shape[1:],
                                                      array.dtype)])
            return rows
        return array  # norms

    def shard_weights(self, weights):
        """``(name, array)`` pairs reduced to this rank's slices, one tensor at a time."""
        for name, array in weights:
            yield name, np.ascontiguousarray(self.shard(name, array))


_LAYER = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.(weight|bias)$")


SHARDED_IMPLS = ("native", "paddleformers")


def decoder_shape(hf_config: dict) -> DecoderSpec:
    """The sizes a `ShardPlan` splits, read from an HF config as every decoder names them (the
    PaddleFormers backend's models too, which the native `DecoderSpec.from_hf` refuses)."""
    c = hf_config
    heads = c["num_attention_heads"]
    return DecoderSpec(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                       intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
                       num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
                       head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                       max_position_embeddings=c.get("max_position_embeddings") or 4096,
                       tie_word_embeddings=bool(c.get("tie_word_embeddings")))


def check_shardable(architecture: str, hf_config: dict, world: int, model_impl: str = "native") -> DecoderSpec:
    """The decoder config, or a ValueError saying why ``world`` ranks cannot split this model: every
    rank must get whole query heads, whole KV heads (or one replicated KV head each, the ranks
    dividing evenly among the KV heads) and an equal share of the MLP."""
    from ..models import NATIVE_ARCHITECTURES

    if model_impl not in SHARDED_IMPLS or (model_impl == "native" and architecture not in NATIVE_ARCHITECTURES):
        raise ValueError(f"tensor_parallel_size={world}: tensor parallelism runs the native decoders "
                         f"({', '.join(NATIVE_ARCHITECTURES)}) and the PaddleFormers backend; {architecture} with "
                         f"model_impl={model_impl!r} has no sharded implementation yet (use tensor_parallel_size=1 "
                         f"or model_impl='paddleformers')")
    if model_impl == "native":
        cfg = DecoderSpec.from_hf(architecture, hf_config)
    else:
        cfg = decoder_shape(hf_config)
    heads, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    problems = []
    if heads % world:
        problems.append(f"num_attention_heads={heads} is not a multiple of it")
    if kv % world and world % kv:
        problems.append(f"num_key_value_heads={kv} neither splits into {world} equal parts nor divides {world} "
                        f"(to be replicated)")
    if inter % world:
        problems.append(f"intermediate_size={inter} is not a multiple of it")
    if problems:
        sizes = [n for n in range(1, heads + 1)
                 if heads % n == 0 and (kv % n == 0 or n % kv == 0) and inter % n == 0]
        raise ValueError(f"tensor_parallel_size={world} cannot split {architecture}: " + "; ".join(problems)
                         + f". Sizes that split it: {', '.join(map(str, sizes))}")
    return cfg
