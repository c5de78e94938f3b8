"""Borrowed models on the engine's paged KV cache (``model_impl="paddleformers" | "paddlefleet"``).

* `paddleformers` — a PaddleFormers ``*ForCausalLM`` with our attention
  function registered in its attention interface (`attention_adapter`),
  driven one packed sequence per step (`step_context` carries the step's
  metadata and KV caches to the attention calls);
* `paddlefleet` — PaddleFleet's GPT model with each layer's core attention
  replaced by an adapter running the same kernels (needs ``paddlefleet``).

Nothing here is imported by the engine unless one of these is selected.
"""
