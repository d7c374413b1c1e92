"""The HTTP face of a node (and of the runner): one quart-trio app served by hypercorn inside the
caller's nursery, HTTP/2 cleartext with prior knowledge, HTTP/1.1 still accepted.

make_app is the shell: who may call what, the refusals, /health and /metrics. Its routes come in groups, each
with a Protocol of what it uses: the pipeline's messages (node/transport/pipeline_routes.py) and membership's
(node/transport/gossip_routes.py), served by every app, and a stage's link streams and hop figures
(node/transport/link_routes.py), which the stage adds. Handlers validate, hand the message to the dispatcher and
answer at once: a hop never waits for downstream compute. Who may call what is node/transport/auth.py's: the
client surface (the OpenAI API, /v1/pipeline, /metrics) takes a client API key, everything else the cluster
token; /health and the chat page are open.

Every refusal is JSON, Quart's own 404 and 405 included: `{"error": message}`, or the shape a surface added on
top registers for its paths (shape_refusals: the OpenAI API's). /health answers 503 until the dispatcher says
it is `serving`, then 200, with the same body either way: a load balancer or a script waiting for the
cluster reads the status, a person reads the body.
"""
from __future__ import annotations

import functools
import logging
import socket
import ssl
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

from node.observe.metrics import CONTENT_TYPE as node_metrics_content_type
from node.transport import auth, conn_guard, h1_guard, h2_early_answer, h2_flow, h2_guard, stream_guard, wire
from node.transport.gossip_routes import GossipDispatcher, add_gossip_routes
from node.transport.pipeline_routes import PipelineDispatcher, add_pipeline_routes
from node.transport.routes import STILL_LOADING, Traffic, still_loading
from node.transport.tls_accept import ServerTls, is_member

__all__ = [  # still_loading and STILL_LOADING are re-exported: the surfaces added on top refuse with them
    "Dispatcher", "ListenError", "STILL_LOADING", "check_listenable", "make_app", "serve_app",
    "shape_refusals", "still_loading"]
log = logging.getLogger("pp.http")
RefusalShape = Callable[[int, str], dict]  # (status, message) -> a refusal's JSON body
_SHAPES = "pp.refusal_shapes"  # its key in app.extensions: see shape_refusals


class Dispatcher(PipelineDispatcher, GossipDispatcher, Protocol):
    """What the app serves: a stage node or the runner. One with `metrics` (node/observe/metrics.py's
    NodeMetrics: a stage's) has them served at /metrics."""

    serving: bool  # /health's status: 200 once this node does its part of serving requests, 503 before

    def health(self) -> dict: ...


def make_app(dispatcher: Dispatcher, *, token: str, max_body_bytes: int, api_keys: tuple[str, ...] = (),
             token_is_api_key: bool = False) -> QuartTrio:
    """A member's certificate opens the cluster's endpoints (serve_app's `tls`), `api_keys` the client surface (and
    `token` too if `token_is_api_key`): node/transport/auth.py. A stage adds its link routes:
    link_routes.add_link_routes."""
    h1_guard.install()
    h2_guard.install()
    h2_early_answer.install()  # an answer before the body is in resets the stream: the sender stops
    h2_flow.install()  # a stream holds at most a window unsent; a stalled one ends
    stream_guard.install()  # requests in flight from non-members, per address and in all
    app = QuartTrio("pp")
    app.asgi_app = _refuse_websockets(app.asgi_app)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["BODY_TIMEOUT"] = 120
    Traffic().install(app)
    app.extensions[_SHAPES] = _Shapes()
    keys = auth.Keys.of(token, api_keys, token_is_api_key=token_is_api_key)
    app.pp_members = {}  # connections that showed a member's certificate (tls_accept.ServerTls.members)
    app.pp_is_client = keys.is_client  # serve_app's stream_guard counts keyed clients' streams apart from guests'
    _add_auth(app, keys)
    _add_refusals(app, max_body_bytes)
    _add_health(app, dispatcher)
    add_pipeline_routes(app, dispatcher)
    add_gossip_routes(app, dispatcher)
    return app


def _add_auth(app: QuartTrio, keys: auth.Keys) -> None:
    @app.before_request
    async def authorize():
        Traffic.of(app).http_versions[request.http_version] += 1
        if request.path in auth.OPEN_PATHS:  # the chat page holds no secret; every call it makes carries a key
            return None
        credential = keys.credential(request.headers.get("Authorization", ""))
        member = is_member(app.pp_members, request.scope.get("client"))
        refused = auth.refusal(request.path, credential, member=member, token_is_api_key=keys.token_is_api_key,
                               routed=_routed())
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


def _add_refusals(app: QuartTrio, max_body_bytes: int) -> None:
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

    @app.errorhandler(wire.WireError)
    async def malformed(exc):
        return _error(400, str(exc))

    @app.errorhandler(Refused)
    async def refused(exc):
        log.info("refused %s %s: %s", request.method, request.path, exc.message)
        headers = {} if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
        body, status = _refusal(exc.status, exc.message)
        return body, status, headers


def _add_health(app: QuartTrio, dispatcher: Dispatcher) -> None:
    @app.get("/health")
    async def health():
        traffic = Traffic.of(app)
        body = {**dispatcher.health(), "http_versions": dict(traffic.http_versions),
                "body_bytes": dict(traffic.body_bytes)}
        return jsonify(body), 200 if dispatcher.serving else 503

    @app.get("/metrics")
    async def metrics():
        node_metrics = getattr(dispatcher, "metrics", None)
        if node_metrics is None:
            return _error(404, "no metrics here: /metrics is served by the stages")
        return Response(node_metrics.render(), content_type=node_metrics_content_type)


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
    shapes = app.extensions[_SHAPES]
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
    shape = current_app.extensions[_SHAPES].of(request.path, unrouted=status == 405 or not _routed())
    return (shape(status, message), status) if shape is not None else _error(status, message)


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


async def serve_app(app: QuartTrio, host: str, port: int, *, tls: ssl.SSLContext | None = None,
                    plaintext: bool = False, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; reports the bound port (port 0 picks a free one). Raises ListenError. With `tls`
    (node/transport/tls.py's server context) connections are TLS, plain HTTP served beside it only where
    `plaintext` (stage 0's API: the cluster's routes refuse it, having no member's certificate)."""
    check_listenable(host, port)
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("pp.hypercorn")
    # hypercorn closes an HTTP/2 connection after 1000 requests by default; a pipeline makes far more
    config.keep_alive_max_requests = 2 ** 31
    config.graceful_timeout = 1.0
    conn_guard.install(config)  # connections per peer address and in all
    members = getattr(app, "pp_members", {})
    if tls is not None:
        config.pp_tls = ServerTls(tls, plaintext=plaintext, members=members)
    config.pp_streams = app.pp_streams = stream_guard.GuestStreams(
        functools.partial(is_member, members), is_client=getattr(app, "pp_is_client", lambda header: False))

    config.pp_writes = h2_flow.Writes()
    async with trio.open_nursery() as nursery:
        await nursery.start(h2_flow.cut_writes_when_stopped, config.pp_writes)
        binds = await nursery.start(functools.partial(serve, app, config))
        task_status.started(int(binds[0].rsplit(":", 1)[1]))
