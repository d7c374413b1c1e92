"""Outbound HTTP/2 to peers: one httpx client per process (one kept-alive connection per peer),
the cluster token on every request, failures turned into PeerError at this edge."""
from __future__ import annotations

import attrs
import httpx
import trio

from node.membership import gossip
from node.membership.swim import TransportError
from node.transport import wire

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
    def __init__(self, token: str, *, timeout_s: float = 30.0, http2: bool = True):
        # prior-knowledge h2c: http1=False makes httpx speak HTTP/2 over plain TCP
        self._client = httpx.AsyncClient(http1=not http2, http2=http2, timeout=timeout_s,
                                         headers={"Authorization": f"Bearer {token}"})

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
        except httpx.HTTPError as exc:  # connection refused/reset, timeouts, protocol errors
            raise PeerError(url, f"{type(exc).__name__}: {exc}", refused=connection_refused(exc)) from None
        if r.status_code >= 400:
            raise PeerError(url, f"HTTP {r.status_code}: {_error_text(r)}", r.status_code)
        return r

    async def send(self, base: str, message) -> httpx.Response:
        """POST a pipeline message to the endpoint for its type."""
        path, body, content_type = wire.body_of(message)
        return await self.post(base, path, body, content_type)


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


def _error_text(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error", r.text))
    except ValueError:
        return r.text[:200]


@attrs.frozen
class _AckOrNack:
    ack: gossip.Ack | None = None
    nack: gossip.Nack | None = None


def http1_client(token: str, timeout_s: float) -> PeerClient:
    """HTTP/1.1, for requests that are cancelled by design when they time out (gossip's probes, the pipeline
    view's asks for hop figures). httpcore's HTTP/2 loses count of a connection's streams when a request is
    cancelled mid-flight (encode/httpcore#943, #1022: it frees the stream's permit but never resets the stream,
    so h2 soon counts 100 open and every new request on that connection fails: "Max outbound streams is 100").
    A cancelled HTTP/1.1 request just closes its own connection. Pipeline messages and link streams stay on
    HTTP/2, where no timeout of ours cuts a request off mid-flight (a link probe is bounded, not cancelled)."""
    return PeerClient(token, timeout_s=timeout_s, http2=False)


def gossip_client(token: str) -> PeerClient:
    """Gossip's own client: its probes are cut off at the probe timeout (see http1_client)."""
    return http1_client(token, 10.0)


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
