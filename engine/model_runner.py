"""Turns a scheduled batch into one packed forward pass over the paged KV cache.

The runner owns the KV cache tensors (one ``(k, v)`` pair per layer, layout in
docs/ARCHITECTURE.md) and, each step, builds the ``AttentionMetadata`` shared
by every layer: token positions, the slot each new token's K/V goes to, block
tables, context lengths and query start offsets. It computes logits only for
the rows the sampler needs.

A *model* here is anything with ``forward(input_ids, positions, meta,
kv_caches) -> hidden`` and ``compute_logits(hidden)`` plus a ``kv_layout()``
``(num_layers, num_kv_heads, head_dim)`` — the native models and the borrowed
(PaddleFormers / PaddleFleet) ones alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import paddle

from .attention import AttentionMetadata, probing
from .fused_decode import FusedDecode, decoder_of, fused_decode_support
from .fused_prefill import FusedPrefill, offers_fused_prefill
from .scheduler import SchedulerOutput
from .step_record import StepRecord

logger = logging.getLogger("engine")
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_block_bytes(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    return 2 * num_layers * num_kv_heads * block_size * head_dim * _BYTES[dtype]


@dataclass
class StepLogits:
    """Logits the sampler needs: one row per sampled request, plus prompt rows for prompt_logprobs."""

    sample_rows: np.ndarray                      # [num_sampled, vocab]
    sample_request_ids: list[str]
    prompt_rows: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)  # rid -> (first pos, rows)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: str, attention_backend: str | None = None,
                 cpu_decode: str = "paddle", device: str = "cpu"):
        self.model = model
        self.block_size = block_size
        self.attention_backend = attention_backend  # gpu_kernels backend of every attention call (None: by tensor)
        num_layers, num_kv_heads, head_dim = model.kv_layout()
        shape = [num_blocks, num_kv_heads, block_size, head_dim]
        self.kv_caches = [
            (paddle.zeros(shape, dtype=kv_dtype), paddle.zeros(shape, dtype=kv_dtype)) for _ in range(num_layers)
        ]
        self.fused_decode, self.decode_path, self.fused_prefill = None, "paddle", None
        if cpu_decode == "fused":
            reason = fused_decode_support(model, kv_dtype, device, attention_backend)
            if reason is None:
                self.fused_decode, self.decode_path = FusedDecode(model, self.kv_caches), "fused"
                if offers_fused_prefill(model):   # the borrowed models' captured prefill (engine.fused_prefill)
                    self.fused_prefill = FusedPrefill(decoder_of(model), self.fused_decode)
            else:
                self.decode_path = f"paddle ({reason})"
            logger.info("cpu_decode=fused: decode steps run %s", self.decode_path)
        self.prefill_path = "fused" if self.fused_prefill is not None else "paddle"
        self.last_probe = None

    def pack(self, batch: SchedulerOutput) -> dict[str, np.ndarray]:
        """The batch as NumPy arrays: input ids, positions, KV slots, block tables (zero-padded),
        context lengths and the row index of each scheduled chunk's start (``starts``)."""
        return StepRecord.from_batch(batch, self.block_size).packed()

    def build_metadata(self, batch: SchedulerOutput | StepRecord, packed: dict[str, np.ndarray] | None = None):
        """Pack the batch: input ids, metadata, and the row index of each scheduled chunk's start."""
        if isinstance(batch, StepRecord):
            p = batch.packed()
        else:
            p = self.pack(batch) if packed is None else packed
        meta = AttentionMetadata(
            positions=paddle.to_tensor(p["positions"]),
            slot_mapping=paddle.to_tensor(p["slots"]),
            block_tables=paddle.to_tensor(p["block_tables"]),
            context_lens=paddle.to_tensor(p["context_lens"]),
            query_start_loc=paddle.to_tensor(p["starts"]),
            decode_only=bool(np.all(np.diff(p["starts"]) == 1)),
            num_tokens=int(p["starts"][-1]),
            backend=self.attention_backend,
        )
        return paddle.to_tensor(p["ids"]), meta, p["starts"].tolist()

    def execute(self, batch: SchedulerOutput, lens: frozenset[str] | set[str] = frozenset()) -> StepLogits:
        """Run the scheduled step (as its `StepRecord`) and hand the sampler its logits. ``lens``: requests
        whose last scheduled token's attention is recorded (``engine.lens``; `last_probe` holds it)."""
        record = StepRecord.from_batch(batch, self.block_size)
        probe = None
        if lens:
            from .lens import LensProbe

            rows = {s.request.request_id: (int(record.starts[i + 1]) - 1, list(s.block_ids),
                                           s.num_computed_tokens + s.num_new_tokens)
                    for i, s in enumerate(batch.scheduled) if s.request.request_id in lens and s.completes_sequence}
            probe = LensProbe(rows, self.kv_caches) if rows else None
        self.last_probe = probe
        logits = self.run(record, probe)
        if logits is None:
            return StepLogits(np.zeros((0, 0), np.float32), [])
        at = record.num_prompt_rows
        prompt_rows = {rid: (lo, logits[row: row + n]) for rid, lo, row, n in record.prompt_spans}
        return StepLogits(logits[at:], list(record.sample_request_ids), prompt_rows)

    @paddle.no_grad()
    def run(self, record: StepRecord, probe=None) -> np.ndarray | None:
        """One forward pass over the record's tokens on this runner's KV cache: float32 logits of
        ``record.rows`` (None when no row needs them). With a ``probe`` (the attention lens) the step
        runs through the model's layers, whose attention op hands it what it records."""
        rows = record.rows
        logits = None
        if probe is not None:
            input_ids, meta, _ = self.build_metadata(record)
            with probing(probe):
                hidden = self.model.forward(input_ids, meta.positions, meta, self.kv_caches)
        elif self.fused_decode is not None and record.decode_only:
            # the fused step reads the packed arrays as they are: no Paddle tensors on this path
            hidden, logits = self.fused_decode.step(
                record.ids, record.positions, record.slots, record.block_tables, record.context_lens, rows)
        elif self.fused_prefill is not None:
            hidden = self.fused_prefill.forward(record)
        else:
            input_ids, meta, _ = self.build_metadata(record)
            hidden = self.model.forward(input_ids, meta.positions, meta, self.kv_caches)
        if not len(rows):
            return None
        if logits is None and isinstance(hidden, np.ndarray):   # a fused step's hidden states
            logits = self.model.compute_logits(paddle.to_tensor(hidden[rows])).numpy()
        elif logits is None:
            selected = paddle.index_select(hidden, paddle.to_tensor(rows))
            logits = self.model.compute_logits(selected).numpy()
        return logits
