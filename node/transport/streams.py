"""Link streams: the pipeline's messages from a stage to its next (and from the last stage back to stage 0)
as frames of one long-lived HTTP/2 request body (`POST /v1/link`), read by the receiver as they arrive.

Why: a POST per message costs the sender a round trip it waits out and the receiver a request to
parse; on a stream a message is one length-prefixed frame (node/transport/frames.py) and nobody waits for an
answer. HTTP/2's flow control is the backpressure. The per-message POST endpoints stay, for anything
that is not a stage (the runner, askers) and as the fallback a node can be told to use.

Losing a stream. httpx sends a whole request body before it reads the answer, so the receiver cannot
acknowledge frames; instead every frame of a link carries a sequence number, the receiver remembers the
last one it delivered per link, and a sender whose stream broke asks for it (`GET /v1/link/<id>`)
before it opens the next one and resends what did not arrive. Frames already written are kept in a
bounded window for that. If the receiver has taken nothing of the link yet, the kept frames of requests
still live are resent. If the receiver restarted (the boot id it answers with changed), the kept frames
are lost: the stages after it still hold those requests' beginnings, so a resent start would arrive
there twice (and a refused batch fails every request in it); their requests fail, naming it. So do they
when the window no longer reaches back far enough. A receiver that refuses a frame reports the failure
of its requests to stage 0 itself, since nobody reads its answer (node/stage_links.py, LinkEnds.refused).

A stream the receiver ends early (a malformed frame, a handler that failed) is reset by its HTTP/2 layer
(node/transport/h2_early_answer.py); the sender sees the reset at its next write once its connection has
read it, which a probe of the link's state each second makes sure of, and reopens: the frames after the
last one the receiver delivered are resent. A receiver reads at most MAX_INBOUND_LINKS streams at once.
"""
from __future__ import annotations

import collections
import logging
import secrets
from typing import Awaitable, Callable, Protocol

import httpx
import trio

from node.groups import unwrapped
from node.observe import hops
from node.transport import frames
from node.transport.client import SEND_ATTEMPTS, Backoff, PeerError
from node.transport.faults import NONE as NO_FAULTS, Faults

log = logging.getLogger("pp.streams")

RETAIN_FRAMES = 256  # frames kept for a resend after a break: far more than can be in flight
RETAIN_BYTES = 64 << 20
KNOWN_LINKS = 64  # links a receiver remembers the last frame of
MAX_INBOUND_LINKS = 32  # link streams a receiver reads at once; a stage's own peers open one each
HEARTBEAT_AFTER_S = 0.25  # after a frame, if nothing follows: soon enough to resend it, rare enough to cost nothing
HEARTBEAT_IDLE_S = 1.0
PROBE_S = 1.0  # how soon a sender learns that its stream was reset: ~ a heartbeat's rhythm, one GET a second
PROBE_TIMEOUT_S = 2.0  # the longest a probe holds up a link that is reopening
REFUSED_AFTER = 3  # opens in a row, the peer reached each time, that found the same first frame not taken


class LinkLost(Exception):
    """The peer lost frames of this link (it restarted, or the break outlasted the resend window)."""


class Outbox(Protocol):
    """What a link sends: the messages waiting for one destination, in order (node/transport/links.py)."""

    async def next_batch(self) -> list: ...  # wait for messages; take them all, merged where they can be

    def drain(self) -> list: ...  # take what waits now, without waiting

    async def wait(self) -> None: ...  # until something waits


