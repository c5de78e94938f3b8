"""Text <-> token ids, chat templates and incremental detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library does all the
splitting and merging) and adds what a model defines on top of its vocabulary:
the BOS/EOS/pad ids, the set of ids that end a generation, and the chat
template.  The loaders in `engine.loader` build it from GGUF metadata or from
an HF model directory; nothing here knows about file formats.

Chat templates are Jinja2 templates rendered the way `transformers` renders
them: a sandboxed environment with `trim_blocks` / `lstrip_blocks`, the
`raise_exception` and `strftime_now` helpers, a `tojson` filter that keeps
non-ASCII text, and the model's special tokens (`bos_token`, `eos_token`, ...)
in the context.  The rendered prompt already holds every special token the
model expects, so encode it with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Iterable

import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class StreamDecoder:
    """Turns a stream of token ids into text pieces, one `step` per token.

    Multi-byte characters split over several tokens (emoji, CJK in byte-level
    vocabularies) come out only once complete: `step` returns ``None`` until
    then, so the concatenated pieces always equal `Tokenizer.decode` of all ids.
    """

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool = True):
        self._backend = backend
        self._stream = tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._backend, int(token_id))


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, chat template.

    Args:
        backend: the `tokenizers.Tokenizer` doing the work.
        bos_token_id / pad_token_id / unk_token_id: the model's special ids
            (``None`` where it has none).
        eos_token_ids: every id that ends a generation (the model's EOS first,
            then, for chat models, the end-of-turn token).
        chat_template: Jinja2 source, or ``None``.
        fallback_chat_template: used, with a one-time warning, when the
            checkpoint has no template but its architecture has a well-known
            turn format (Gemma, ERNIE 4.5).
        name: what to call the model in messages.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = (), pad_token_id: int | None = None,
                 unk_token_id: int | None = None, chat_template: str | None = None,
                 fallback_chat_template: str | None = None, name: str = "model"):
        self.backend = backend
        self.bos_token_id = bos_token_id
        eos = [int(i) for i in eos_token_ids]
        self.eos_token_ids = frozenset(eos)
        self._primary_eos = eos[0] if eos else None
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self.fallback_chat_template = fallback_chat_template
        self.name = name
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._warned_fallback = False

    # -- ids <-> text ---------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the model adds (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental detokenizer (one per generated sequence)."""
        return StreamDecoder(self.backend, skip_special_tokens)

    def id_to_token(self, id: int) -> str:
        token = self.backend.id_to_token(int(id))
        if token is None:
            raise ValueError(f"token id {id} is outside the vocabulary of {self.vocab_size} tokens")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The model's own EOS token (the first of `eos_token_ids` given; templates' ``eos_token``)."""
        return None if self._primary_eos is None else self.id_to_token(self._primary_eos)

    # -- chat -----------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) into the prompt text.

        Uses the checkpoint's template; for Gemma and ERNIE 4.5 checkpoints without
        one, their own tokenizer's turn format (with a warning, once).  Other checkpoints without a
        template raise `ValueError`.  Encode the result with
        ``add_special_tokens=False``: the template already placed BOS etc.
        """
        source = self.chat_template
        if source is None:
            if self.fallback_chat_template is None:
                raise ValueError(
                    f"{self.name} has no chat template (it is probably a base model): "
                    "use plain-text generation instead of chat")
            if not self._warned_fallback:
                sample = _compile_template(self.fallback_chat_template).render(
                    messages=[{"role": "user", "content": "..."}], add_generation_prompt=True,
                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")
                logger.warning("%s has no chat template; using its architecture's turn format, a user "
                               "turn rendered as %r", self.name, sample)
                self._warned_fallback = True
            source = self.fallback_chat_template
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        context = dict(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token="" if self.pad_token_id is None else self.id_to_token(self.pad_token_id),
            unk_token="" if self.unk_token_id is None else self.id_to_token(self.unk_token_id),
        )
        context.update(extra)
        return _compile_template(source).render(**context)

    # -- the wire -------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Everything needed to rebuild this tokenizer elsewhere (``from_dict``): the
        ``tokenizers`` JSON, the special ids and the chat templates."""
        return {"tokenizer_json": self.backend.to_str(), "bos_token_id": self.bos_token_id,
                "eos_token_ids": [self._primary_eos] + sorted(self.eos_token_ids - {self._primary_eos})
                if self._primary_eos is not None else [],
                "pad_token_id": self.pad_token_id, "unk_token_id": self.unk_token_id,
                "chat_template": self.chat_template, "fallback_chat_template": self.fallback_chat_template,
                "name": self.name}

    @classmethod
    def from_dict(cls, data: dict) -> "Tokenizer":
        return cls(tokenizers.Tokenizer.from_str(data["tokenizer_json"]), bos_token_id=data["bos_token_id"],
                   eos_token_ids=data["eos_token_ids"], pad_token_id=data["pad_token_id"],
                   unk_token_id=data["unk_token_id"], chat_template=data["chat_template"],
                   fallback_chat_template=data["fallback_chat_template"], name=data["name"])

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)}, chat_template={self.chat_template is not None})")
