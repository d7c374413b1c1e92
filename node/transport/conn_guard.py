"""Connection limits at a node's socket edge, and a connection's failure kept its own: at most so many TCP connections from one peer address, and
in all. hypercorn 0.18 has no such limit, so a client could open connections until the process ran out of
file descriptors (or memory for their protocol state), each costing a task and buffers before a byte is
authenticated. A connection past a limit is closed at once, before hypercorn reads from it: no protocol
state, no app task. A kept connection costs nothing here but a count, and a parked task until its first
byte (hypercorn sets a connection up only then).

Whatever escapes one connection's handling (a protocol library's exception on a frame it did not expect,
an app task's failure while it sends) closes that connection and is logged with its class. hypercorn runs
every connection in the server's nursery, so one such exception ended the whole node: a CONNECT without
:path, a PRIORITY frame for a stream never opened, undecodable header bytes, a malformed HTTP2-Settings.
Fixing those one by one would leave the next; containing them here is the mechanism.

The limits are loose for pp's own traffic: a stage holds a few connections to each peer (gossip, links,
the runner's polls), and a client of the OpenAI API one per stream; tests run every node and client on
127.0.0.1, one peer address for all of them.
"""
from __future__ import annotations

import collections
import logging
import socket

import attrs
import trio
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import parse_socket_addr

from node.transport import tls_accept
from node.transport.tls_accept import ServerTls

PER_PEER = 256
TOTAL = 1024

log = logging.getLogger("pp.hypercorn")


@attrs.frozen
class ConnectionLimits:
    per_peer: int = PER_PEER
    total: int = TOTAL


def refusal(limits: ConnectionLimits, open_from_peer: int, open_in_all: int, what: str = "connections open"
            ) -> str | None:
    """Why one more is refused, given what is held already (None: it is taken): connections here, requests in
    flight in node/transport/stream_guard.py."""
    if open_in_all >= limits.total:
        return f"{open_in_all} {what}, the most this node takes"
    if open_from_peer >= limits.per_peer:
        return f"{open_from_peer} {what} from this address, the most it may hold"
    return None


@attrs.define
class _Open:
    """A connection held: its peer, its socket stream, and whether it is trusted: it showed a member's certificate
    (tls_accept.py), or a request on it carried a client API key (stream_guard.py says so from its headers)."""

    peer: str
    stream: object
    trusted: bool = False


class Admission:
    """The connections one server holds, by peer address. At a limit, a new connection takes the place of the
    oldest one on which no request has carried a credential (idle ones first among them: a connection is trusted
    only once a request on it has), rather than be refused: a flood of idle or trickling connections, with no
    credential, can no longer hold the cap against the cluster's members and keyed clients (round 3's finding 3;
    gossip's own connections among them). Only where every connection in the way is trusted is one refused."""

    def __init__(self, limits: ConnectionLimits = ConnectionLimits()):
        self.limits = limits
        self.by_peer: collections.Counter[str] = collections.Counter()
        self.refused = self.evicted = 0
        self.failures: collections.Counter[str] = collections.Counter()  # connections ended by an exception, by class
        self.open: dict[tuple, _Open] = {}  # by connection (host, port), oldest first

    def admit(self, peer: str, connection: tuple | None, stream) -> tuple[str | None, object | None]:
        """Take a new connection: (None, the stream of an untrusted connection to close for it, or None), or
        (why it is refused, None)."""
        why = refusal(self.limits, self.by_peer[peer], sum(self.by_peer.values()))
        victim = None if why is None else self._untrusted(peer if self.by_peer[peer] >= self.limits.per_peer
                                                          else None)
        if why is not None and victim is None:
            self.refused += 1
            return why, None
        closing = None
        if victim is not None:
            self.evicted += 1
            closing = self.open[victim].stream
            self.close(victim)
        self.by_peer[peer] += 1
        if connection is not None:
            self.open[connection] = _Open(peer, stream)
        return None, closing

    def _untrusted(self, peer: str | None) -> tuple | None:
        """The oldest connection no credential has come on (of `peer`, where given), or None."""
        return next((c for c, o in self.open.items() if not o.trusted and peer in (None, o.peer)), None)

    def trust(self, connection: tuple | None) -> None:
        if (held := self.open.get(connection)) is not None:
            held.trusted = True

    def close(self, connection: tuple | None, peer: str | None = None) -> None:
        """A connection ends, or is closed for a newcomer: its count given back, once (one with no key, a TLS
        stream's, by its peer)."""
        if connection is None:
            if peer is not None:
                self._release(peer)
        elif (held := self.open.pop(connection, None)) is not None:
            self._release(held.peer)

    def _release(self, peer: str) -> None:
        self.by_peer[peer] -= 1
        if not self.by_peer[peer]:
            del self.by_peer[peer]