class LinkStream:
    """The sending end of one link; `run(outbox)` sends the outbox's messages until cancelled."""

    def __init__(self, dest: str, *, source: str, resolve: Callable[[str], str | None], client: httpx.AsyncClient,
                 on_lost: Callable[[list, str], None], stats: hops.HopStats,
                 still_live: Callable[[object], object | None] = lambda message: message, faults: Faults = NO_FAULTS,
                 moved: Callable[[str, str], Awaitable[None]] | None = None,
                 on_refused: Callable[[object, str], None] | None = None):
        self.dest, self.source, self._resolve, self._client = dest, source, resolve, client
        # A message part the peer would refuse (too large) or refuses (resent, never taken): resending or
        # replaying it would fail the same way, so its requests fail (on_refused); without one, as if lost.
        self._on_refused = on_refused
        self.faults, self._moved = faults, moved
        self._on_lost, self._stats, self._still_live = on_lost, stats, still_live
        self.link_id = secrets.token_hex(8)
        self._peer_boot: str | None = None  # the receiver's boot id when this link last reached it
        self._seq = 0
        self._kept: collections.deque[tuple[int, object, int]] = collections.deque()  # (seq, message, bytes)
        self._kept_bytes = 0
        self._head, self._head_tries = None, 0  # the first frame resent at the last opens, and how often
        self._refused: set[int] = set()  # frames dropped as refused, after the peer's last taken one
        self.opened = 0  # streams opened so far (for /health and tests)

    async def run(self, outbox: Outbox) -> None:
        backoff = Backoff()
        while True:
            if not self._kept:
                await outbox.wait()  # nothing to send: no stream to keep open, no peer to chase
            try:
                addr = self._addr()
                resend = await self._resume(addr)
                backoff.reset()
                await self._stream_while_there(addr, resend, outbox)
            except LinkLost as exc:  # the peer is reachable: only what it lost fails, the rest goes on
                log.warning("link to %s lost frames (%s)", self.dest, exc)
                self._lose(self._take_kept(), str(exc))
                backoff.reset()
            except PeerError as exc:
                wait = backoff.failed()
                log.warning("link to %s broke (%s); attempt %d of %d", self.dest, exc, backoff.failures, SEND_ATTEMPTS)
                if wait is None:  # what waits now fails too; the next message tries anew
                    self._lose(self._take_kept(), str(exc))
                    self._lose(outbox.drain(), str(exc))
                    backoff.reset()
                    continue
                await trio.sleep(wait)

    def _addr(self) -> str:
        addr = self._resolve(self.dest)
        if addr is None:
            raise PeerError(self.dest, "no alive member holds this name")
        return addr

    async def _resume(self, addr: str) -> list[tuple[int, object]]:
        """Before a stream opens, ask the peer what it last took of this link (it may also refuse: still
        loading): the kept frames it has not seen go first. Asked on every open, since a refusal at the
        stream itself would never be read (httpx reads the answer only once the body is over)."""
        try:
            r = await self._client.get(f"{addr}/v1/link/{self.link_id}")
        except httpx.HTTPError as exc:
            raise PeerError(addr, f"{type(exc).__name__}: {exc}") from None
        if r.status_code >= 400:
            raise PeerError(addr, f"HTTP {r.status_code} asking for the link's last frame: {r.text[:200]}",
                            r.status_code)
        state = r.json()
        last, restarted = state["last_seq"], self._peer_boot not in (None, state["boot"])
        self._peer_boot = state["boot"]
        if restarted and self._kept:
            raise LinkLost(f"{self.dest} restarted: what it held of this link's requests is gone")
        if last is None:  # nothing of this link reached the peer yet (or it forgot the link, refusing a frame)
            self._keep_live_only()
            self._drop_refused()
            return [(seq, message) for seq, message, _ in self._kept]
        while self._kept and self._kept[0][0] <= last:
            self._drop_oldest()
        self._refused = {seq for seq in self._refused if seq > last}
        if self._kept and any(seq not in self._refused for seq in range(last + 1, self._kept[0][0])):
            raise LinkLost(f"{self.dest} last took frame {last}; the oldest kept is {self._kept[0][0]}")
        self._drop_refused()
        return [(seq, message) for seq, message, _ in self._kept]

    def _drop_refused(self) -> None:
        """The peer was reached, but the frame it was sent first has not been taken, REFUSED_AFTER opens in a
        row: it refuses that frame (a header over its limit, a malformed body), and would refuse it again
        each time. Only that frame's requests fail; the frames after it go on. (The receiver keeps the link's last
        delivered frame through a refusal, so the head is the refused frame itself.)"""
        head = self._kept[0][0] if self._kept else None
        self._head_tries = self._head_tries + 1 if head is not None and head == self._head else 0
        self._head = head
        if self._head_tries >= REFUSED_AFTER:
            seq, message, _ = self._kept[0]
            self._drop_oldest()
            self._head, self._head_tries = None, 0
            self._refused.add(seq)  # a gap the peer's last frame may stay behind
            self._refuse(message, f"frame {seq} was resent {REFUSED_AFTER} times and never taken: the peer refuses it")

    async def _stream_while_there(self, addr: str, resend: list, outbox: Outbox) -> None:
        """Stream to `addr` until it breaks, or until gossip says `addr` no longer holds the destination
        (declared dead, replaced): a frozen peer breaks nothing — writes just stop being taken. Meanwhile
        the peer is probed, so that a reset of the stream is seen (_probe)."""
        with unwrapped(PeerError):
            async with trio.open_nursery() as nursery:
                async def watch() -> None:
                    await self._moved(self.dest, addr)
                    nursery.cancel_scope.cancel()
                if self._moved is not None:
                    nursery.start_soon(watch)
                nursery.start_soon(self._probe, addr)
                await self._stream(addr, resend, outbox)
        raise PeerError(addr, f"{addr} no longer holds {self.dest}")

    async def _probe(self, addr: str) -> None:
        """Ask the peer for this link's state now and then, on the stream's connection. A receiver that ends
        the stream early (a frame it could not take) resets it (node/transport/h2_early_answer.py), but httpcore
        reads a connection only for a request that waits on it, and the stream's own request reads nothing
        until its body is over: a reset would lie unread while frames went into a stream nobody reads. The
        probe's read takes the reset in, and the stream's next write fails. Its answer is not needed.
        A probe in flight is not cancelled, only bounded: httpcore's HTTP/2 can lose count of a connection's
        streams when a request is cancelled mid-flight (see node/transport/client.py's gossip_client)."""
        while True:
            await trio.sleep(PROBE_S)
            with trio.CancelScope(shield=True):
                try:
                    await self._client.get(f"{addr}/v1/link/{self.link_id}", timeout=PROBE_TIMEOUT_S)
                except httpx.HTTPError:
                    pass  # the stream finds out for itself

    async def _stream(self, addr: str, resend: list, outbox: Outbox) -> None:
        url = f"{addr}/v1/link?link={self.link_id}&from={self.source}"
        # Transfer-Encoding tells httpcore there is a body (it drops the header itself on HTTP/2)
        request = self._client.build_request("POST", url, headers={
            "Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"})
        request.stream = _Body(self, resend, outbox)
        self.opened += 1
        try:
            r = await self._client.send(request)
        except httpx.HTTPError as exc:
            raise PeerError(addr, f"link stream: {type(exc).__name__}: {exc}") from None
        raise PeerError(addr, f"link stream ended by the peer: HTTP {r.status_code} {r.text[:200]}", r.status_code)

    def frame(self, message) -> bytes:
        """The message as the link's next frames, each kept for a resend until the peer is known to have it.
        Cut to fit frames.frame_limit, which the receiver holds them to; a request's part too large for
        any frame is not sent: that request alone fails (on_refused), the others of the message go on."""
        started = hops.now()
        fitted, too_large = frames.bodies(message)
        data = []
        for body in fitted:
            self._seq += 1
            data.append(body.frame(self._seq, started))
            self._keep(self._seq, body.message, len(data[-1]))
        self._stats.record(f"to {self.dest}", "encode", hops.now() - started)
        for part in too_large:
            self._refuse(part.message, part.error)
        return b"".join(data)

    def _refuse(self, message, error: str) -> None:
        log.warning("link to %s: %s", self.dest, error)
        if self._on_refused is None:
            self._lose([message], error)
        else:
            self._on_refused(message, f"link to {self.dest}: {error}")

    def _keep(self, seq: int, message, size: int) -> None:
        self._kept.append((seq, message, size))
        self._kept_bytes += size
        while len(self._kept) > RETAIN_FRAMES or self._kept_bytes > RETAIN_BYTES:
            self._drop_oldest()

    def _keep_live_only(self) -> None:
        """For a peer that has taken nothing of the link: the kept frames' rows of requests still live here;
        rows and ends of requests that ended here meanwhile must not reach it (they would start them again)."""
        kept = [(seq, self._still_live(message)) for seq, message, _ in self._kept]
        self._kept.clear()
        self._kept_bytes = 0
        for seq, message in kept:
            if message is not None:
                self._keep(seq, message, len(frames.encode(message, seq, 0.0)))

    def _drop_oldest(self) -> None:
        self._kept_bytes -= self._kept.popleft()[2]

    def _take_kept(self) -> list:
        lost = [message for _, message, _ in self._kept]
        self._kept.clear()
        self._kept_bytes = 0
        return lost

    def _lose(self, messages: list, error: str) -> None:
        if messages:
            self._on_lost(messages, f"link to {self.dest}: {error}")


