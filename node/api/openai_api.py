"""The OpenAI-compatible API on pp-entry: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as
server-sent events or not), `GET /v1/models` and `GET /v1/models/{id}`, on stage 0's own app and port. A
client API key opens it (node/transport/auth.py).

A request is tokenized here (the chat template is the model's own), admitted into the engine like any
other (a slot, or the queue, or 429), and followed: stage 0 sees every token come back on the feedback
edge, and each becomes a chunk as soon as its text is whole. Each choice (a prompt of several, or one of
`n`) is an engine request of its own; a request's choices are admitted together or not at all, and their
events share one channel. A stop string or the client going away ends a choice at once, freeing its slots
on every stage; a stage that fails it ends the stream with an error
event and `data: [DONE]` rather than a hang. Streams carry no time limit of quart's (a long answer is not
cut at 60 s), and every path out of the stream generator sends `[DONE]` (hypercorn would otherwise leave an
HTTP/2 client waiting).

The client going away is noticed whenever it happens. The view returns a streamed response before any of
it is sent, and a client that leaves before the stream generator has started (HTTP/1.1 sockets closed
milliseconds after the request) never runs the generator's cleanup; so the ASGI call of every exchange on
these paths closes what the exchange followed when it returns, however it ends (`_close_when_over`).

The event loop does no unbounded work for a request: node/api/openai_read.py reads, parses and tokenizes it
within bounds, in worker threads.
"""
from __future__ import annotations

import functools
import json
import secrets
import time
import uuid
from contextlib import aclosing

import trio
from quart import request
from quart_trio import QuartTrio

import attrs

from roles.actions import PROMPT_INVALID, PROMPT_TOO_LONG, Progress, Refused
from roles.messages import MAX_TOKENS_LIMIT, EndReason, InferenceRequest, InferenceResponse
from worker.sampling import MAX_SEED, stop_set
from worker.tool_formats import CONTROL_MARKED

from node.api.entry import Entry, Inbox, Vocabulary
from node.api.openai_answer import Choice, Completion, Entries
from node.api.openai_fields import ApiError
from node.api.openai_tools import tool_setup
from node.api.tool_parse import Call, Content, ToolParser
from node.api.openai_read import check_model, prepared, prompts, read_json, ready, too_long
from node.api.openai_wire import ApiRequest, limits_for, parse_request
from node.api.text_stream import TextStream
from node.transport.app import shape_refusals

API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
MODEL_PATH = "/v1/models/"  # GET /v1/models/{id}: the one model's card
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
FINAL_WAIT_S = 5.0  # after the last token, how long a return_token_ids request waits for the stages' figures
_FOLLOWS = "pp.follows"  # the ASGI scope's list of what an exchange follows (_close_when_over)


def add_openai_routes(app: QuartTrio, node: Entry, *, model_name: str, tool_parser: str | None = None) -> None:
    """`tool_parser`: --tool-call-parser, the family calls are read in (None: the chat template's)."""
    started = int(time.time())
    app.asgi_app = _close_when_over(app.asgi_app)
    # every refusal under /v1 an OpenAI client may meet is in OpenAI's shape: a route's, and the 404 of a path no
    # route serves or the 405 of a method one does not take (the cluster's own /v1 routes keep theirs otherwise)
    shape_refusals(app, API_PATHS, openai_shape, prefixes=(MODEL_PATH,), unrouted=("/v1/",))

    def model_card() -> dict:
        vocab = ready(node)
        return {"id": model_name, "object": "model", "created": started, "owned_by": "pp",
                "max_model_len": vocab.max_context, **tool_setup(vocab.chat_template, tool_parser).card()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get(MODEL_PATH + "<path:model_id>")  # path: a served name may hold slashes (org/model, a file's path)
    async def model(model_id: str):
        card = model_card()
        if model_id != model_name:
            raise ApiError(404, f"model {model_id!r} is not served here; this cluster serves {model_name!r}",
                           param="model", code="model_not_found")
        return card

    @app.post("/v1/chat/completions")
    async def chat_completions():
        return await _complete(app, node, model_name, tool_parser, chat=True)

    @app.post("/v1/completions")
    async def completions():
        return await _complete(app, node, model_name, tool_parser, chat=False)

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError):
        headers = {} if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
        return exc.body(), exc.status, headers


