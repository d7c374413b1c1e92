"""The HTTP face of a node (and of the runner): one quart-trio app served by hypercorn inside the
caller's nursery, HTTP/2 cleartext with prior knowledge, HTTP/1.1 still accepted.

Handlers validate, hand the message to the dispatcher and answer at once: a hop never waits for
downstream compute. Who may call what is node/transport/auth.py's: the client surface (the OpenAI API, /v1/pipeline,
/metrics) takes a client API key, everything else the cluster token; /health and the chat page are open.

Every refusal is JSON, Quart's own 404 and 405 included: `{"error": message}`, or the shape a surface added on
top registers for its paths (shape_refusals: the OpenAI API's). /health answers 503 until the dispatcher says
it is `serving`, then 200, with the same body either way: a load balancer or a script waiting for the
cluster reads the status, a person reads the body.
"""
from __future__ import annotations

import collections
import functools
import logging
import socket
from collections.abc import Callable, Iterable
from typing import Protocol

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart import Response, current_app, jsonify, request
from quart_trio import QuartTrio
from werkzeug.exceptions import MethodNotAllowed, NotFound

from roles.actions import Refused

from node.membership import gossip
from node.membership.swim import Swim, WrongTargetError
from node.observe.log import error_event
from node.observe.metrics import CONTENT_TYPE as node_metrics_content_type
from node.transport import auth, conn_guard, frames, h1_guard, h2_early_answer, h2_flow, h2_guard, stream_guard, wire

log = logging.getLogger("pp.http")
GOSSIP_MAX_BODY = 1 << 19  # a gossip message of gossip.MAX_ENTRIES member records is about 64 KiB
MAX_WAIT_S = 30.0  # longest long poll; proxies drop idle requests not much later
STILL_LOADING = "this stage is still loading its weights"  # the one answer (a 503) to what needs a model too early
RefusalShape = Callable[[int, str], dict]  # (status, message) -> a refusal's JSON body


def still_loading() -> Refused:
    """The refusal of whatever needs the model while `Dispatcher.loading`."""
    return Refused(503, STILL_LOADING)


class Dispatcher(Protocol):
    """What the app hands messages to: a stage node or the runner."""

    swim: Swim | None
    loading: bool  # True until messages for the model can be admitted (the runner never takes them): still_loading()
    serving: bool  # /health's status: 200 once this node does its part of serving requests, 503 before
    hidden_dim: int | None  # the activations' width, once not loading

    def deliver(self, message, *, source: str | None = None, sent_at: float | None = None) -> None: ...
    # admit and enqueue, or raise Refused; `source` (the sending stage) and `sent_at` (its clock) time the hop

    async def wait_response(self, request_id: str, wait_s: float): ...  # a kept response or None

    def health(self) -> dict: ...