class _Body(httpx.AsyncByteStream):
    """A link's request body: what must be resent, then each batch of the outbox as one chunk of frames.

    A class rather than an async generator: when the connection breaks, httpx leaves the body where it
    stopped, and an abandoned generator would only be finalized by the garbage collector."""

    def __init__(self, link: LinkStream, resend: list, outbox: Outbox):
        self._link, self._outbox = link, outbox
        self._resend = collections.deque(frames.encode(message, seq, hops.now()) for seq, message in resend)
        self._idle_s = HEARTBEAT_AFTER_S

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if self._resend:
            return self._resend.popleft()
        batch = []
        with trio.move_on_after(self._idle_s):
            batch = await self._outbox.next_batch()
        if not batch:
            # A write into a connection the peer dropped succeeds once (the kernel takes it); the next
            # one fails. So soon after a frame, and now and then while idle, a heartbeat finds out, and
            # the frame is resent on a new stream rather than lost in silence.
            self._idle_s = HEARTBEAT_IDLE_S
            return frames.heartbeat(hops.now())
        self._idle_s = HEARTBEAT_AFTER_S
        data = b"".join(self._link.frame(message) for message in batch)  # kept for a resend from here on
        if self._link.faults.active and await self._link.faults.before_send():
            raise httpx.WriteError("dropped by fault injection (PP_FAULTS)")  # as a connection that broke
        return data


