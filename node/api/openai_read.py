"""Reading an API request within bounds: its body, its JSON and its prompts' tokens.

The event loop does no unbounded work for a request: its body is refused past what the model's context
could need (413) or when it stalls (408); parsing it (json's C scanner: a malformed one is a 400 in OpenAI's
shape), checking it (a response_format's schema is compiled), rendering the chat template and tokenizing all
run in worker threads, PREPARE_THREADS at a time for the whole node (`prepared`), their turns shared fairly
among client keys, so a burst of costly requests queues there rather than starving /health and the pipeline's
own traffic of the GIL, or another key's requests of their turn. What each may cost is bounded before that work: a conversation's turns and characters (openai_wire.limits_for), a prompt
with more characters than the context could hold in tokens is refused before tokenizing, and the template's
output is capped as it is written (worker/tokens/chat.py).
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import TypeVar

import trio
from quart import has_request_context, request

from worker.errors import WorkerError
from worker.tokens.tool_prompt import with_tools
from worker.tool_formats import GENERIC_PROMPT

from node.api.entry import Entry, Vocabulary
from node.api.fair_turns import FairLimiter
from node.api.openai_fields import ApiError, body_limit, parse_body, shown
from node.api.openai_tools import ToolRequest, ToolSetup
from node.api.openai_wire import ApiRequest
from node.transport.app import still_loading

BODY_IDLE_S = 10.0  # a client sending its body: the longest wait for a byte of it
BODY_GRACE_S = 10.0  # and then: its first seconds are free, after them it must average BODY_MIN_RATE
BODY_MIN_RATE = 1024  # bytes a second: a 4 MiB body on a 9 kbit/s line
PREPARE_THREADS = 2  # requests parsed, rendered or tokenized at once: the rest wait their turn, threadless
_PREPARING = trio.lowlevel.RunVar("pp_api_preparing")  # one limiter per trio run (per node process)
T = TypeVar("T")


def ready(node: Entry) -> Vocabulary:
    if node.loading:
        raise still_loading()  # in OpenAI's shape, as every refusal on API_PATHS
    return node.vocabulary


async def prepared(work: Callable[[], T]) -> T:
    """`work` (parsing, rendering, tokenizing: CPU work a request asks for) in a worker thread, PREPARE_THREADS
    at a time in this trio run, the waiting turns shared fairly among client keys (fair_turns.py)."""
    try:
        limiter = _PREPARING.get()
    except LookupError:
        limiter = FairLimiter(PREPARE_THREADS)
        _PREPARING.set(limiter)
    async with limiter.hold(_client()):
        return await trio.to_thread.run_sync(work)


def _client() -> bytes:
    """Whose turn a request waits in: its credential, as a digest (the key itself is not kept); work outside a
    request shares one turn."""
    header = request.headers.get("Authorization", "") if has_request_context() else ""
    return hashlib.blake2b(header.encode(), digest_size=8).digest()


async def read_json(node: Entry) -> tuple[Vocabulary, object]:
    """The entry's vocabulary and the request's JSON body, read within what the model's context could need."""
    vocab = ready(node)
    longest = await trio.to_thread.run_sync(lambda: vocab.longest_token_bytes)  # made once, from the vocabulary
    raw = await read_body(body_limit(vocab.max_context, longest))
    return vocab, await prepared(functools.partial(parse_body, raw))


def check_model(model: str | None, model_name: str) -> None:
    """None (a route where `model` may be left out) or the served name; another is a 404 model_not_found."""
    if model is not None and model != model_name:
        raise ApiError(404, f"model {shown(model)} is not served here; this cluster serves {model_name!r}",
                       param="model", code="model_not_found")


