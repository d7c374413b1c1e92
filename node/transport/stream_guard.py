"""Requests in flight over HTTP/2 for whoever is not a member: at most so many from one address, and in all,
counted apart for keyed clients and for guests (no credential).

hypercorn lets each connection open 100 streams at once, and conn_guard.py lets an address hold 256
connections: 25,600 requests in flight from one address, each an app task, before a byte of them is
authenticated. The audit's burst (200 connections × 100 `GET /health`, ~10 bytes a request with HPACK) had the
event loop run thousands of tasks while gossip's pings waited behind them; stage 0 missed its pings, was
declared dead and replaced, and every request in flight died with it. Here a stream whose request does not
carry the cluster token is admitted only while its address has fewer than `per_peer` such streams in flight,
and the node fewer than `total`; past that it is refused with RST_STREAM REFUSED_STREAM (RFC 9113 §8.7: the
client may retry it), before hypercorn makes it a task. Members (the cluster token) are not counted: on
loopback, and behind one NAT, the cluster's own traffic shares an address with whoever else is there, and
gossip must get through.

The counts are kept per connection as well, so a connection that ends however it ends (closed, reset, or on
an exception conn_guard.py contained) gives back what it held.
"""
from __future__ import annotations

import collections
import logging
from typing import Callable

import h2.errors
import h2.exceptions
from hypercorn.protocol import h2 as hypercorn_h2
from hypercorn.protocol import h11 as hypercorn_h11

from node.transport import h2_flow
from node.transport.conn_guard import ConnectionLimits, refusal

PER_PEER = 128  # a client's concurrency: the entry queues 64 and runs --max-seqs; past that it answers 429
TOTAL = 512

log = logging.getLogger("pp.hypercorn")
Connection = tuple  # (host, port) of the peer: one TCP connection


MEMBER, CLIENT, GUEST = "member", "client", "guest"  # whose a request is, by the credential its headers carry
LIMITS = ConnectionLimits(per_peer=PER_PEER, total=TOTAL)  # requests that carry a client API key
GUEST_LIMITS = LIMITS  # requests that carry none (/health, the chat page, whoever probes): the same caps, apart


def stream_refusal(limits: ConnectionLimits, from_peer: int, in_all: int, who: str = "without the cluster token"
                   ) -> str | None:
    """Why one more stream of its kind is refused, given that kind's streams in flight (None: it is taken)."""
    return refusal(limits, from_peer, in_all, f"requests in flight {who}")


class _Pool:
    """The HTTP/2 streams in flight of one kind of request, by address and by connection."""

    def __init__(self, limits: ConnectionLimits, who: str):
        self.limits, self.who = limits, who
        self.by_peer: collections.Counter[str] = collections.Counter()
        self.by_connection: dict[Connection, set[int]] = {}

    def take(self, connection: Connection, stream_id: int) -> str | None:
        peer = str(connection[0])
        why = stream_refusal(self.limits, self.by_peer[peer], sum(self.by_peer.values()), self.who)
        if why is None:
            self.by_connection.setdefault(connection, set()).add(stream_id)
            self.by_peer[peer] += 1
        return why

    def release(self, connection: Connection, stream_id: int) -> None:
        held = self.by_connection.get(connection)
        if held is None or stream_id not in held:
            return
        held.discard(stream_id)
        if not held:
            del self.by_connection[connection]
        self._give_back(str(connection[0]), 1)

    def release_connection(self, connection: Connection) -> None:
        self._give_back(str(connection[0]), len(self.by_connection.pop(connection, ())))

    def _give_back(self, peer: str, n: int) -> None:
        self.by_peer[peer] -= n
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]


