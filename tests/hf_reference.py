"""Greedy continuations from HF `transformers` reading a GGUF file: the independent reference.

Run as a separate process (the tests do), because PaddleFormers, once
imported, switches torch off inside `transformers` for the rest of a process:

    python tests/hf_reference.py FILE.gguf --max-new-tokens 12 < prompts.json > continuations.json

stdin: a JSON list of prompts given as token-id lists (the engine's tokenizer
makes them, so both sides see the same ids); stdout: a JSON list of the
greedy continuations (token ids).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    args = parser.parse_args()
    prompts = json.load(sys.stdin)

    # paddlecodec (a paddleformers dependency) ships a `torchcodec` module without its package
    # metadata, which transformers' audio utilities trip over; declare it absent.
    sys.modules["torchcodec"] = None
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    directory, name = os.path.split(os.path.abspath(args.gguf))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name).eval()
    json.dump([greedy(torch, model, ids, args.max_new_tokens) for ids in prompts], sys.stdout)


def greedy(torch, model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with the model's KV cache; EOS does not stop it (like ``ignore_eos``)."""
    out, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = model(step, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            step = torch.tensor([[token]])
    return out


if __name__ == "__main__":
    main()