async def read_body(limit: int) -> bytes:
    """The request's body: a 413 past `limit` bytes (at once where its Content-Length says so), and a 408
    where the client sends nothing for BODY_IDLE_S, before its first byte or between two, or sends slower than
    BODY_MIN_RATE on average after BODY_GRACE_S (a body trickled a byte every few seconds held a connection for
    as long as it liked: round 3's finding 3; Apache's mod_reqtimeout has the same rule)."""
    if (request.content_length or 0) > limit:
        raise too_large(limit)
    data, chunks, started = bytearray(), aiter(request.body), trio.current_time()
    while True:
        due = min(trio.current_time() + BODY_IDLE_S, started + BODY_GRACE_S + len(data) / BODY_MIN_RATE)
        with trio.move_on_at(due) as late:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return bytes(data)
        if late.cancelled_caught:
            raise ApiError(408, f"the request body stalled: {len(data)} bytes in {trio.current_time() - started:.0f} s; "
                                f"a body comes at {BODY_MIN_RATE} bytes a second or more after the first "
                                f"{BODY_GRACE_S:g} s, with no gap of {BODY_IDLE_S:g} s", code="timeout")
        data += chunk
        if len(data) > limit:
            raise too_large(limit)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over the {limit} bytes the model's context could need",
                    code="request_too_large")


def prompts(vocab: Vocabulary, api: ApiRequest, setup: ToolSetup) -> list[tuple[list[int], str]]:
    """In a worker thread: each prompt's ids and text (what `echo` shows), or the ApiError refusing one. A
    chat's tools are shown as `setup` says: through the template, or in our generic system prompt (which also
    writes out tool-call history for a template that cannot)."""
    if api.chat:
        return [(chat_ids(vocab, api.messages, api.tools, setup), "")]
    out = []
    for n, prompt in enumerate(api.prompts):
        param = "prompt" if len(api.prompts) == 1 else f"prompt[{n}]"
        if isinstance(prompt, tuple):  # more ids than the context holds are refused unchecked
            if len(prompt) > vocab.max_context:
                raise too_long(vocab.max_context, param, f"{len(prompt)} tokens")
            ids, text = list(prompt), vocab.token_bytes(list(prompt), specials=not api.skip_special_tokens
                                                          ).decode("utf-8", errors="replace")
        else:
            ids, text = tokenized(vocab, param, text=prompt), prompt
        out.append((ids, text))
    return out


def chat_ids(vocab: Vocabulary, messages: tuple[dict, ...], tools: ToolRequest | None, setup: ToolSetup, *,
             add_generation_prompt: bool = True) -> list[int]:
    """In a worker thread: a conversation's ids, its tools (unless tool_choice is none) shown as `setup` says."""
    shown = [t.as_template_takes() for t in tools.tools] if tools is not None and tools.parsed else None
    if setup.rendering == GENERIC_PROMPT:
        told = with_tools(list(messages), shown, setup.family, parallel=tools is None or tools.parallel)
        return tokenized(vocab, "messages", messages=tuple(told), add_generation_prompt=add_generation_prompt)
    return tokenized(vocab, "messages", messages=messages, tools=shown, add_generation_prompt=add_generation_prompt)


def tokenized(vocab: Vocabulary, param: str, *, text: str | None = None, messages: tuple[dict, ...] = (),
              add_special_tokens: bool = True, add_generation_prompt: bool = True,
              tools: list[dict] | None = None) -> list[int]:
    """In a worker thread: a raw `text`'s ids, or (text None) the conversation's through the chat template,
    or the ApiError refusing it. A text of more characters than the context's tokens could spell (each at
    most the longest token's bytes) is refused untokenized. Whether the ids leave room in the context is the
    actor's to say (roles/first.py), when the request is admitted."""
    context, longest = vocab.max_context, vocab.longest_token_bytes
    chars = sum(len(m["content"] or "") for m in messages) if text is None else len(text)
    if chars > context * longest:
        raise too_long(context, param, f"{chars} characters, more than {context} tokens of at most {longest} "
                                        f"characters each can hold")
    try:
        if text is None:
            return vocab.tokenize_messages(list(messages), add_generation_prompt=add_generation_prompt, tools=tools)
        return vocab.tokenize(text, chat=False, add_special_tokens=add_special_tokens)
    except WorkerError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param.split("[")[0], code="invalid_value") from None


def too_long(context: int, param: str, what: str) -> ApiError:
    return ApiError(400, f"This model's maximum context length is {context} tokens. However, your {param} "
                         f"resulted in {what}.", param=param.split("[")[0], code="context_length_exceeded")