class GuestStreams:
    """The HTTP/2 streams in flight of requests that are not members', in two pools: those that
    carry a client API key, and those that carry no credential (guests). Each pool has its own caps, so guests
    holding all theirs (round 3: 512 zero-window `GET /health` streams from four addresses) refuse no keyed
    client, and members are never counted. The credential is read from the stream's HEADERS frame."""

    def __init__(self, is_member: Callable[[object], bool], limits: ConnectionLimits | None = None, *,
                 is_client: Callable[[bytes], bool] = lambda header: False,
                 client_limits: ConnectionLimits | None = None):
        self.is_member, self.is_client = is_member, is_client
        self.guests = _Pool(limits or GUEST_LIMITS, "without a credential")
        self.clients = _Pool(client_limits or LIMITS, "with a client API key")
        self.refused = 0

    @property
    def by_peer(self) -> collections.Counter[str]:
        """Guests' streams in flight by address."""
        return self.guests.by_peer

    def kind(self, authorization: bytes, connection=None) -> str:
        """Whose a request is: a member's (its connection showed the cluster's certificate: is_member), a keyed
        client's (by its Authorization header), or a guest's."""
        if connection is not None and self.is_member(connection):
            return MEMBER
        return CLIENT if self.is_client(authorization) else GUEST

    def take(self, connection: Connection, stream_id: int, kind: str = GUEST) -> str | None:
        """Count a client's or a guest's stream (kind); why it is refused, or None."""
        why = (self.clients if kind == CLIENT else self.guests).take(connection, stream_id)
        self.refused += why is not None
        return why

    def release(self, connection: Connection, stream_id: int) -> None:
        for pool in (self.guests, self.clients):
            pool.release(connection, stream_id)

    def release_connection(self, connection: Connection) -> None:
        for pool in (self.guests, self.clients):
            pool.release_connection(connection)


def authorization(headers) -> bytes:
    return next((value for name, value in headers if name == b"authorization"), b"")


def install() -> None:
    """Count and limit guest streams on servers whose hypercorn config has `pp_streams` (serve_app sets it)."""
    protocol = hypercorn_h2.H2Protocol
    if getattr(protocol, "_pp_stream_guard", False):
        return
    original_create, original_close = protocol._create_stream, protocol._close_stream

    async def _create_stream(self, request) -> None:
        guests: GuestStreams | None = getattr(self.config, "pp_streams", None)
        if guests is None or self.client is None:
            return await original_create(self, request)
        kind = _trusted(self, guests, request.headers)
        if kind == MEMBER:
            return await original_create(self, request)
        why = guests.take(self.client, request.stream_id, kind)
        if why is not None:
            return await _refuse(self, guests, request.stream_id, why)
        try:
            await original_create(self, request)
        except BaseException:
            guests.release(self.client, request.stream_id)
            raise
        if kind == GUEST:
            h2_flow.hurry_guest(self, request.stream_id)

    async def _close_stream(self, stream_id: int) -> None:
        try:
            await original_close(self, stream_id)
        finally:
            guests: GuestStreams | None = getattr(self.config, "pp_streams", None)
            if guests is not None and self.client is not None:
                guests.release(self.client, stream_id)

    protocol._create_stream, protocol._close_stream = _create_stream, _close_stream
    protocol._pp_stream_guard = True
    h1, original_h1_create = hypercorn_h11.H11Protocol, hypercorn_h11.H11Protocol._create_stream

    async def _create_h1_stream(self, request) -> None:
        if (guests := getattr(self.config, "pp_streams", None)) is not None:
            _trusted(self, guests, request.headers)
        await original_h1_create(self, request)

    h1._create_stream = _create_h1_stream


def _trusted(protocol, guests: GuestStreams, headers) -> str:
    """Whose the request is (GuestStreams.kind); a member's or a keyed client's makes its connection one a newcomer
    never displaces at the connection limit (conn_guard.Admission)."""
    kind = guests.kind(authorization(headers), protocol.client)
    if kind != GUEST and (admission := getattr(protocol.config, "pp_admission", None)) is not None:
        admission.trust(protocol.client)
    return kind


async def _refuse(protocol, guests: GuestStreams, stream_id: int, why: str) -> None:
    if guests.refused in (1, 10, 100) or guests.refused % 1000 == 0:  # a burst logs a few lines
        log.warning("refusing a stream from %s: %s (%d refused so far)", protocol.client, why, guests.refused)
    try:
        protocol.connection.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.REFUSED_STREAM)
    except h2.exceptions.ProtocolError:
        return
    await protocol._flush()
