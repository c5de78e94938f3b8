"""Build a `Tokenizer` from a GGUF file's ``tokenizer.ggml.*`` metadata.

Two vocabulary kinds occur in the zoo (``tokenizer.ggml.model``):

* ``"gpt2"`` -- byte-level BPE (SmolLM2, Qwen, Llama 3): vocab + merges, a
  pre-tokenizer regex chosen by ``tokenizer.ggml.pre`` as llama.cpp does.
* ``"llama"`` -- SentencePiece (Llama 2, Gemma): pieces with scores, ``▁`` for
  spaces and ``<0xNN>`` byte fallback.  GGUF keeps no merges; SentencePiece BPE
  repeatedly merges the adjacent pair whose concatenation is the best-scored
  piece, which is exactly a BPE whose merge list is ordered by the score of the
  merged piece -- so the merges are derived from the scores.

Token types follow llama.cpp: 3 = control (``<eos>``, ``<|im_end|>``: special
tokens, dropped by ``decode(skip_special_tokens=True)``), 4 = user-defined
(matched verbatim before the model runs, kept when decoding).
"""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from ..tokenizer import Tokenizer
from .gguf_file import GGUFFile

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes for byte-level BPE, keyed by tokenizer.ggml.pre (llama.cpp's llama-vocab.cpp).
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_REGEX_BY_PRE = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "smaug-bpe": _LLAMA3_REGEX,
                 "qwen2": _QWEN2_REGEX, "deepseek-r1-qwen": _QWEN2_REGEX}

# Tokens that end an assistant turn in common chat formats.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|end_of_sentence|>")

# Gemma's turn format, for Gemma checkpoints whose GGUF carries no template.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# ERNIE 4.5's turn format, for ERNIE 4.5 checkpoints that carry no template: the ``chat_template`` that
# huggingface/transformers' src/transformers/models/ernie4_5/convert_ernie4_5_tokenizer.py
# @ 0bbbf64fb93addfd4d24af8d4c8fd20aa5881091 writes into ERNIE 4.5's tokenizer_config.json
# (DEFAULT_CHAT_TEMPLATE, from baidu/ERNIE-4.5-0.3B-Base-PT; the same string as the tokenizer_config of
# ERNIE-4.5-0.3B-PT recorded in tokenization_ernie4_5.py @ b33edd1c3847633508c323482ed346e8983c2e14).
# paddleformers 1.2's Ernie4_5Tokenizer is HF's LlamaTokenizer and brings no template of its own.
ERNIE4_5_CHAT_TEMPLATE = (
    '{%- if not add_generation_prompt is defined -%}\n    {%- set add_generation_prompt = true -%}\n'
    '{%- endif -%}\n{%- if not cls_token is defined -%}\n    {%- set cls_token = "<|begin_of_sentence|>" -%}\n'
    '{%- endif -%}\n{%- if not sep_token is defined -%}\n    {%- set sep_token = "<|end_of_sentence|>" -%}\n'
    '{%- endif -%}\n{{- cls_token -}}\n{%- for message in messages -%}\n'
    '    {%- if message["role"] == "user" -%}\n        {{- "User: " + message["content"] + "\\n" -}}\n'
    '    {%- elif message["role"] == "assistant" -%}\n'
    '        {{- "Assistant: " + message["content"] + sep_token -}}\n'
    '    {%- elif message["role"] == "system" -%}\n        {{- message["content"] + "\\n" -}}\n'
    '    {%- endif -%}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{- "Assistant: " -}}\n'
    '{%- endif -%}'
)


def fallback_chat_template(architecture: str) -> str | None:
    """The turn format of an architecture whose own tokenizer has a well-known one (GGUF
    ``general.architecture`` or HF ``model_type``): Gemma's, ERNIE 4.5's; else ``None``."""
    if architecture.startswith("gemma"):
        return GEMMA_CHAT_TEMPLATE
    if architecture.startswith("ernie4_5"):
        return ERNIE4_5_CHAT_TEMPLATE
    return None