def openai_shape(status: int, message: str) -> dict:
    """node/transport/app.py's RefusalShape for OpenAI's paths."""
    return api_refusal(status, message).body()


def api_refusal(status: int, message: str, retry_after_s: int | None = None) -> ApiError:
    """An engine refusal (or the app's 401, 403 or 413) in OpenAI's shape."""
    kinds = {401: ("invalid_request_error", "invalid_api_key"), 429: ("rate_limit_error", "rate_limit_exceeded"),
             503: ("server_error", "unavailable")}
    kind, code = kinds.get(status, ("invalid_request_error", None))
    return ApiError(status, message, type=kind, code=code, retry_after_s=retry_after_s)


def _close_when_over(asgi_app):
    """ASGI middleware: when an exchange on a completion path ends — answered, or its client gone before,
    during or after the first byte — every request it followed is closed (cancelled unless it is over).
    The stream generator closes its own on the way out too; this is for the one that never started."""
    async def app(scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in COMPLETION_PATHS:
            return await asgi_app(scope, receive, send)
        follows: list[_Follow] = []
        try:
            await asgi_app({**scope, _FOLLOWS: follows}, receive, send)
        finally:
            for follow in follows:
                follow.close()
    return app


async def _complete(app: QuartTrio, node: Entry, model_name: str, tool_parser: str | None, *, chat: bool):
    vocab, body = await read_json(node)
    setup = tool_setup(vocab.chat_template, tool_parser)
    limits = limits_for(vocab_size=vocab.vocab_size, max_seqs=node.max_seqs, max_context=vocab.max_context,
                        longest_token_bytes=vocab.longest_token_bytes, tool_family=setup.family)
    api = await prepared(functools.partial(parse_request, body, chat=chat, seed_if_unset=secrets.randbits(31),
                                           limits=limits))
    check_model(api.model, model_name)
    texts = await prepared(functools.partial(prompts, vocab, api, setup))
    request_id = uuid.uuid4().hex
    choices = [Choice(i * api.n + j, f"{request_id}-{i * api.n + j}", tuple(ids), text)
               for i, (ids, text) in enumerate(texts) for j in range(api.n)]
    completion = Completion(api, request_id, choices, lambda t: vocab.token_bytes([t], specials=True))
    follow = _Follow(node, vocab, completion, _admit(node, vocab, api, choices), setup.family)
    request.scope[_FOLLOWS].append(follow)  # no checkpoint since the admission: nothing can be lost between
    if not api.stream:
        try:
            async with aclosing(follow.pieces()) as pieces:
                async for _ in pieces:
                    pass
        finally:
            follow.close()
        return completion.response()
    response = app.response_class(follow.sse(), content_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"})
    response.timeout = None  # quart cuts streamed bodies at RESPONSE_TIMEOUT otherwise
    return response


def _admit(node: Entry, vocab: Vocabulary, api: ApiRequest, choices: list[Choice]) -> Inbox:
    """Every choice is a request of the engine's, admitted together or not at all; their events share one
    inbox. max_tokens past what the context holds is refused, as vLLM does (max_tokens 0 runs one token:
    the prompt's logprobs come with it, and the answer leaves it out)."""
    requests = [_engine_request(node, vocab, api, c) for c in choices]
    # one request always fits an idle chain; several may never, and no retry passes then: a 400, not a 429
    if len(requests) > 1 and (most := admissible(node.health())) is not None and len(requests) > most:
        raise ApiError(400, f"this request is {len(requests)} sequences (its prompts times n), and they are admitted "
                            f"together: the chain runs and queues at most {most} at once (--max-seqs and --max-queue), "
                            f"so it could never start; send at most {most}", param="prompt" if not api.chat else "n",
                       code="invalid_value")
    events, admitted = None, []
    try:
        for req in requests:
            events = node.open_local(req, into=events)
            admitted.append(req.request_id)
    except Refused as exc:
        for rid in admitted:
            node.close_local(rid, cancel=True)
        raise _refused(exc, api, vocab.max_context, len(requests[len(admitted)].prompt_token_ids)) from None
    except BaseException:
        for rid in admitted:
            node.close_local(rid, cancel=True)
        raise
    return events


def admissible(health: dict) -> int | None:
    """Pure: the most requests stage 0 admits at once on an idle chain, its slots and then its queue, from its
    /health figures; None where they are not known (loading)."""
    slots, queue = health.get("slots", {}).get("capacity"), health.get("queue", {}).get("max")
    return None if slots is None or queue is None else slots + queue


def _engine_request(node: Entry, vocab: Vocabulary, api: ApiRequest, c: Choice) -> InferenceRequest:
    context, prompt = vocab.max_context, c.prompt_token_ids
    room = context - len(prompt)  # a prompt that leaves none is the actor's to refuse (PROMPT_TOO_LONG)
    if room > 0 and api.max_tokens is not None and api.max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{api.max_tokens} output tokens and your prompt contains {len(prompt)} input tokens, "
                            f"for a total of {api.max_tokens + len(prompt)} tokens.", param="max_tokens",
                       code="context_length_exceeded")
    wanted = 1 if api.max_tokens == 0 else api.max_tokens or room  # echo alone still samples one token
    max_tokens = min(max(wanted, 1), MAX_TOKENS_LIMIT)
    sampling = attrs.evolve(api.sampling, seed=(api.sampling.seed + c.index % api.n) % (MAX_SEED + 1))
    return InferenceRequest(c.request_id, "", max_tokens=max_tokens, sampling=sampling, reply_to=node.url,
                            prompt_token_ids=prompt, cache_salt=api.cache_salt)


def _refused(exc: Refused, api: ApiRequest, context: int, prompt_len: int) -> ApiError:
    param = "messages" if api.chat else "prompt"
    if exc.code == PROMPT_TOO_LONG:
        return too_long(context, param, f"{prompt_len} tokens")
    if exc.code == PROMPT_INVALID:
        return ApiError(400, exc.message, param=param, code="invalid_value")
    return api_refusal(exc.status, exc.message, exc.retry_after_s)


class _Follow:
    """A request's choices followed from the entry: their tokens become text pieces, in order per choice."""

    def __init__(self, node: Entry, vocab: Vocabulary, completion: Completion, events: Inbox,
                 tool_family: str):
        self.node, self.vocab, self.completion, self.events = node, vocab, completion, events
        api = completion.request
        if api.tools is not None and api.tools.parsed:  # each choice's text is read for calls as it comes
            for c in completion.choices:
                c.parser = ToolParser(tool_family, api.tools.names(), parallel=api.tools.parallel)
        self.choices = {c.request_id: c for c in completion.choices}
        self.texts = {rid: TextStream(api.stop, include_stop=api.include_stop_str_in_output) for rid in self.choices}
        self.stops = stop_set(vocab.stop_ids, api.sampling)  # what ends a choice, as the last stage says
        self.over: set[str] = set()  # choices ended (or ended by us): nothing to cancel on the way out

    async def pieces(self):
        """(choice, its new content and tool calls, token ids, logprob entries) as tokens come back, until every
        choice is over; each choice's text, calls and finish reason are kept."""
        going = set(self.choices)
        async for event in self.events:
            c = self.choices.get(event.request_id)
            if isinstance(event, InferenceResponse) or c is None or c.request_id not in going:
                continue  # the stages' figures came before the last token: read by _final
            if event.end is not None:
                self._ended(event)
            piece = self._piece(c, event)
            yield piece
            if c.finish_reason is not None:
                going.discard(c.request_id)
                if self.texts[c.request_id].stopped:
                    self._close(c.request_id, cancel=True)  # a stop string: the stages need not go on
                if not going:
                    break
        if self.completion.request.return_token_ids:
            await self._final()
        self.over.update(self.choices)

    def _piece(self, c: Choice, event: Progress) -> tuple[Choice, list[Content | Call], list[int], Entries]:
        api, token = self.completion.request, event.token_id
        text, entries = "", []
        if not c.token_ids and api.echo:  # the first token: the prompt comes first
            c.prompt_logprobs = event.prompt_logprobs
            text, entries = c.prompt_text, c.prompt_entries()
        if api.max_tokens == 0:  # echo alone: the token sampled to get there is no part of the answer
            c.finish_reason = "length"
            return c, [Content(text)], [], entries
        stream = self.texts[c.request_id]
        c.token_ids.append(token)
        if event.logprob is not None:
            c.logprobs.append(event.logprob)
            entries.append((token, event.logprob))
        # the parser must see a family's marker where it is a control token (vLLM: skip_special_tokens off)
        specials = not api.skip_special_tokens or (c.parser is not None and c.parser.family in CONTROL_MARKED)
        new = "" if token in self.stops else stream.push(self.vocab.token_bytes([token], specials=specials))
        if event.done:
            new += stream.flush()
        events = [Content(text)] if text else []
        events += c.read(new, over=stream.stopped or event.done)
        if stream.stopped or event.done:
            c.finish_reason = "stop" if stream.stopped or token in self.stops else "length"
            if c.tool_calls and c.finish_reason == "stop":
                c.finish_reason = "tool_calls"
        return c, events, [token], entries

    def _ended(self, event: Progress) -> None:
        self.over.add(event.request_id)
        end = event.end
        if end.reason is EndReason.FAILED and end.param:  # the request's own value: the client's to fix
            raise ApiError(400, end.error or f"{end.param} cannot be computed", param=end.param, code="invalid_value")
        if end.reason is EndReason.FAILED:
            raise ApiError(500, end.error or "a stage failed", type="server_error", code="stage_failed")
        raise ApiError(500, f"the request was {end.reason.value} before its last token", type="server_error")

    async def _final(self) -> None:
        """The last stage's figures (compute per stage, timing), for clients that asked for token ids."""
        waiting = set(self.choices)
        with trio.move_on_after(FINAL_WAIT_S):
            async for event in self.events:
                if isinstance(event, InferenceResponse) and event.request_id in waiting:
                    self.choices[event.request_id].timings = {
                        "stage_compute_ms": list(event.stage_compute_ms), "decode_s": event.decode_s,
                        "queued_s": event.queued_s, "token_ms": list(event.token_ms)}
                    waiting.discard(event.request_id)
                    if not waiting:
                        return

    def _close(self, request_id: str, *, cancel: bool) -> None:
        self.node.close_local(request_id, cancel=cancel or request_id not in self.over)
        self.over.add(request_id)

    def close(self) -> None:
        """Stop following every choice; those not over are cancelled, freeing their slots."""
        for rid in self.choices:
            self._close(rid, cancel=False)

    async def sse(self):
        """The stream: a first chunk per choice at once (the role), a chunk per piece of text (or of
        logprobs), each choice's finish, usage if asked, then [DONE]; an error event then [DONE] if the
        request fails."""
        c, api = self.completion, self.completion.request
        try:
            for choice in c.choices:
                yield _event(c.chunk(choice, "", [], [], first=True))
            async with aclosing(self.pieces()) as pieces:
                async for choice, events, ids, entries in pieces:
                    for chunk in c.chunks(choice, events, ids, entries):
                        yield _event(chunk)
                    if choice.finish_reason is not None and not api.return_token_ids:
                        yield _event(c.chunk(choice, "", [], [], finish=True))
            if api.return_token_ids:  # after _final: the finish chunks carry the stages' figures
                for choice in c.choices:
                    yield _event(c.chunk(choice, "", [], [], finish=True))
            if api.include_usage:
                yield _event(c.usage_chunk())
        except ApiError as exc:
            yield _event(exc.body())
        finally:
            self.close()  # the client went away mid-stream (cancelled here), or the request is over
        yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"
