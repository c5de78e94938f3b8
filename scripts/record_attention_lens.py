"""Record HF transformers' attention probabilities on a GGUF: the reference of the attention lens.

    python scripts/record_attention_lens.py smollm2-135m-instruct      # writes tests/fixtures/attention_lens_<name>.npz
    python scripts/record_attention_lens.py gemma3-270m --out /tmp/x.npz

transformers reads the zoo model's GGUF itself (its own dequantization), runs it eagerly
(``attn_implementation="eager"``, so the softmax probabilities exist) with
``output_attentions=True`` over the prompt, and the rows of the chosen positions are saved:
``weights_<p>`` ``[num_layers, num_heads, p + 1]`` beside ``token_ids`` and ``positions``. The
prompt's token ids come from transformers' tokenizer of the same file; the lens test feeds
these very ids to the engine. Gemma 3's prompt is longer than its 512-token sliding window, so
its local layers' rows end in zeros. Run it in a process of its own (PaddleFormers, once imported,
switches torch off inside transformers); the tests start it so when ``transformers`` is installed.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASSAGE = ("Paged attention stores each sequence's keys and values in fixed-size blocks; a block table maps "
           "positions to physical blocks, so sequences that share a prefix can share its blocks. ")
# zoo name -> (prompt text, how many times the passage repeats, positions recorded)
CASES = {
    "smollm2-135m-instruct": (PASSAGE, 3, "last,middle,0"),
    "gemma3-270m": (PASSAGE, 24, "last,middle"),      # ~700 tokens: beyond the 512-token window
}


def record(gguf: str, text: str, positions: str) -> dict[str, np.ndarray]:
    sys.modules["torchcodec"] = None  # paddlecodec's module without metadata trips transformers' audio utils
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    directory, name = os.path.split(os.path.abspath(gguf))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ids = tokenizer(text)["input_ids"]
    last = len(ids) - 1
    named = {"last": last, "middle": last // 2}
    wanted = sorted({named[p] if p in named else int(p) for p in positions.split(",")})
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, use_cache=False)
    attn = [a[0].float().numpy() for a in out.attentions]          # per layer [H, T, T]
    data = {"token_ids": np.asarray(ids, dtype=np.int64), "positions": np.asarray(wanted, dtype=np.int64),
            "sliding_window": np.asarray(getattr(model.config, "sliding_window", None) or 0),
            "transformers": np.asarray(transformers.__version__), "torch": np.asarray(torch.__version__)}
    for p in wanted:
        data[f"weights_{p}"] = np.stack([a[:, p, : p + 1] for a in attn]).astype(np.float32)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(CASES))
    parser.add_argument("--out", help="where to write the .npz (default tests/fixtures/attention_lens_<model>.npz)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from engine.loader.zoo import zoo_path     # no Paddle: the zoo only finds files

    text, times, positions = CASES[args.model]
    data = record(zoo_path(args.model), text * times, positions)
    out = args.out or os.path.join(ROOT, "tests", "fixtures", f"attention_lens_{args.model}.npz")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez_compressed(out, **data)
    print(f"{out}: {len(data['token_ids'])} tokens, positions {data['positions'].tolist()}")


if __name__ == "__main__":
    main()
