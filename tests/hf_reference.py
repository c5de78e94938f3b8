"""HF `transformers` reading a GGUF file: the independent reference, run in its own process.

It runs as a separate process (the tests start it), because PaddleFormers, once imported,
switches torch off inside `transformers` for the rest of a process, and so that transformers'
copy of the weights never shares a process with ours:

    python tests/hf_reference.py greedy FILE.gguf --max-new-tokens 12 < prompts.json > out.json
    python tests/hf_reference.py weights FILE.gguf > digests.json
    python tests/hf_reference.py both FILE.gguf --max-new-tokens 12 < prompts.json > out.json

``greedy``: stdin is a JSON list of prompts given as token-id lists (the engine's tokenizer makes
them, so both sides see the same ids); stdout is a JSON list of the greedy continuations.

``weights``: stdout is ``{name: tensor_digest(...)}`` for every tensor transformers reads from
the file (dequantized, with transformers' names and layout): a per-tensor comparison result,
not the tensors, so the caller compares them with its own weights at no memory cost.

``both``: stdout is ``{"weights": ..., "greedy": ...}``, the two answers above from one reading
of the file (transformers takes most of a minute of CPU to read and dequantize a GGUF): the
tensors `load_gguf_checkpoint` returned are digested, then given to ``from_pretrained`` as its
``state_dict`` -- what ``from_pretrained(gguf_file=...)`` does after reading them itself.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import sys


def tensor_digest(values) -> dict:
    """What two float32 tensors must share to be equal element for element (as
    `numpy.testing.assert_array_equal` sees them: -0.0 equals 0.0), plus sum and largest
    magnitude to say how far apart they are when they differ."""
    import numpy as np

    flat = np.asarray(values).reshape(-1)
    sha, total, absmax = hashlib.sha256(), 0.0, 0.0
    for start in range(0, flat.size, 1 << 22):       # 16 MB at a time: no copy of a whole tensor
        chunk = flat[start:start + (1 << 22)].astype(np.float32) + np.float32(0.0)   # -0.0 -> 0.0
        sha.update(chunk.tobytes())
        total += float(chunk.sum(dtype=np.float64))
        absmax = max(absmax, float(np.abs(chunk).max()))
    return {"shape": list(np.shape(values)), "sha256": sha.hexdigest(), "sum": total, "absmax": absmax}


@contextlib.contextmanager
def gguf_read_once():
    """While inside, transformers reads a GGUF file's header once and builds gguf's tensor-name
    map once per architecture; the answers are the same, only not recomputed.

    ``from_pretrained(gguf_file=...)`` parses the file's header anew (`gguf.GGUFReader`) for the
    config, for the tensors and for the tokenizer, and `get_gguf_hf_weights_map` builds a
    `gguf.TensorNameMap` for every module of the model (transformers 5.3,
    ``modeling_gguf_pytorch_utils.py``: ``get_tensor_name_map(arch, num_layers)`` inside the
    recursion; both names are imported from ``gguf`` at call time). Both are functions of
    their arguments alone: a reader maps the file read-only. Together they were two thirds of
    the CPU transformers spends on Gemma 3's GGUF (a 262k-token vocabulary in the header).
    """
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["greedy", "weights", "both"])
    parser.add_argument("gguf")
    parser.add_argument("--max-new-tokens", type=int, help="greedy: tokens per prompt")
    args = parser.parse_args()
    if args.mode != "weights" and args.max_new_tokens is None:
        parser.error(f"{args.mode} needs --max-new-tokens")

    # paddlecodec (a paddleformers dependency) ships a `torchcodec` module without its package
    # metadata, which transformers' audio utilities trip over; declare it absent.
    sys.modules["torchcodec"] = None
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    with gguf_read_once():
        answer(args, torch, transformers)


def answer(args, torch, transformers) -> None:
    directory, name = os.path.split(os.path.abspath(args.gguf))
    if args.mode == "weights":
        _, _, tensors = read_tensors(torch, transformers, directory, name)
        json.dump({key: tensor_digest(tensors.pop(key).float().numpy()) for key in sorted(tensors)},
                  sys.stdout)
        return
    prompts = json.load(sys.stdin)
    if args.mode == "greedy":
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name).eval()
        json.dump([greedy(torch, model, ids, args.max_new_tokens) for ids in prompts], sys.stdout)
        return
    model_class, config, tensors = read_tensors(torch, transformers, directory, name)
    digests = {key: tensor_digest(tensors[key].float().numpy()) for key in sorted(tensors)}
    model = model_class.from_pretrained(None, config=config, state_dict=tensors).eval()
    del tensors
    json.dump({"weights": digests,
               "greedy": [greedy(torch, model, ids, args.max_new_tokens) for ids in prompts]}, sys.stdout)


def read_tensors(torch, transformers, directory: str, name: str):
    """The model class and config transformers picks for the file, and its own reading of the
    file's tensors (`load_gguf_checkpoint`, which dequantizes and renames them for that class)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name)
    with torch.device("meta"):      # load_gguf_checkpoint reads only its config and parameter names
        names_only = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(os.path.join(directory, name), return_tensors=True,
                                   model_to_load=names_only)["tensors"]
    return type(names_only), config, tensors


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