def make_app(dispatcher: Dispatcher, *, token: str, max_body_bytes: int, link_streams: bool = False,
             api_keys: tuple[str, ...] = (), token_is_api_key: bool = False) -> QuartTrio:
    """`token` opens the cluster's endpoints, `api_keys` the client surface (and `token` too if
    `token_is_api_key`): node/transport/auth.py. `link_streams`: serve /v1/link and /v1/hops (a stage; the dispatcher
    then has `take_frame`, `links_in` and `hops`)."""
    h1_guard.install()
    h2_guard.install()
    h2_early_answer.install()  # an answer before the body is in resets the stream: the sender stops
    h2_flow.install()  # a stream holds at most a window unsent; a stalled one ends
    stream_guard.install()  # requests in flight from non-members, per address and in all
    app = QuartTrio("pp")
    app.asgi_app = _refuse_websockets(app.asgi_app)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["BODY_TIMEOUT"] = 120
    app.http_versions = collections.Counter()  # requests served per HTTP version, for tests and /health
    app.body_bytes = collections.Counter()  # request body bytes received per path: bytes on the wire
    app.refusal_shapes = _Shapes()  # see shape_refusals
    keys = auth.Keys.of(token, api_keys, token_is_api_key=token_is_api_key)
    app.pp_is_member = keys.is_token  # serve_app's stream_guard counts everyone else's requests

    @app.before_request
    async def authorize():
        app.http_versions[request.http_version] += 1
        if request.path in auth.OPEN_PATHS:  # the chat page holds no secret; every call it makes carries a key
            return None
        credential = keys.credential(request.headers.get("Authorization", ""))
        refused = auth.refusal(request.path, credential, token_is_api_key=keys.token_is_api_key, routed=_routed())
        if refused is None:
            return None
        if refused.status == 403:  # a credential of the wrong kind: worth a line, unlike a stray 401
            log.info("refused %s %s to a %s: %s", request.method, request.path, credential.value, refused.message)
        return _refusal(refused.status, refused.message)

    @app.after_request
    async def close_after_early_refusal(response):
        # HTTP/1.1: a refusal may be answered before the request body is in (a 401 is decided on the headers);
        # the server then closes the connection (node/transport/h1_guard.py), and says so, so that the client does not
        # send its next request into it (RFC 9112 §9.6). HTTP/2 has no such header: a refused stream is
        # reset on its own and the connection carries on.
        if (response.status_code >= 400 and request.http_version in ("1.0", "1.1")
                and (request.content_length or request.headers.get("Transfer-Encoding"))):
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(413)
    async def too_large(_):
        return _refusal(413, f"body over the limit of {max_body_bytes} bytes")

    @app.errorhandler(NotFound)
    async def not_found(_):
        return _refusal(404, f"no such endpoint: {request.method} {request.path}")

    @app.errorhandler(MethodNotAllowed)
    async def method_not_allowed(exc: MethodNotAllowed):
        allowed = sorted(exc.valid_methods or ())
        body, status = _refusal(405, f"{request.path} does not take {request.method}; it takes {', '.join(allowed)}")
        return body, status, {"Allow": ", ".join(allowed)}

    @app.get("/health")
    async def health():
        body = {**dispatcher.health(), "http_versions": dict(app.http_versions), "body_bytes": dict(app.body_bytes)}
        return jsonify(body), 200 if dispatcher.serving else 503

    @app.get("/metrics")
    async def metrics():
        node_metrics = getattr(dispatcher, "metrics", None)
        if node_metrics is None:
            return _error(404, "no metrics here: /metrics is served by the stages")
        return Response(node_metrics.render(), content_type=node_metrics_content_type)

    @app.get("/v1/members")
    async def members():
        swim = _swim(dispatcher)
        return jsonify({"members": wire.converter.unstructure(list(swim.members().values()))})

    for path, kind in [("/v1/inference", wire.InferenceRequest), ("/v1/next-token", wire.NextTokens),
                       ("/v1/end", wire.EndRequest), ("/v1/cancel", wire.CancelRequest),
                       ("/v1/response", wire.InferenceResponse)]:
        app.add_url_rule(path, endpoint=path, view_func=_json_endpoint(dispatcher, kind), methods=["POST"])

    @app.post("/v1/activation")
    async def activation():
        if dispatcher.loading:
            raise still_loading()
        body = await request.get_data()
        app.body_bytes[request.path] += len(body)
        act = wire.decode_activation(body, dispatcher.hidden_dim)
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

    _gossip_routes(app, dispatcher)
    if link_streams:
        _stage_routes(app, dispatcher)

    @app.errorhandler(wire.WireError)
    async def malformed(exc):
        return _error(400, str(exc))

    @app.errorhandler(Refused)
    async def refused(exc):
        log.info("refused %s %s: %s", request.method, request.path, exc.message)
        headers = {} if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
        body, status = _refusal(exc.status, exc.message)
        return body, status, headers

    return app


def _refuse_websockets(asgi_app):
    """ASGI middleware: pp serves no WebSocket, so every upgrade is closed before Quart sees it (hypercorn answers
    403). Quart would run its before_websocket hooks, not `authorize`, and its 404 handler would read `request`
    outside a request context: a 500 and a logged traceback per upgrade."""
    async def app(scope, receive, send):
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await asgi_app(scope, receive, send)
    return app


