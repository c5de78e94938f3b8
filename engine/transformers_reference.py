"""HF ``transformers`` (torch) reading the same GGUF file: the independent reference for ``engine.align``.

The native and PaddleFormers backends share the engine's kernels, block
weights and logprob code, so comparing them measures *backend consistency*.
This reference shares none of it: transformers parses the GGUF itself,
dequantizes with its own code and runs its own attention and softmax. It has
the part of the ``LLM`` interface that ``engine.align.compare_backends`` uses
(``generate`` with greedy ``logprobs`` / ``prompt_logprobs``), fed the token
ids of the engine's tokenizer, so both sides see the same input.

transformers must be imported with torch before PaddleFormers is (PaddleFormers
hides torch from it for the rest of the process), so build this first.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

from .request import Logprob


class TransformersReference:
    model_impl = "transformers"

    def __init__(self, gguf_path: str, tokenizer, model_name: str):
        sys.modules.setdefault("torchcodec", None)  # paddlecodec's torchcodec lacks package metadata
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        directory, name = os.path.split(os.path.abspath(gguf_path))
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                                       torch_dtype=torch.float32).eval()
        self.tokenizer, self.model_name = tokenizer, model_name

    def _top(self, logits, k: int) -> dict[int, Logprob]:
        logprobs = self.torch.log_softmax(logits.double(), dim=-1)
        values, ids = logprobs.topk(k)
        return {int(t): Logprob(float(v), rank + 1, self.tokenizer.decode([int(t)], skip_special_tokens=False))
                for rank, (v, t) in enumerate(zip(values, ids))}

    def generate(self, prompts, params):
        """Greedy continuations with top-k logprobs, like ``LLM.generate(prompts, params)``."""
        torch, k = self.torch, max(params.logprobs or 1, params.prompt_logprobs or 1)
        outs = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            with torch.no_grad():
                result = self.model(torch.tensor([ids]), use_cache=True)
                prompt_logprobs = [None] + [self._top(result.logits[0, i], k) for i in range(len(ids) - 1)]
                past, logits, tokens, logprobs = result.past_key_values, result.logits[0, -1], [], []
                for _ in range(params.max_tokens):
                    top = self._top(logits, k)
                    token = min(top, key=lambda t: top[t].rank)
                    tokens.append(token)
                    logprobs.append(top)
                    result = self.model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                    past, logits = result.past_key_values, result.logits[0, -1]
            completion = SimpleNamespace(token_ids=tokens, logprobs=logprobs,
                                         text=self.tokenizer.decode(tokens))
            outs.append(SimpleNamespace(prompt_logprobs=prompt_logprobs, outputs=[completion]))
        return outs