class LinkReceiver:
    """The receiving end's memory: the last frame delivered per link, so a resent frame is taken once."""

    def __init__(self, known: int = KNOWN_LINKS, max_streams: int = MAX_INBOUND_LINKS):
        self.boot = secrets.token_hex(8)  # changes when the process does: senders learn it restarted
        self._last: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._known, self.max_streams = known, max_streams
        self.streams = 0  # link streams being read now

    def open_refusal(self) -> str | None:
        """Why one more link stream may not be read now (None: it may): inbound_link_refusal's."""
        return inbound_link_refusal(self.streams, self.max_streams)

    def last_seq(self, link_id: str) -> int | None:
        return self._last.get(link_id)

    def fresh(self, link_id: str, seq: int) -> bool:
        """Whether frame `seq` of the link is new (deliver it), or a resend of one already delivered."""
        last = self._last.get(link_id)
        return last is None or seq > last

    def delivered(self, link_id: str, seq: int) -> None:
        self._last[link_id] = seq
        self._last.move_to_end(link_id)
        while len(self._last) > self._known:
            self._last.popitem(last=False)


def inbound_link_refusal(reading: int, limit: int) -> str | None:
    """Why a receiver reading `reading` link streams refuses one more (None: it takes it). Each stream holds
    a frame reader's buffer (up to a frame's limit) and a task: their number is bounded, whoever opens them."""
    if reading < limit:
        return None
    return f"this stage already reads {reading} link streams, the most it takes ({limit}); retry later"
