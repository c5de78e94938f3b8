"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, so a client of any vLLM-like server
(``engine.client.OpenAIServer``) finds the tokenizer where vLLM serves it.

Shapes from vLLM's ``vllm/entrypoints/openai/protocol.py`` (``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``TokenizeResponse``, ``DetokenizeRequest``, ``DetokenizeResponse``):

* ``{"prompt", "add_special_tokens": true}`` or ``{"messages", "add_generation_prompt": true,
  "add_special_tokens": false}`` (the chat template applied first) ->
  ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with ``return_token_strs``);
* ``{"tokens"}`` -> ``{"prompt"}`` (special tokens spelled out, as vLLM's detokenize does).

Like vLLM's, they sit outside ``/v1`` and so need no API key.
"""

from __future__ import annotations


from fastapi import FastAPI, Request

from .protocol import ApiError, ChatMessage, read_json_object


def add_tokenize_routes(app: FastAPI, state) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request):
        state.ready()
        data, tok = await read_json_object(request), state.llm.get_tokenizer()
        if "messages" in data:
            messages = data["messages"]
            if not isinstance(messages, list) or not messages:
                raise ApiError("messages must be a non-empty list of {'role', 'content'} objects", param="messages")
            try:
                conversation = [{"role": m.role, "content": m.text(i)}
                                for i, m in enumerate(ChatMessage.model_validate(x) for x in messages)]
                text = tok.apply_chat_template(conversation, add_generation_prompt=bool(
                    data.get("add_generation_prompt", True)), **(data.get("chat_template_kwargs") or {}))
            except ApiError:
                raise
            except Exception as exc:    # noqa: BLE001  (a malformed message, the template's own error)
                raise ApiError(f"the chat template could not render these messages: {exc}", param="messages") from None
            add_special = bool(data.get("add_special_tokens", False))
        else:
            text = data.get("prompt")
            if not isinstance(text, str):
                raise ApiError("prompt must be a string (or give messages)", param="prompt")
            add_special = bool(data.get("add_special_tokens", True))
        ids = tok.encode(text, add_special_tokens=add_special)
        out = {"count": len(ids), "max_model_len": state.serving.max_model_len, "tokens": ids, "token_strs": None}
        if data.get("return_token_strs"):
            out["token_strs"] = [tok.id_to_token(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state.ready()
        data, tok = await read_json_object(request), state.llm.get_tokenizer()
        ids = data.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError("tokens must be a list of token ids", param="tokens")
        if any(not 0 <= t < tok.vocab_size for t in ids):
            raise ApiError(f"tokens must be ids in [0, {tok.vocab_size})", param="tokens")
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}