def shape_refusals(app: QuartTrio, paths: Iterable[str], shape: RefusalShape, *, prefixes: Iterable[str] = (),
                   unrouted: Iterable[str] = ()) -> None:
    """The app's refusals on `paths` and on every path under `prefixes` (401, 403, 404, 405, 413 and a route's
    Refused) get `shape`'s body rather than {"error": message}: a surface added on top (the OpenAI API)
    registers its own shape with its routes. Under `unrouted` prefixes, a path that no route serves gets it too
    (its 401 and 404), and so does a 405 (a route, but not of that method)."""
    shapes = app.refusal_shapes
    shapes.paths.update(dict.fromkeys(paths, shape))
    shapes.prefixes += [(prefix, shape) for prefix in prefixes]
    shapes.unrouted += [(prefix, shape) for prefix in unrouted]


@attrs.define
class _Shapes:
    """Who shapes the refusals on which paths: shape_refusals fills it in."""

    paths: dict[str, RefusalShape] = attrs.Factory(dict)
    prefixes: list[tuple[str, RefusalShape]] = attrs.Factory(list)
    unrouted: list[tuple[str, RefusalShape]] = attrs.Factory(list)

    def of(self, path: str, *, unrouted: bool) -> RefusalShape | None:
        """`unrouted`: no route serves the path, or none with this method (a 405)."""
        if (shape := self.paths.get(path)) is not None:
            return shape
        under = [*self.prefixes, *self.unrouted] if unrouted else self.prefixes
        return next((shape for prefix, shape in under if path.startswith(prefix)), None)


def _routed() -> bool:
    """Whether a route serves this request's path, with its method or (a 405 to come) with another."""
    return not isinstance(request.routing_exception, NotFound)


def _refusal(status: int, message: str):
    shape = current_app.refusal_shapes.of(request.path, unrouted=status == 405 or not _routed())
    return (shape(status, message), status) if shape is not None else _error(status, message)


def _json_endpoint(dispatcher: Dispatcher, kind: type):
    async def endpoint():
        body = await request.get_data()
        current_app.body_bytes[request.path] += len(body)
        message = wire.decode(kind, body)
        dispatcher.deliver(message, **_sender())
        return jsonify({"accepted": True}), 202
    return endpoint


def _sender() -> dict:
    """Who sent a pipeline POST and when, if a stage did (headers SENT_FROM, SENT_AT): for the hop figures."""
    source, sent_at = request.headers.get(wire.SENT_FROM), request.headers.get(wire.SENT_AT)
    try:
        return {"source": source, "sent_at": float(sent_at)} if source and sent_at else {}
    except ValueError:
        raise wire.WireError(f"{wire.SENT_AT}: expected a number, got {sent_at!r}") from None


def _stage_routes(app: QuartTrio, dispatcher: Dispatcher) -> None:
    """What only a stage serves: its hop figures, and link streams (node/transport/streams.py), whose frames are read
    as they arrive for as long as the sender keeps writing."""

    @app.get("/v1/hops")
    async def hop_figures():
        """Where each hop's time goes (node/observe/hops.py): median and p99 per part, per link."""
        return jsonify(dispatcher.hops.summary())

    @app.post("/v1/hops/reset")
    async def hop_figures_reset():
        dispatcher.hops.reset()
        return jsonify({"reset": True})

    @app.get("/v1/link/<link_id>")
    async def link_state(link_id: str):
        if dispatcher.loading:
            raise still_loading()
        if (full := dispatcher.links_in.open_refusal()) is not None:  # the open that follows would be refused
            raise Refused(503, full, retry_after_s=1)
        return jsonify({"last_seq": dispatcher.links_in.last_seq(link_id), "boot": dispatcher.links_in.boot})

    @app.post("/v1/link")
    async def link():
        link_id, source = request.args.get("link", ""), request.args.get("from", "")
        if not (0 < len(link_id) <= 64 and 0 < len(source) <= 64):
            raise wire.WireError("link, from: both required, each 1..64 characters")
        if dispatcher.loading:
            raise still_loading()
        if (full := dispatcher.links_in.open_refusal()) is not None:
            raise Refused(503, full, retry_after_s=1)
        dispatcher.links_in.streams += 1
        try:
            taken = await _read_link(dispatcher, link_id, source)
        finally:
            dispatcher.links_in.streams -= 1
        return jsonify({"frames": taken}), 200


