"""Streamed answers honour flow control, and a stalled one ends (issue 33).

Over HTTP/2, hypercorn 0.18 keeps each stream's unsent answer in a StreamBuffer that the connection's send
task drains as the client's flow-control window allows. Its `push` waits once 32 KiB are buffered, but the
send task releases that wait on each of its passes, whether it sent anything or not: with a zero window a
pass sends nothing and releases the writer all the same, so an app streaming to a client that never reads
buffered the whole answer (the audit: 3.7 MB for 16 streams). Here a stream's send returns only once the
stream holds at most STREAM_BUFFER bytes unsent (one default window), so the app's task waits rather than
buffering; and a send that sees none of its stream's bytes leave for SEND_STALL_S ends the stream: the
client gets RST_STREAM CANCEL and the app http.disconnect, which cancels the request and frees its slots
(node/api/openai_api.py).

Under both HTTP versions hypercorn writes to the socket shielded and without a time limit, so a client that
stopped reading its socket held the writing task forever: over HTTP/1.1 the app's own (and its slot), over
HTTP/2 the connection's send task. Here each write of at most WRITE_PIECE bytes has SEND_STALL_S to go out;
past that the connection is closed, and its apps see http.disconnect.

Both wrap what is installed when `install` runs, so other adjustments of the same methods compose.
"""
from __future__ import annotations

import contextlib
import logging

import h2.errors
import h2.exceptions
import priority
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol import h2 as hypercorn_h2
from hypercorn.protocol.events import StreamClosed
from hypercorn.trio import tcp_server

STREAM_BUFFER = 1 << 16  # unsent bytes a stream may hold before its app's send waits (HTTP/2's default window)
SEND_STALL_S = 30.0  # how long a send may wait with no byte of it leaving before the stream (or connection) ends
GUEST_STALL_S = 5.0  # the same for a stream of a request with no credential (stream_guard.py sets it): /health and
# the chat page are answered in milliseconds, and a guest's zero-window stream held its place for 30 s (issue 54)
WRITE_PIECE = 1 << 16  # a socket write is timed a piece at a time: a slow reader that reads is not a stalled one

log = logging.getLogger("pp.hypercorn")


class Stalled(Exception):
    """None of a stream's unsent bytes left for SEND_STALL_S."""


class BoundedStreamBuffer(hypercorn_h2.StreamBuffer):
    """A stream's unsent answer: a push waits until at most STREAM_BUFFER bytes are left unsent, a drain until
    none are; either raises Stalled once no byte has left for SEND_STALL_S."""

    def __init__(self, event_class) -> None:
        super().__init__(event_class)
        self._moved = trio.Event()  # set (and replaced) whenever bytes leave, or the buffer is closed
        self.stall_s = SEND_STALL_S  # a guest's is GUEST_STALL_S (stream_guard.py)

    async def push(self, data: bytes) -> None:
        if self._complete:
            raise hypercorn_h2.BufferCompleteError()
        self.buffer.extend(data)
        await self._is_empty.clear()
        await self._until(lambda: len(self.buffer) <= STREAM_BUFFER)

    async def drain(self) -> None:
        await self._until(lambda: not self.buffer)
        await super().drain()

    async def pop(self, max_length: int) -> bytes:
        data = await super().pop(max_length)
        if data:
            self._wake()
        return data

    async def close(self) -> None:
        await super().close()
        self._wake()

    def _wake(self) -> None:
        self._moved.set()
        self._moved = trio.Event()

    async def _until(self, done) -> None:
        while not done():
            moved = self._moved
            with trio.move_on_after(self.stall_s) as waiting:
                await moved.wait()
            if waiting.cancelled_caught:
                raise Stalled(f"{len(self.buffer)} bytes unsent and none sent for {self.stall_s:g} s")


async def _end_stalled_stream(protocol, stream_id: int, why: Stalled, send) -> None:
    """Reset a stalled stream: the client gets RST_STREAM CANCEL, the app http.disconnect; its buffer is emptied
    and the send task forgets it (h2 now calls the stream closed). Shielded: the disconnect cancels the app's task,
    this one, which must not stop half way with the reset unsent (the flush is bounded by the write timeout)."""
    log.warning("reset stream %d of %s: its answer stalled (%s)", stream_id, protocol.client, why)
    with trio.CancelScope(shield=True):
        buffer = protocol.stream_buffers.get(stream_id)
        if buffer is not None:
            await buffer.close()
        try:
            protocol.connection.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.CANCEL)
            protocol.priority.unblock(stream_id)  # the send task's next pass meets the closed stream and drops it
        except (h2.exceptions.ProtocolError, priority.MissingStreamError):
            pass  # already closed, or never in the tree
        await protocol._flush()
        await send(protocol, StreamClosed(stream_id=stream_id))  # http.disconnect to the app, the idle timer


