"""The pipeline's messages, served by a stage and by the runner alike: the JSON messages and the activations
posted one by one, each handed to the dispatcher and answered at once (a hop never waits for downstream
compute), and the long poll for a response kept here for an asker that cannot be reached.

A POST body is held to what a link frame of its kind may hold (frames.frame_limit: a peer that sends more is
refused as the bytes arrive, not after the app's 64 MiB), to BODY_TOTAL_S from its first byte to its last, and,
past LARGE_BODY bytes, to LARGE_AT_ONCE such bodies taken at once per node, decoded in a worker thread; one more is
refused with 503 and Retry-After before its body is read (hypercorn acknowledges a body's bytes as they come, so
a body left waiting would be buffered anyway; a peer's send retries a 503). Round 3's audit stalled /health 2.2 s
with one 48 MB JSON body decoded on the event loop, and held 509 MiB with 8 activation bodies at once (issue 54,
finding 5)."""
from __future__ import annotations

import contextlib
from typing import Protocol

import trio
from quart import Response, jsonify, request
from quart_trio import QuartTrio

from roles.actions import Refused
from node.transport import frames, wire
from node.transport.routes import Traffic, still_loading

MAX_WAIT_S = 30.0  # longest long poll; proxies drop idle requests not much later
BODY_TOTAL_S = 60.0  # a pipeline body from first byte to last: a link frame's 16 MiB at 2.2 Mbit/s
LARGE_BODY = 1 << 20  # past this a body takes one of LARGE_AT_ONCE turns and is decoded off the event loop
LARGE_AT_ONCE = 2
_LARGE = trio.lowlevel.RunVar("pp_large_pipeline_bodies")
JSON_MESSAGES = [("/v1/inference", wire.InferenceRequest), ("/v1/next-token", wire.NextTokens),
                 ("/v1/end", wire.EndRequest), ("/v1/cancel", wire.CancelRequest),
                 ("/v1/response", wire.InferenceResponse)]


class PipelineDispatcher(Protocol):
    """What the pipeline routes hand messages to: a stage node or the runner."""

    loading: bool  # True until messages for the model can be admitted (the runner never takes them): still_loading()
    hidden_dim: int | None  # the activations' width, once not loading

    def deliver(self, message, *, source: str | None = None, sent_at: float | None = None) -> None: ...
    # admit and enqueue, or raise Refused; `source` (the sending stage) and `sent_at` (its clock) time the hop

    async def wait_response(self, request_id: str, wait_s: float): ...  # a kept response or None


def add_pipeline_routes(app: QuartTrio, dispatcher: PipelineDispatcher) -> None:
    for path, kind in JSON_MESSAGES:
        app.add_url_rule(path, endpoint=path, view_func=_json_endpoint(dispatcher, kind), methods=["POST"])

    @app.post("/v1/activation")
    async def activation():
        if dispatcher.loading:
            raise still_loading()
        limit = frames.frame_limit(frames.ACTIVATION, dispatcher.hidden_dim)
        act = await _decoded(limit, lambda body: wire.decode_activation(body, dispatcher.hidden_dim))
        dispatcher.deliver(act, **_sender())
        return jsonify({"accepted": [s.request_id for s in act.meta.segments]}), 202

    @app.get("/v1/response/<request_id>")
    async def kept_response(request_id: str):
        """Long poll for a response kept here because its asker cannot be reached (behind NAT)."""
        try:
            wait_s = min(max(float(request.args.get("wait", "0")), 0.0), MAX_WAIT_S)
        except ValueError:
            raise wire.WireError("wait: expected a number of seconds") from None
        response = await dispatcher.wait_response(request_id, wait_s)
        if response is None:
            return Response(b"", status=204)  # a bytes body: quart wraps a missing one with asyncio
        return Response(wire.encode(response), content_type="application/json")


def _json_endpoint(dispatcher: PipelineDispatcher, kind: type):
    async def endpoint():
        message = await _decoded(frames.frame_limit(frames.NEXT_TOKENS, 0), lambda body: wire.decode(kind, body))
        dispatcher.deliver(message, **_sender())
        return jsonify({"accepted": True}), 202
    return endpoint


async def _decoded(limit: int, decode):
    """The request's body decoded, within `limit` bytes and BODY_TOTAL_S; a large one (by its Content-Length, or
    once it grows past LARGE_BODY) takes one of LARGE_AT_ONCE turns (503 where none is free) and is decoded in a
    worker thread."""
    if (request.content_length or 0) > limit:
        raise _too_large(limit)
    try:
        with trio.fail_after(BODY_TOTAL_S):
            if (request.content_length or 0) > LARGE_BODY:
                with _large_turn():
                    return await trio.to_thread.run_sync(decode, await _body(limit))
            body = await _body(limit, stop_at=LARGE_BODY)
            if len(body) <= LARGE_BODY:
                return decode(body)
            with _large_turn():  # no Content-Length said so: it grew past LARGE_BODY
                return await trio.to_thread.run_sync(decode, body + await _body(limit - len(body)))
    except trio.TooSlowError:
        raise Refused(408, f"{request.path}: the body did not arrive within {BODY_TOTAL_S:.0f} s") from None


async def _body(limit: int, *, stop_at: int | None = None) -> bytes:
    """The body's bytes (the rest of them), refused past `limit`; with `stop_at`, what has come once past it."""
    body = bytearray()
    async for chunk in request.body:
        body += chunk
        Traffic.of().body_bytes[request.path] += len(chunk)
        if len(body) > limit:
            raise _too_large(limit)
        if stop_at is not None and len(body) > stop_at:
            break
    return bytes(body)


def _too_large(limit: int) -> Refused:
    return Refused(413, f"{request.path}: a body is at most {limit} bytes, what a link frame of it may hold")


@contextlib.contextmanager
def _large_turn():
    """One of LARGE_AT_ONCE turns for a large body, or a 503 at once."""
    try:
        limiter = _LARGE.get()
    except LookupError:
        _LARGE.set(limiter := trio.CapacityLimiter(LARGE_AT_ONCE))
    try:
        limiter.acquire_nowait()
    except trio.WouldBlock:
        raise Refused(503, f"{request.path}: {LARGE_AT_ONCE} bodies over {LARGE_BODY} bytes are being taken "
                           f"already; retry", retry_after_s=1) from None
    try:
        yield
    finally:
        limiter.release()


def _sender() -> dict:
    """Who sent a pipeline POST and when, if a stage did (headers SENT_FROM, SENT_AT): for the hop figures."""
    source, sent_at = request.headers.get(wire.SENT_FROM), request.headers.get(wire.SENT_AT)
    try:
        return {"source": source, "sent_at": float(sent_at)} if source and sent_at else {}
    except ValueError:
        raise wire.WireError(f"{wire.SENT_AT}: expected a number, got {sent_at!r}") from None