async def _read_link(dispatcher: Dispatcher, link_id: str, source: str) -> int:
    """Deliver a link stream's frames as they arrive; the number taken. Whatever ends this early (the answer
    then comes while the sender still writes) resets the stream (node/transport/h2_early_answer.py), so the
    sender reopens it and resends from the last frame delivered here."""
    reader, taken = frames.FrameReader(dispatcher.hidden_dim), 0
    try:
        async for chunk in request.body:
            current_app.body_bytes[request.path] += len(chunk)
            reader.feed(chunk)
            for seq, sent_at, message in reader.frames():
                dispatcher.take_frame(link_id, source, seq, sent_at, message)
                taken += 1
    except wire.WireError as exc:
        # The frame was not delivered. The link's last delivered frame stays as it was, so the sender resends
        # from the refused one, and drops it alone once it is refused again (streams.LinkStream._drop_refused);
        # forgetting the link would have it resend frames delivered already, delivered twice.
        error_event(log, "link_frame_refused", link=link_id, source=source, error=str(exc),
                    last_seq=dispatcher.links_in.last_seq(link_id))
        raise
    except Exception as exc:
        # Frames up to the last delivered count as taken: the sender resends only those after it.
        error_event(log, "link_stream_failed", link=link_id, source=source,
                    error=f"{type(exc).__name__}: {exc}", last_seq=dispatcher.links_in.last_seq(link_id))
        raise
    return taken


def _gossip_routes(app: QuartTrio, dispatcher: Dispatcher) -> None:
    @app.post("/swim/ping")
    async def ping():
        msg = wire.decode(gossip.Ping, await _gossip_body())
        try:
            ack = await _swim(dispatcher).on_ping(msg)
        except WrongTargetError as exc:
            raise Refused(409, str(exc)) from None
        return Response(wire.encode(ack), content_type="application/json")

    @app.post("/swim/ping-req")
    async def ping_req():
        msg = wire.decode(gossip.PingReq, await _gossip_body())
        answer = await _swim(dispatcher).on_ping_req(msg)
        key = "ack" if isinstance(answer, gossip.Ack) else "nack"
        return jsonify({key: wire.converter.unstructure(answer)})

    @app.post("/swim/sync")
    async def sync():
        msg = wire.decode(gossip.Sync, await _gossip_body())
        return Response(wire.encode(_swim(dispatcher).on_sync(msg)), content_type="application/json")


async def _gossip_body() -> bytes:
    """A gossip message's body, refused (413) past GOSSIP_MAX_BODY as it arrives: decoding costs about 30 µs a
    member record on the event loop, and the app's body limit (what a prompt may need) would let a token holder
    send hundreds of thousands, refused only once decoded."""
    too_large = Refused(413, f"a gossip message is at most {GOSSIP_MAX_BODY} bytes")
    if (request.content_length or 0) > GOSSIP_MAX_BODY:
        raise too_large
    body = bytearray()
    async for chunk in request.body:
        body += chunk
        if len(body) > GOSSIP_MAX_BODY:
            raise too_large
    return bytes(body)


def _swim(dispatcher: Dispatcher) -> Swim:
    if dispatcher.swim is None:
        raise Refused(503, "membership is not running yet")
    return dispatcher.swim


def _error(status: int, message: str):
    return jsonify({"error": message}), status


class ListenError(OSError):
    """The node cannot listen where it was told to (the port is taken, the address is not this machine's)."""


def check_listenable(host: str, port: int) -> None:
    """Bind and release (host, port) as hypercorn will, so that a taken port is one clear error rather
    than a traceback from inside the server's nursery. Raises ListenError."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


async def serve_app(app: QuartTrio, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; reports the bound port (port 0 picks a free one). Raises ListenError."""
    check_listenable(host, port)
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("pp.hypercorn")
    # hypercorn closes an HTTP/2 connection after 1000 requests by default; a pipeline makes far more
    config.keep_alive_max_requests = 2 ** 31
    config.graceful_timeout = 1.0
    conn_guard.install(config)  # connections per peer address and in all
    config.pp_streams = app.pp_streams = stream_guard.GuestStreams(getattr(app, "pp_is_member", lambda header: False))

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(serve, app, config))
        task_status.started(int(binds[0].rsplit(":", 1)[1]))