def hurry_guest(protocol, stream_id: int) -> None:
    """A stream of a request with no credential: its answer ends after GUEST_STALL_S without progress."""
    buffer = protocol.stream_buffers.get(stream_id)
    if isinstance(buffer, BoundedStreamBuffer):
        buffer.stall_s = min(buffer.stall_s, GUEST_STALL_S)


def write_pieces(data: bytes, piece: int = WRITE_PIECE) -> list[memoryview]:
    """`data` cut into the pieces a socket write times one at a time."""
    view = memoryview(data)
    return [view[i:i + piece] for i in range(0, len(view), piece)] or [view]


class Writes:
    """The socket writes in flight on one server's connections. Each is shielded from its own task's cancellation, as
    hypercorn's is (half a frame would break a connection that goes on), but a stopping server cuts them all: a
    node being stopped waited up to SEND_STALL_S on a peer that read nothing."""

    def __init__(self):
        self.stopped = False
        self._scopes: set[trio.CancelScope] = set()

    @contextlib.contextmanager
    def shielded(self, seconds: float):
        with trio.CancelScope(shield=True, deadline=trio.current_time() + seconds) as scope:
            if self.stopped:
                scope.cancel()
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)

    def stop(self) -> None:
        self.stopped = True
        for scope in list(self._scopes):
            scope.cancel()


async def cut_writes_when_stopped(writes: Writes, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run beside a server (node/transport/app.py's serve_app): once its nursery is cancelled, cut its writes."""
    task_status.started()
    try:
        await trio.sleep_forever()
    finally:
        writes.stop()


async def _timed_send_all(server, data: bytes) -> None:
    """hypercorn's socket write, each piece with SEND_STALL_S to go out; past that, the connection ends."""
    writes = getattr(server.config, "pp_writes", None) or Writes()
    async with server.send_lock:
        try:
            for piece in write_pieces(data):
                with writes.shielded(SEND_STALL_S) as scope:  # not forever, and not past the server's stop
                    await server.stream.send_all(piece)
                if scope.cancelled_caught:
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            # Busy: hypercorn's close is half way through its send_eof, outside the lock; the connection is closing
            await server.protocol.handle(Closed())
            return
    if scope.cancelled_caught:
        if not writes.stopped:
            log.warning("closing a connection from %s: a write stalled for %g s", _peer(server), SEND_STALL_S)
        # Closing the socket ends the connection's reader (and so its run); Closed tells each app http.disconnect.
        # Not a cancel of the connection's task group: hypercorn's TaskGroup re-raises its body's Cancelled, which
        # would then end the server's listener nursery.
        await trio.aclose_forcefully(server.stream)  # over TLS, a close_notify would stall as the write did
        await server.protocol.handle(Closed())


def _peer(server) -> str:
    try:
        return str(getattr(server.stream, "transport_stream", server.stream).socket.getpeername()[0])
    except (AttributeError, OSError):
        return "?"


def install() -> None:
    """Bound HTTP/2 streams' buffers and time every socket write of hypercorn's servers (idempotent)."""
    protocol, server = hypercorn_h2.H2Protocol, tcp_server.TCPServer
    if getattr(protocol, "_pp_flow", False):
        return
    original_stream_send, original_protocol_send = protocol.stream_send, server.protocol_send

    async def stream_send(self, event) -> None:
        try:
            await original_stream_send(self, event)
        except Stalled as why:
            await _end_stalled_stream(self, event.stream_id, why, original_stream_send)

    async def protocol_send(self, event) -> None:
        if isinstance(event, RawData):
            await _timed_send_all(self, event.data)
        else:
            await original_protocol_send(self, event)

    hypercorn_h2.StreamBuffer = BoundedStreamBuffer  # H2Protocol._create_stream builds each stream's from this name
    protocol.stream_send, server.protocol_send = stream_send, protocol_send
    protocol._pp_flow = True