class _GuardedTCPServer(TCPServer):
    async def run(self) -> None:
        admission: Admission | None = getattr(self.config, "pp_admission", None)
        if admission is None:
            return await super().run()
        peer, connection = _peer(self.stream), _connection(self.stream)
        why, victim = admission.admit(peer, connection, self.stream)
        if why is not None:
            if admission.refused in (1, 10, 100) or admission.refused % 1000 == 0:  # a flood logs a few lines
                log.warning("refusing a connection from %s: %s (%d refused so far)", peer, why, admission.refused)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()
            return
        if victim is not None:  # its own task sees its socket closed and ends; its count is given back already
            if admission.evicted in (1, 10, 100) or admission.evicted % 1000 == 0:
                log.warning("closed an untrusted connection for one from %s (%d so far)", peer, admission.evicted)
            await trio.aclose_forcefully(victim)
        tls: ServerTls | None = getattr(self.config, "pp_tls", None)
        try:
            if not (first := await _first_byte(self.stream, self.config.keep_alive_timeout)):
                await trio.aclose_forcefully(self.stream)
                return
            if tls is not None:
                stream, member = await tls_accept.accept(self.stream, tls, peer, first)
                if stream is None:
                    return
                self.stream = stream
                if member is not None and connection is not None:
                    tls.members[connection] = member
                    admission.trust(connection)
            await contained(super().run(), self.stream, peer, admission)
        finally:
            if tls is not None and connection is not None:
                tls.members.pop(connection, None)
            admission.close(connection, peer)
            streams = getattr(self.config, "pp_streams", None)
            if streams is not None and connection is not None:  # however the connection ended: an exception
                streams.release_connection(connection)             # contained above skips hypercorn's closing

    async def _read_data(self) -> None:
        # hypercorn leaves a connection's keep-alive timer running once the peer has closed it, so the
        # connection (and its count here) outlived the peer by up to keep_alive_timeout: after a flood of
        # 256 closed connections, the peer's next one was refused for seconds. Closed is closed.
        await super()._read_data()
        await self.idle_task.stop()


FAILURES_LOGGED = 100  # a fuzzer's flood logs a few lines, then one in a thousand


async def contained(run, stream, peer: str, admission: Admission) -> None:
    """Await one connection's handling; an exception that escapes it closes this connection alone."""
    try:
        await run
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is this connection's, not the server's
        what = _described(exc)
        admission.failures[what] += 1
        total = sum(admission.failures.values())
        if total <= FAILURES_LOGGED or total % 1000 == 0:
            log.warning("closed a connection from %s on %s: %s", peer, what, _message(exc)[:200])
        await trio.aclose_forcefully(stream)  # a TLS stream's close_notify must not wait on a peer that reads nothing


def _described(exc: BaseException) -> str:
    """The class of what ended a connection; for a group, the classes inside it."""
    if isinstance(exc, BaseExceptionGroup):
        return "+".join(sorted({_described(inner) for inner in exc.exceptions}))
    return type(exc).__name__


def _message(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return str(exc)


async def _first_byte(stream, timeout_s: float) -> bytes:
    """Wait for a connection's first byte, leaving it to be read (node/transport/tls_accept.py reads what it
    says): b"" if the peer closes it first or sends nothing for `timeout_s` (hypercorn's own idle timeout for a
    connection with no request). Until then a connection costs a parked task, not hypercorn's protocol state: set
    up, a burst of 256 idle ones held the event loop ~200 ms, and /health with it."""
    with trio.move_on_after(timeout_s):
        try:
            return await stream.socket.recv(1, socket.MSG_PEEK)
        except (OSError, trio.ClosedResourceError):  # reset by the peer, or closed here for a newcomer (Admission)
            return b""
    return b""


def _connection(stream) -> tuple | None:
    """The peer's (host, port), as hypercorn's protocol names the connection (node/transport/stream_guard.py counts
    its streams under it); taken while the socket is open."""
    try:
        return parse_socket_addr(stream.socket.family, stream.socket.getpeername())
    except (AttributeError, OSError):  # a TLS stream, or a peer already gone
        return None


def _peer(stream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except (AttributeError, OSError):  # a TLS stream, or a peer already gone
        return "?"


def install(config, limits: ConnectionLimits = ConnectionLimits()) -> Admission:
    """Limit the connections of servers started with this hypercorn `config`."""
    hypercorn_run.TCPServer = _GuardedTCPServer  # worker_serve builds its per-connection servers from this name
    config.pp_admission = Admission(limits)
    return config.pp_admission
