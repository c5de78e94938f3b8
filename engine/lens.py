"""The attention lens: where one token's attention went, on the physical KV blocks that hold it.

``LLM.attention_lens(token_ids, position)`` runs ``token_ids[:position + 1]`` as one real request
(one sampled token, greedy) through the scheduler and the paged KV cache, so the prefix cache
serves every full block it already holds -- a chat's tokens land in the very blocks the block map
shows. While the step that computes ``position`` runs, a `LensProbe` is bound to the engine's
attention op (``engine.attention.probing``): after each layer's paged attention it reads the
query row of ``position`` and the keys of positions ``0..position`` back from that layer's cache,
through the request's block table, and keeps the softmax ``[num_heads, position + 1]``. Nothing
else is recorded and no other step is touched: the probe exists only for that step, which runs
through the model's layers (never the fused decode kernel); the decode path is unchanged.

The probabilities are the kernels' own definition (``gpu_kernels.reference``): scores
``q . k * scale`` (float32, as the kernels), keys at ``p > position - window`` on sliding-window
layers (zero outside), softmax in float64, returned as float32.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field

import numpy as np


def attention_row(query: np.ndarray, keys: np.ndarray, scale: float, window: int | None = None) -> np.ndarray:
    """Softmax probabilities of one query over keys ``0..P``: ``query`` ``[H, D]``, ``keys``
    ``[P + 1, KVH, D]`` (grouped-query heads share a KV head: head h reads KV head ``h // (H // KVH)``).
    Returns ``[H, P + 1]``; on a sliding-window layer keys at ``p <= P - window`` get zero."""
    return _softmax_row(query, np.ascontiguousarray(keys.transpose(1, 0, 2), dtype=np.float32), scale, window)


def _softmax_row(query: np.ndarray, keys: np.ndarray, scale: float, window: int | None) -> np.ndarray:
    """``keys`` ``[KVH, P + 1, D]``: the dot products in float32 (as the kernels), the softmax in float64."""
    num_heads, head_dim = query.shape
    num_kv_heads, ctx, _ = keys.shape
    q = np.ascontiguousarray(query, dtype=np.float32).reshape(num_kv_heads, num_heads // num_kv_heads, head_dim)
    # einsum's own loop, not BLAS: a matrix-vector product on BLAS's threads waits for cores on a busy machine
    scores = np.einsum("kpd,kgd->kgp", keys, q).reshape(num_heads, ctx).astype(np.float64) * scale
    if window is not None and ctx > window:
        scores[:, : ctx - window] = -np.inf
    scores -= scores.max(axis=1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs.astype(np.float32)


class LensProbe:
    """Records, inside ``paged_attention``, one query row per watched request of the current step.

    ``rows``: ``{request_id: (packed row, block table, context length)}``; ``kv_caches`` the
    runner's per-layer caches (a layer is known by its K tensor). `results` after the step:
    ``{request_id: [num_layers, H, context length]}`` and the window each layer used."""

    def __init__(self, rows: dict[str, tuple[int, list[int], int]], kv_caches):
        self.rows = rows
        self._layer_of = {id(cache[0]): i for i, cache in enumerate(kv_caches)}
        self.num_layers = len(kv_caches)
        self._weights: dict[str, list] = {rid: [None] * self.num_layers for rid in rows}
        self.windows: list[int | None] = [None] * self.num_layers

    def record(self, q, k_cache, scale: float, sliding_window: int | None) -> None:
        import paddle

        layer = self._layer_of.get(id(k_cache))
        if layer is None:
            raise RuntimeError("the attention lens saw a KV cache that is not one of this step's layers")
        self.windows[layer] = sliding_window
        for rid, (row, table, ctx) in self.rows.items():
            block_size = k_cache.shape[2]
            used = table[: -(-ctx // block_size)]
            pages = paddle.index_select(k_cache, paddle.to_tensor(np.asarray(used, dtype=np.int64)))
            pages = pages.astype("float32").numpy()                   # [blocks, KVH, bs, D]
            n, kvh, bs, d = pages.shape
            keys = np.ascontiguousarray(pages.transpose(1, 0, 2, 3)).reshape(kvh, n * bs, d)[:, :ctx]
            query = q[row].astype("float32").numpy()                  # [H, D]
            self._weights[rid][layer] = _softmax_row(query, keys, scale, sliding_window)

    def result(self, request_id: str) -> np.ndarray:
        layers = self._weights[request_id]
        missing = [i for i, w in enumerate(layers) if w is None]
        if missing:
            raise RuntimeError(f"the attention lens saw no attention on layers {missing}: the model did not "
                               "run them through the engine's attention op")
        return np.stack(layers)


@dataclass(frozen=True, eq=False)
class AttentionLens:
    """Where the query at ``position`` attended: ``weights[layer, head, p]`` for ``p`` in ``0..position``
    (softmax probabilities; each row sums to 1), ``block_ids[p]`` the physical KV block holding
    position ``p`` during the lens pass. ``num_cached_tokens`` positions came from the prefix cache.
    ``layer`` / ``head`` (None: the mean) pick what `heat`, `block_mass` and the HTML show."""

    token_ids: tuple[int, ...]
    position: int
    weights: np.ndarray                 # float32 [num_layers, num_heads, position + 1]
    block_ids: tuple[int, ...]
    block_size: int
    num_cached_tokens: int
    sliding_windows: tuple[int | None, ...]
    request_id: str
    tokens: tuple[str, ...] = ()        # each position's text, for display
    layer: int | None = None
    head: int | None = None
    seconds: float = 0.0                # wall time of the lens call
    extra: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.weights.shape[0]

    @property
    def num_heads(self) -> int:
        return self.weights.shape[1]

    def heat(self, layer: int | None = -1, head: int | None = -1) -> np.ndarray:
        """``[position + 1]``: one layer's / head's row, or the mean over layers / heads where None
        (-1: this lens's own ``layer`` / ``head``)."""
        layer = self.layer if layer == -1 else layer
        head = self.head if head == -1 else head
        check_layer_head(layer, head, self.num_layers, self.num_heads)
        w = self.weights if layer is None else self.weights[layer: layer + 1]
        w = w if head is None else w[:, head: head + 1]
        return w.mean(axis=(0, 1))

    def block_mass(self, layer: int | None = -1, head: int | None = -1) -> dict[int, float]:
        """Attention mass per physical block ``{block_id: mass}``, in table order."""
        heat = self.heat(layer, head)
        mass: dict[int, float] = {}
        for block, w in zip(self.block_ids, heat):
            mass[block] = mass.get(block, 0.0) + float(w)
        return mass

    def _repr_html_(self) -> str:
        """Heat on the text (shade by weight, the query outlined), then the attention mass per physical
        block in table order (id, share, the positions it holds, whether it came from the prefix cache)."""
        heat = self.heat()
        top = float(heat.max()) or 1.0
        what = (f"layer {self.layer}" if self.layer is not None else "mean of layers") + ", " + \
               (f"head {self.head}" if self.head is not None else "mean of heads")
        texts = self.tokens or tuple(str(t) for t in self.token_ids)
        cells = []
        for p, (text, w, block) in enumerate(zip(texts, heat, self.block_ids)):
            shown = html.escape(text).replace("\n", "↵") or "&nbsp;"
            edge = "outline:2px solid #d33;" if p == self.position else ""
            cells.append(f'<span title="position {p}, block {block}, weight {w:.4f}" style="background:'
                         f'rgba(230,80,20,{min(1.0, float(w) / top):.3f});{edge}white-space:pre-wrap">{shown}</span>')
        mass = self.block_mass()
        most = max(mass.values()) or 1.0
        first = {}
        for p, block in enumerate(self.block_ids):
            first.setdefault(block, p)
        rows = []
        for j, (block, m) in enumerate(mass.items()):
            hit = " · prefix-cache hit" if (j + 1) * self.block_size <= self.num_cached_tokens else ""
            rows.append(f'<div data-block="{block}" data-mass="{m:.6f}" style="display:flex;gap:6px;align-items:center">'
                        f'<b style="min-width:3.5em">#{block}</b><div style="width:160px;height:10px;background:#eee">'
                        f'<div style="width:{100 * m / most:.1f}%;height:100%;background:rgb(230,80,20)"></div></div>'
                        f'{100 * m:.1f}% · positions {first[block]}–{first[block] + self.block_ids.count(block) - 1}'
                        f'{hit}</div>')
        return (f'<div style="font-family:monospace;line-height:1.6"><div style="font-size:85%;color:#666">'
                f'attention of position {self.position} ({what}); {len(set(self.block_ids))} blocks, '
                f'{self.num_cached_tokens} tokens from the prefix cache</div>{"".join(cells)}'
                f'<div style="font-size:85%;color:#666;margin-top:6px">attention mass per physical KV block</div>'
                f'{"".join(rows)}</div>')

    # -- wire -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        w = np.ascontiguousarray(self.weights, dtype="<f4")
        return {"token_ids": list(self.token_ids), "position": self.position,
                "weights": {"shape": list(w.shape), "dtype": "float32", "base64": base64.b64encode(w.tobytes()).decode()},
                "block_ids": list(self.block_ids), "block_size": self.block_size,
                "num_cached_tokens": self.num_cached_tokens, "sliding_windows": list(self.sliding_windows),
                "request_id": self.request_id, "tokens": list(self.tokens), "layer": self.layer, "head": self.head,
                "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: dict) -> "AttentionLens":
        w = data["weights"]
        weights = np.frombuffer(base64.b64decode(w["base64"]), dtype="<f4").reshape(w["shape"]).astype(np.float32)
        return cls(token_ids=tuple(data["token_ids"]), position=data["position"], weights=weights,
                   block_ids=tuple(data["block_ids"]), block_size=data["block_size"],
                   num_cached_tokens=data["num_cached_tokens"], sliding_windows=tuple(data["sliding_windows"]),
                   request_id=data["request_id"], tokens=tuple(data.get("tokens") or ()), layer=data.get("layer"),
                   head=data.get("head"), seconds=data.get("seconds", 0.0))


def check_layer_head(layer, head, num_layers: int, num_heads: int) -> None:
    for name, value, n in (("layer", layer, num_layers), ("head", head, num_heads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                  or not 0 <= value < n):
            raise ValueError(f"{name} must be an integer in [0, {n}) or None (the mean over all {name}s); "
                             f"got {value!r}")


def check_lens_request(token_ids, position, layer, head, *, vocab_size: int, max_model_len: int,
                       num_layers: int, num_heads: int) -> list[int]:
    """Every check of a lens request, before any work: returns the token ids as a list."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise ValueError(f"token_ids must be a list of token ids; got {type(token_ids).__name__}")
    ids = list(token_ids)
    if not ids:
        raise ValueError("token_ids is empty; the lens needs at least one token")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
                or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token_ids must be integers in [0, {vocab_size}); got {bad!r}")
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or not 0 <= position < len(ids):
        raise ValueError(f"position must be an integer in [0, {len(ids) - 1}] (a position of the {len(ids)} "
                         f"tokens); got {position!r}")
    if position + 1 >= max_model_len:
        raise ValueError(f"position {position} needs {position + 1} tokens of context; max_model_len is "
                         f"{max_model_len} (positions up to {max_model_len - 2})")
    check_layer_head(layer, head, num_layers, num_heads)
    return [int(t) for t in ids]