def _spm_merges(tokens: list[str], scores: np.ndarray, types: np.ndarray) -> list[tuple[str, str]]:
    """SentencePiece-BPE merges: every split of a normal piece into two known pieces,
    ordered by the merged piece's score (best first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i in np.argsort(-scores, kind="stable"):
        if types[i] != TOKEN_NORMAL:
            continue
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((left, right))
    return ranked


def _add_vocab_specials(backend: HFTokenizer, tokens: list[str], types: np.ndarray) -> None:
    """Register control tokens as special (skipped by decode) and user-defined tokens
    as plain added tokens (matched verbatim in the raw text, kept by decode)."""
    control = [AddedToken(tokens[i], special=True, normalized=False)
               for i in np.nonzero(types == TOKEN_CONTROL)[0]]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i in np.nonzero(types == TOKEN_USER_DEFINED)[0]]
    backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _byte_level_backend(f: GGUFFile, tokens: list[str]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(BPE(vocab, merges, fuse_unk=False))
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre in _REGEX_BY_PRE:  # split by the model's regex, then map bytes to printable chars
        steps = [pre_tokenizers.Split(Regex(_REGEX_BY_PRE[pre]), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    else:  # GPT-2's own regex, digits split one by one first for the StarCoder family
        steps = [pre_tokenizers.Digits(individual_digits=True)] if pre in _DIGITS_FIRST else []
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(f: GGUFFile, tokens: list[str], types: np.ndarray) -> HFTokenizer:
    scores = f.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError(f"{f.path}: SentencePiece vocabulary without tokenizer.ggml.scores")
    unk_id = f.get("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(BPE(vocab, _spm_merges(tokens, scores, types),
                              unk_token=None if unk_id is None else tokens[unk_id],
                              fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_bos_eos(backend: HFTokenizer, tokens, bos_id, eos_id, add_bos: bool, add_eos: bool):
    """Post-processor adding BOS/EOS when ``encode(..., add_special_tokens=True)``."""
    pieces, specials = [], []
    if add_bos and bos_id is not None:
        pieces.append(tokens[bos_id]); specials.append((tokens[bos_id], bos_id))
    pieces.append("$A")
    if add_eos and eos_id is not None:
        pieces.append(tokens[eos_id]); specials.append((tokens[eos_id], eos_id))
    if specials:
        backend.post_processor = processors.TemplateProcessing(single=pieces, special_tokens=specials)


def tokenizer_from_gguf(f: GGUFFile) -> Tokenizer:
    """The `Tokenizer` described by the GGUF metadata of `f`."""
    kind = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ValueError(f"{f.path} carries no tokenizer (tokenizer.ggml.model / tokens missing)")
    types = f.get("tokenizer.ggml.token_type")
    if types is None:
        types = np.full(len(tokens), TOKEN_NORMAL, dtype=np.int32)
    if kind == "gpt2":
        backend, add_bos_default = _byte_level_backend(f, tokens), False
    elif kind == "llama":
        backend, add_bos_default = _sentencepiece_backend(f, tokens, types), True
    else:
        raise ValueError(f"{f.path}: unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', 'llama')")
    _add_vocab_specials(backend, tokens, types)

    bos_id = f.get("tokenizer.ggml.bos_token_id")
    eos_id = f.get("tokenizer.ggml.eos_token_id")
    _add_bos_eos(backend, tokens, bos_id, eos_id,
                 bool(f.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                 bool(f.get("tokenizer.ggml.add_eos_token", False)))

    template = f.get("tokenizer.chat_template")
    fallback = fallback_chat_template(f.architecture) if template is None else None
    turn_format = template or fallback or ""
    eos_ids = [] if eos_id is None else [eos_id]
    for token in END_OF_TURN_TOKENS:
        token_id = backend.token_to_id(token)
        if token_id is not None and token in turn_format and token_id not in eos_ids:
            eos_ids.append(token_id)
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
                     pad_token_id=f.get("tokenizer.ggml.padding_token_id"), unk_token_id=f.get("tokenizer.ggml.unknown_token_id"),
                     chat_template=template, fallback_chat_template=fallback,
                     name=f.get("general.name") or f.path)
