"""The tokenizer of an OpenAI-compatible server, asked over HTTP: what the playground needs of one
(``encode``, ``decode``, ``apply_chat_template``, ``vocab_size``, ``eos_token_ids``, ``chat_template``).

Routes, by server:

* vLLM (and this project's server): ``POST /tokenize {"prompt", "add_special_tokens"}`` and
  ``{"messages", "add_generation_prompt"}`` (the server's chat template applied), ``POST /detokenize
  {"tokens"} -> {"prompt"}`` (vLLM's ``protocol.py``);
* llama.cpp's ``llama-server``: ``POST /tokenize {"content", "add_special"}``, ``POST /detokenize
  {"tokens"} -> {"content"}``, ``POST /apply-template {"messages"} -> {"prompt"}``; ``/props`` gives
  the chat template and the EOS token, ``/v1/models`` the vocabulary size (``meta.n_vocab``).

Exact where the server answers; approximated, and said so here:

* ``vocab_size`` where the server does not say it (vLLM, FastDeploy): ``UNKNOWN_VOCAB``, so any id
  passes the page's checks and the server judges it;
* ``eos_token_ids`` where the server does not name its EOS (vLLM): empty, so the logprob view does
  not mark a reply's end-of-turn token;
* ``decode`` spells special tokens out whatever ``skip_special_tokens`` says (both servers' routes do);
* ``chat_template``: llama.cpp's source; for vLLM a note that the server renders one (the page only
  asks whether there is one);
* a server without these routes (FastDeploy): ``encode`` and ``apply_chat_template`` raise a
  ``ValueError`` saying so; ``decode`` joins the token texts seen in the server's logprobs.

Single-token decodes and token texts are cached: the playground decodes token by token.
"""

from __future__ import annotations

import threading

import httpx

UNKNOWN_VOCAB = 2**31 - 1


class ServerTokenizer:
    def __init__(self, http: httpx.Client, kind: str, *, model: str, name: str, vocab_size: int | None = None):
        self._http, self.kind, self._model, self.name = http, kind, model, name
        self.vocab_size = vocab_size or UNKNOWN_VOCAB
        self.eos_token_ids: frozenset[int] = frozenset()
        self.bos_token_id = None
        self.chat_template: str | None = None
        self._pieces: dict[int, str] = {}       # token id -> its text, as decoded or seen in logprobs
        self._ids: dict[str, int] = {}          # a token's text -> its id (seen, or tokenized to one token)
        self._lock = threading.Lock()
        self.routes = self._probe()

    def _probe(self) -> bool:
        """Whether the server tokenizes; its chat template and EOS where it names them."""
        try:
            self.encode("Hi", add_special_tokens=False)
        except ValueError:
            return False
        if self.kind == "llamacpp":
            props = self._http.get("/props")
            if props.status_code == 200:
                data = props.json()
                self.chat_template = data.get("chat_template") or None
                eos = data.get("eos_token")
                ids = self.encode(eos, add_special_tokens=False) if eos else []
                self.eos_token_ids = frozenset(ids) if len(ids) == 1 else frozenset()
        else:
            try:
                self.apply_chat_template([{"role": "user", "content": "Hi"}])
                self.chat_template = "(rendered by the server: it does not send its template)"
            except ValueError:
                self.chat_template = None
        return True

    def _post(self, path: str, body: dict) -> dict:
        try:
            response = self._http.post(path, json=body)
        except httpx.TransportError as exc:
            raise ValueError(f"the server's {path} cannot be reached: {exc}") from None
        if response.status_code in (404, 405, 501):
            raise ValueError(f"this server has no {path} route: {self._missing()}")
        if response.status_code >= 400:
            raise ValueError(f"the server's {path} answered {response.status_code}: {response.text[:200]}")
        return response.json()

    def _missing(self) -> str:
        return ("the text cannot be tokenized here (vLLM and llama.cpp's llama-server serve /tokenize; "
                "pick an alternative from the list instead of typing text)")

    # -- the playground's surface ---------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.kind == "llamacpp":
            return list(self._post("/tokenize", {"content": text, "add_special": add_special_tokens})["tokens"])
        return list(self._post("/tokenize", {"model": self._model, "prompt": text,
                                             "add_special_tokens": add_special_tokens})["tokens"])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if len(ids) == 1 and ids[0] in self._pieces:
            return self._pieces[ids[0]]
        if not getattr(self, "routes", True) or not ids:     # no routes: the texts seen, joined
            return "".join(self._pieces.get(i, "") for i in ids)
        data = self._post("/detokenize", {"model": self._model, "tokens": ids})
        text = data.get("content", data.get("prompt", ""))
        if len(ids) == 1:
            with self._lock:
                self._pieces[ids[0]] = text
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.kind == "llamacpp":     # llama.cpp always adds the generation prompt
            return self._post("/apply-template", {"messages": messages})["prompt"]
        ids = self._post("/tokenize", {"model": self._model, "messages": messages,
                                       "add_generation_prompt": add_generation_prompt,
                                       **({"chat_template_kwargs": extra} if extra else {})})["tokens"]
        return self._post("/detokenize", {"model": self._model, "tokens": ids})["prompt"]

    # -- ids of token texts (servers whose logprobs name tokens by text only) -------------------------
    def learn(self, token_id: int, text: str) -> None:
        """A token's id and text, as the server's logprobs paired them."""
        with self._lock:
            self._pieces.setdefault(int(token_id), text)
            self._ids.setdefault(text, int(token_id))

    def piece_id(self, text: str) -> int | None:
        """The id of the token whose text is ``text``: one seen before, else the server's tokenization
        of it when that is one token; None when it cannot be told (the alternative is then left out)."""
        if text in self._ids:
            return self._ids[text]
        try:
            ids = self.encode(text, add_special_tokens=False) if self.routes else []
        except ValueError:
            ids = []
        if len(ids) != 1:
            return None
        self.learn(ids[0], text)
        return ids[0]
