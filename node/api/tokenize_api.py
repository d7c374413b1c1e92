"""vLLM's tokenizer endpoints on pp-entry, `POST /tokenize` and `POST /detokenize`, in the shapes of vLLM's
TokenizeCompletionRequest, TokenizeChatRequest and DetokenizeRequest (vllm/entrypoints/openai/protocol.py,
serving_tokenization.py).

- /tokenize takes a raw `prompt` (`add_special_tokens`, default true: BOS first where the vocabulary adds one)
  or a conversation, `messages` (`add_generation_prompt`, default true), and answers `count`, `max_model_len`
  and `tokens`, plus `token_strs` (each token as the vocabulary spells it) when `return_token_strs`. The ids are
  those /v1/completions and /v1/chat/completions compute from the same prompt, so a client can check a prompt
  against the context before sending it; as there, special-token text in a raw prompt is text. For a
  conversation the chat template and the vocabulary decide the special tokens, as for /v1/chat/completions:
  vLLM's `add_special_tokens: true` on top of them (a second BOS, for most templates) and its other chat
  options (`continue_final_message`, `chat_template`, `tools`) are refused, not silently dropped.
- /detokenize takes `tokens` and answers `prompt`, their text with control tokens included: detokenizing what
  /tokenize gave is the text the template wrote.
- GET /tokenizer_info answers the special tokens and the chat template (vLLM's, which lm-eval's remote
  tokenizer reads).
- `model` may be left out; another model's name is a 404 `model_not_found`, as on /v1. Unknown fields are
  ignored, as there.

They are the client surface (a client API key: node/transport/auth.py), refuse in OpenAI's shape, and are
bounded as /v1/completions is: a body larger than the context could need is a 413 and one that stalls a 408, a
text of more characters than the context could hold in tokens (or more ids than it holds) is refused before
any work on it, and tokenizing and detokenizing run in a worker thread, never on the event loop.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio
from quart_trio import QuartTrio

from worker.errors import WorkerError

from node.api.entry import Entry, Vocabulary
from node.api.openai_api import _read_body, _too_long, openai_shape
from node.api.openai_wire import ApiError, _get, _messages, _text, body_limit, parse_body
from node.transport.app import shape_refusals, still_loading

TOKENIZE_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
# vLLM's chat options this server does not take, each with the values that ask for nothing
UNSUPPORTED_CHAT = {"continue_final_message": (None, False), "chat_template": (None,),
                    "chat_template_kwargs": (None, {}), "tools": (None, [])}


@attrs.frozen
class TokenizeRequest:
    """A parsed /tokenize body: a raw `prompt`, or chat `messages`."""

    model: str | None
    prompt: str | None = None
    messages: tuple[dict, ...] = ()
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


def add_tokenize_routes(app: QuartTrio, node: Entry, model_name: str) -> None:
    shape_refusals(app, TOKENIZE_PATHS, openai_shape)

    @app.post("/tokenize")
    async def tokenize():
        return await _answered(lambda: _tokenize(node, model_name))

    @app.post("/detokenize")
    async def detokenize():
        return await _answered(lambda: _detokenize(node, model_name))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        async def info() -> dict:
            if node.loading:
                raise still_loading()
            return node.worker.tokenizer_info()
        return await _answered(info)


async def _answered(work: Callable[[], Awaitable[dict]]):
    # ApiError is answered here rather than by an app-wide handler, which add_openai_routes registers its own way
    try:
        return await work()
    except ApiError as exc:
        return exc.body(), exc.status


async def _tokenize(node: Entry, model_name: str) -> dict:
    worker, body = await _body(node)
    req = parse_tokenize(body)
    _check_model(req.model, model_name)
    ids = await trio.to_thread.run_sync(_ids, worker, req)
    answer = {"count": len(ids), "max_model_len": worker.info.max_context, "tokens": ids}
    if req.return_token_strs:
        answer["token_strs"] = await trio.to_thread.run_sync(worker.token_strs, ids)
    return answer


async def _detokenize(node: Entry, model_name: str) -> dict:
    worker, body = await _body(node)
    model, tokens = parse_detokenize(body)
    _check_model(model, model_name)
    context = worker.info.max_context
    if len(tokens) > context:
        raise _too_long(context, "tokens", f"{len(tokens)} tokens")
    try:
        return {"prompt": await trio.to_thread.run_sync(worker.prompt_text, list(tokens))}
    except WorkerError as exc:  # an id out of the vocabulary
        raise ApiError(400, f"tokens: {exc}", param="tokens", code="invalid_value") from None


async def _body(node: Entry) -> tuple[Vocabulary, object]:
    """The entry's worker and the request's JSON, read within what the model's context could need."""
    if node.loading:
        raise still_loading()  # in OpenAI's shape, as every refusal on these paths
    worker = node.worker
    longest = await trio.to_thread.run_sync(lambda: worker.longest_token_bytes)  # made once, from the vocabulary
    return worker, parse_body(await _read_body(body_limit(worker.info.max_context, longest)))


