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
  options (`continue_final_message`, `chat_template`) are refused, not silently dropped. `tools` and
  `tool_choice` are shown to the model as the chat endpoint shows them, so the count is the one it computes.
- /detokenize takes `tokens` and answers `prompt`, their text with control tokens included: detokenizing what
  /tokenize gave is the text the template wrote.
- GET /tokenizer_info answers the special tokens and the chat template (vLLM's, which lm-eval's remote
  tokenizer reads).
- `model` may be left out; another model's name is a 404 `model_not_found`, as on /v1. Unknown fields are
  ignored, as there.

They are the client surface (a client API key: node/transport/auth.py), refuse in OpenAI's shape, and are
bounded as /v1/completions is: a body larger than the context could need is a 413 and one that stalls a 408, a
text of more characters than the context could hold in tokens (or more ids than it holds) is refused before
any work on it, a conversation's turns and characters are bounded as on /v1/chat/completions, and parsing,
tokenizing and detokenizing run in worker threads (openai_read.prepared), never on the event loop.
"""
from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import attrs
from quart_trio import QuartTrio

from worker.errors import WorkerError

from node.api.entry import Entry
from node.api.openai_api import openai_shape
from node.api.openai_read import chat_ids, check_model, prepared, read_json, too_long, tokenized
from node.api.openai_fields import ApiError, checked_text, field
from node.api.openai_messages import MessageBudget, messages
from node.api.openai_tools import ToolRequest, tool_request, tool_setup
from node.api.openai_wire import limits_for
from node.transport.app import shape_refusals, still_loading

TOKENIZE_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
# vLLM's chat options this server does not take, each with the values that ask for nothing
UNSUPPORTED_CHAT = {"continue_final_message": (None, False), "chat_template": (None,),
                    "chat_template_kwargs": (None, {})}


@attrs.frozen
class TokenizeRequest:
    """A parsed /tokenize body: a raw `prompt`, or chat `messages`."""

    model: str | None
    prompt: str | None = None
    messages: tuple[dict, ...] = ()
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: ToolRequest | None = None  # shown to the model as /v1/chat/completions shows them


def add_tokenize_routes(app: QuartTrio, node: Entry, model_name: str, tool_parser: str | None = None) -> None:
    shape_refusals(app, TOKENIZE_PATHS, openai_shape)

    @app.post("/tokenize")
    async def tokenize():
        return await _answered(lambda: _tokenize(node, model_name, tool_parser))

    @app.post("/detokenize")
    async def detokenize():
        return await _answered(lambda: _detokenize(node, model_name))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        async def info() -> dict:
            if node.loading:
                raise still_loading()
            return node.vocabulary.tokenizer_info()
        return await _answered(info)


async def _answered(work: Callable[[], Awaitable[dict]]):
    # ApiError is answered here rather than by an app-wide handler, which add_openai_routes registers its own way
    try:
        return await work()
    except ApiError as exc:
        return exc.body(), exc.status


async def _tokenize(node: Entry, model_name: str, tool_parser: str | None) -> dict:
    vocab, body = await read_json(node)
    budget = limits_for(vocab_size=vocab.vocab_size, max_seqs=node.max_seqs, max_context=vocab.max_context,
                        longest_token_bytes=vocab.longest_token_bytes).messages
    req = await prepared(functools.partial(parse_tokenize, body, budget))
    check_model(req.model, model_name)
    if req.prompt is not None:
        ids = await prepared(functools.partial(tokenized, vocab, "prompt", text=req.prompt,
                                               add_special_tokens=req.add_special_tokens))
    else:
        ids = await prepared(functools.partial(chat_ids, vocab, req.messages, req.tools,
                                               tool_setup(vocab.chat_template, tool_parser),
                                               add_generation_prompt=req.add_generation_prompt))
    answer = {"count": len(ids), "max_model_len": vocab.max_context, "tokens": ids}
    if req.return_token_strs:
        answer["token_strs"] = await prepared(functools.partial(vocab.token_strs, ids))
    return answer


async def _detokenize(node: Entry, model_name: str) -> dict:
    vocab, body = await read_json(node)
    model, tokens = parse_detokenize(body)
    check_model(model, model_name)
    context = vocab.max_context
    if len(tokens) > context:
        raise too_long(context, "tokens", f"{len(tokens)} tokens")
    try:
        return {"prompt": await prepared(functools.partial(vocab.prompt_text, list(tokens)))}
    except WorkerError as exc:  # an id out of the vocabulary
        raise ApiError(400, f"tokens: {exc}", param="tokens", code="invalid_value") from None


def parse_tokenize(body, budget: MessageBudget | None = None) -> TokenizeRequest:
    """A /tokenize body, or the ApiError naming what is wrong with it; `budget` bounds a conversation."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = field(body, "model", str)
    strs = bool(field(body, "return_token_strs", bool, default=False))
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise ApiError(400, "prompt or messages: give one of them (a text, or a conversation)", param="prompt",
                       code="invalid_value" if has_prompt else "missing_required_parameter")
    if has_prompt:
        return TokenizeRequest(model, prompt=checked_text(field(body, "prompt", str), "prompt"),
                               add_special_tokens=bool(field(body, "add_special_tokens", bool, default=True)),
                               return_token_strs=strs)
    for key, harmless in UNSUPPORTED_CHAT.items():
        if key in body and body[key] not in harmless:
            raise ApiError(400, f"{key}: not supported by this server", param=key, code="unsupported_parameter")
    if field(body, "add_special_tokens", bool, default=False):
        raise ApiError(400, "add_special_tokens: with messages, the chat template and the vocabulary add the "
                            "special tokens, as for /v1/chat/completions", param="add_special_tokens",
                       code="unsupported_parameter")
    return TokenizeRequest(model, messages=messages(body, budget), return_token_strs=strs,
                           add_generation_prompt=bool(field(body, "add_generation_prompt", bool, default=True)),
                           tools=tool_request(body, chat=True))


def parse_detokenize(body) -> tuple[str | None, tuple[int, ...]]:
    """A /detokenize body as (model or None, token ids), or the ApiError naming what is wrong with it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = field(body, "model", str)
    tokens = field(body, "tokens", list, required=True)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "tokens: expected an array of token ids (integers)", param="tokens", code="invalid_type")
    return model, tuple(tokens)
