"""Outbound HTTP/2 to peers: one httpx client per process (one kept-alive connection per peer), over TLS with
this member's certificate (node/transport/tls.py; the token itself is never sent), failures turned into
PeerError at this edge."""
from __future__ import annotations

import attrs
import httpx
import trio

from node.membership import gossip
from node.membership.swim import TransportError
from node.transport import wire
from node.transport.tls import CLUSTER_SNI, ClusterTls

SEND_ATTEMPTS = 4  # tries of one send, or of opening one link stream, before it fails
FIRST_RETRY_S = 0.1  # the wait after a first failed try; each next wait is three times the last


class PeerError(Exception):
    """A peer could not be reached, or answered with an error status."""

    def __init__(self, url: str, problem: str, status: int | None = None, *, refused: bool = False):
        super().__init__(f"{url}: {problem}")
        self.url, self.problem, self.status = url, problem, status
        self.refused = refused  # every connection attempt was refused: nothing listens there any more

    @property
    def retryable(self) -> bool:
        """Connection trouble and 5xx may pass; a 4xx means the message itself was refused."""
        return self.status is None or self.status >= 500


class Backoff:
    """The waits between the SEND_ATTEMPTS tries of a send to a peer: 0.1 s, 0.3 s, 0.9 s, then give up."""

    def __init__(self):
        self.failures = 0

    def failed(self) -> float | None:
        """Count a failed try: the wait before the next one, or None once all SEND_ATTEMPTS have failed."""
        self.failures += 1
        return None if self.failures >= SEND_ATTEMPTS else FIRST_RETRY_S * 3 ** (self.failures - 1)

    def reset(self) -> None:
        """A try went through (or the tries start over): the next failure is a first one again."""
        self.failures = 0


class PeerClient:
    def __init__(self, tls: ClusterTls, *, timeout_s: float = 30.0, http2: bool = True):
        # http1=False: HTTP/2 only (ALPN h2); every member's address is https://
        self._client = httpx.AsyncClient(timeout=timeout_s, transport=member_transport(tls, http2=http2))

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        with trio.CancelScope(shield=True):
            await self._client.aclose()

    @property
    def http(self) -> httpx.AsyncClient:
        """The client itself, for link streams (node/transport/streams.py), which read their answers their own way."""
        return self._client

    async def post(self, base: str, path: str, body: bytes, content_type: str = "application/json", *,
                   headers: dict[str, str] | None = None) -> httpx.Response:
        return await self._request("POST", base + path, content=body,
                                   headers={"Content-Type": content_type, **(headers or {})})

    async def get(self, base: str, path: str) -> httpx.Response:
        return await self._request("GET", base + path)

    async def _request(self, method: str, url: str, **kw) -> httpx.Response:
        try:
            r = await self._client.request(method, url, **kw)
        except httpx.HTTPError as exc:  # connection refused/reset, timeouts, protocol errors, TLS
            raise PeerError(url, described(exc), refused=connection_refused(exc)) from None
        if r.status_code >= 400:
            raise PeerError(url, f"HTTP {r.status_code}: {_error_text(r)}", r.status_code)
        return r

    async def send(self, base: str, message) -> httpx.Response:
        """POST a pipeline message to the endpoint for its type."""
        path, body, content_type = wire.body_of(message)
        return await self.post(base, path, body, content_type)


class _MemberTransport(httpx.AsyncHTTPTransport):
    """Every request names CLUSTER_SNI in its handshake: a stage 0 with an API certificate of its own shows members
    the cluster's (node/transport/tls.py)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.extensions["sni_hostname"] = CLUSTER_SNI
        return await super().handle_async_request(request)


def member_transport(tls: ClusterTls, *, http2: bool = True, http1: bool | None = None) -> httpx.AsyncBaseTransport:
    """httpx's transport as a member calls members: its certificate shown, theirs checked against the cluster's CA;
    HTTP/2 only, HTTP/1.1 only, or (`http1` too) whichever the server picks."""
    return _MemberTransport(verify=tls.client_context(), http1=not http2 if http1 is None else http1, http2=http2)


def connection_refused(exc: BaseException) -> bool:
    """Whether every attempt to connect was refused (ECONNREFUSED, anywhere in the cause chain; trio raises a
    group of one per address tried): the host answered that nothing listens at that port."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ConnectionRefusedError):
            return True
        if isinstance(exc, BaseExceptionGroup):
            return all(connection_refused(e) for e in exc.exceptions)
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def described(exc: httpx.HTTPError) -> str:
    """An httpx failure as a line; a certificate this cluster's CA did not sign says what that means."""
    text = f"{type(exc).__name__}: {exc}"
    if "CERTIFICATE_VERIFY_FAILED" in text:
        text += " (the peer's certificate is not this cluster's: a node started with another PP_CLUSTER_TOKEN?)"
    return text


def _error_text(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error", r.text))
    except ValueError:
        return r.text[:200]


@attrs.frozen
class _AckOrNack:
    ack: gossip.Ack | None = None
    nack: gossip.Nack | None = None


def http1_client(tls: ClusterTls, timeout_s: float) -> PeerClient:
    """HTTP/1.1, for requests that are cancelled by design when they time out (gossip's probes, the pipeline
    view's asks for hop figures). httpcore's HTTP/2 loses count of a connection's streams when a request is
    cancelled mid-flight (encode/httpcore#943, #1022: it frees the stream's permit but never resets the stream,
    so h2 soon counts 100 open and every new request on that connection fails: "Max outbound streams is 100").
    A cancelled HTTP/1.1 request just closes its own connection. Pipeline messages and link streams stay on
    HTTP/2, where no timeout of ours cuts a request off mid-flight (a link probe is bounded, not cancelled)."""
    return PeerClient(tls, timeout_s=timeout_s, http2=False)


def gossip_client(tls: ClusterTls) -> PeerClient:
    """Gossip's own client: its probes are cut off at the probe timeout (see http1_client)."""
    return http1_client(tls, 10.0)


class HttpTransport:
    """SWIM's transport over the node's HTTP endpoints."""

    def __init__(self, client: PeerClient):
        self._client = client

    async def ping(self, addr: str, msg: gossip.Ping) -> gossip.Ack:
        return await self._call(addr, "/swim/ping", msg, gossip.Ack)

    async def ping_req(self, addr: str, msg: gossip.PingReq) -> gossip.Ack | gossip.Nack:
        answer = await self._call(addr, "/swim/ping-req", msg, _AckOrNack)
        if (answer.ack is None) == (answer.nack is None):
            raise TransportError(addr, "ping-req answer must hold exactly one of ack, nack")
        return answer.ack or answer.nack

    async def sync(self, addr: str, msg: gossip.Sync) -> gossip.Sync:
        return await self._call(addr, "/swim/sync", msg, gossip.Sync)

    async def _call(self, addr: str, path: str, msg, kind: type):
        try:
            return wire.decode(kind, (await self._client.post(addr, path, wire.encode(msg))).content)
        except PeerError as exc:
            raise TransportError(addr, exc.problem, refused=exc.refused) from None
        except wire.WireError as exc:
            raise TransportError(addr, f"malformed answer: {exc}") from None