def _check_model(model: str | None, model_name: str) -> None:
    if model is not None and model != model_name:
        raise ApiError(404, f"model {model!r} is not served here; this cluster serves {model_name!r}",
                       param="model", code="model_not_found")


def _ids(worker: Vocabulary, req: TokenizeRequest) -> list[int]:
    """In a worker thread: the prompt's ids, or the ApiError refusing it. A text of more characters than the
    context's tokens could spell is refused untokenized, as /v1/completions refuses it."""
    param = "prompt" if req.prompt is not None else "messages"
    context, longest = worker.info.max_context, worker.longest_token_bytes
    chars = len(req.prompt) if req.prompt is not None else sum(len(m["content"]) for m in req.messages)
    if chars > context * longest:
        raise _too_long(context, param, f"{chars} characters, more than {context} tokens of at most {longest} "
                                        f"characters each can hold")
    try:
        if req.prompt is not None:
            return worker.tokenize(req.prompt, chat=False, add_special_tokens=req.add_special_tokens)
        return worker.tokenize_messages(list(req.messages), add_generation_prompt=req.add_generation_prompt)
    except WorkerError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_value") from None


def parse_tokenize(body) -> TokenizeRequest:
    """A /tokenize body, or the ApiError naming what is wrong with it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = _get(body, "model", str)
    strs = bool(_get(body, "return_token_strs", bool, default=False))
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise ApiError(400, "prompt or messages: give one of them (a text, or a conversation)", param="prompt",
                       code="invalid_value" if has_prompt else "missing_required_parameter")
    if has_prompt:
        return TokenizeRequest(model, prompt=_text(_get(body, "prompt", str), "prompt"),
                               add_special_tokens=bool(_get(body, "add_special_tokens", bool, default=True)),
                               return_token_strs=strs)
    for key, harmless in UNSUPPORTED_CHAT.items():
        if key in body and body[key] not in harmless:
            raise ApiError(400, f"{key}: not supported by this server", param=key, code="unsupported_parameter")
    if _get(body, "add_special_tokens", bool, default=False):
        raise ApiError(400, "add_special_tokens: with messages, the chat template and the vocabulary add the "
                            "special tokens, as for /v1/chat/completions", param="add_special_tokens",
                       code="unsupported_parameter")
    return TokenizeRequest(model, messages=_messages(body), return_token_strs=strs,
                           add_generation_prompt=bool(_get(body, "add_generation_prompt", bool, default=True)))


def parse_detokenize(body) -> tuple[str | None, tuple[int, ...]]:
    """A /detokenize body as (model or None, token ids), or the ApiError naming what is wrong with it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = _get(body, "model", str)
    tokens = _get(body, "tokens", list, required=True)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "tokens: expected an array of token ids (integers)", param="tokens", code="invalid_type")
    return model, tuple(tokens)
