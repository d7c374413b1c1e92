"""Adjustments to hypercorn 0.18's HTTP/2: survive data for a stream it already closed; advertise a large
receive window so a prefill activation (128 KiB for 16 tokens at dim 2048) is not held back by HTTP/2's
64 KiB default window, which costs a WINDOW_UPDATE round trip mid-body; stop a client that resets the
streams it opens (HTTP/2 rapid reset) before it ends the server; and stop one that floods control frames
before it stalls the event loop.

Control-frame floods (CVE-2019-9512 ping, 9515 settings, 9518 empty frames; also PRIORITY, unknown frame
types and unearned WINDOW_UPDATEs):

Frames that carry no request still cost: h2 parses each (~40 us on a loaded core) and hypercorn answers a
PING or SETTINGS with an ACK, all on the event loop. PING or SETTINGS at ~190k/s from 8 connections, no
token needed, stalled /health 2.4 s and got stage 0 declared dead. Go's net/http bounds the ACKs it has
queued, nghttp2 likewise, Apache Traffic Server counts SETTINGS, PING and PRIORITY frames per minute;
here each received chunk is counted before h2 parses it (node/transport/h2_budget.py: one token bucket
for all these kinds, from the frame headers alone, 2 KiB of the chunk at a time), and a connection past its budget
gets GOAWAY ENHANCE_YOUR_CALM and is closed with the rest of the chunk unparsed: a flooder costs about a
slice's count, and one that reconnects is calmed again within its first chunk. The limit (h2_budget.BUDGET):
100 such frames at once, then 10/s, all kinds together, beyond those the connection's own traffic explains:
each DATA frame the server sends earns 2 WINDOW_UPDATEs (or PRIORITY, or PINGs) and each stream the client
opens 2 (httpx opens each stream's window so), banked up to 4,096. A client reading a long streamed answer,
a peer's link stream for hours, or 100 requests sent at once is never calmed.
Calmed connections are counted in `CALMED` and logged sparsely (a reconnecting flooder is not a log flood).

Rapid reset (CVE-2023-44487):

A client opens a stream and resets it at once, over and over. h2 counts a reset stream as closed, so
SETTINGS_MAX_CONCURRENT_STREAMS does not bound them, but hypercorn keeps each in its send-priority tree
until its response is out; a client that never grants flow-control credit keeps them there, and the
1001st stream raised `priority.TooManyStreamsError` out of hypercorn's connection handler, which under
trio ended the whole server (a node exited ~10 s after 100k open+reset pairs, no token needed). Upstream
hypercorn has no reset budget (pgjones/hypercorn#146 answered rapid reset with keep_alive_max_requests,
which pp must raise for its long-lived links). Here, as Go's net/http and nginx do: once a connection has
reset more than half of the streams it opened, past a floor, it gets GOAWAY ENHANCE_YOUR_CALM and is
closed (`too_many_resets`); and a full priority tree closes that connection the same way rather than the
server. pp's own peers reset a stream only when a request of theirs is cancelled (a gossip ping that
timed out), far below that share.

Closed streams:

When the app answers before the request body is in (a 401 or 413 refuses a large body early), the
client's remaining DATA frames reach hypercorn's `self.streams[stream_id]` after the stream was
dropped: KeyError. Under trio that error leaves the connection handler and ends the whole server,
so one oversized POST would take a node down. Upstream: pgjones/hypercorn#334 (open). Until it
lands, a closed stream's leftovers go to a sink; hypercorn still acknowledges their flow control.
"""
from __future__ import annotations

import collections
import logging
import time

import attrs
import h2.errors
import h2.events
import h2.settings
import priority
from hypercorn.events import Closed, RawData
from hypercorn.protocol import h2 as hypercorn_h2

from node.transport.h2_budget import ControlBudget, FrameScan

RECEIVE_WINDOW = 1 << 24  # per stream and per connection; bodies are bounded by PP_MAX_BODY anyway
RESET_FLOOR = 100  # resets a connection may make before its share of resets is judged
SLICE_BYTES = 2048  # a received chunk is counted and charged this much at a time: ~120 PINGs, not ~3,800
CALMED: collections.Counter[str] = collections.Counter()  # connections calmed in this process, by what they did

log = logging.getLogger("pp.hypercorn")


def too_many_resets(opened: int, reset: int) -> bool:
    """Whether a connection that opened `opened` streams, of which the client reset `reset`, is abusing
    resets: past the floor, more than half of what it opened."""
    return reset > RESET_FLOOR and 2 * reset > opened


@attrs.define
class _Tally:
    opened: int = 0
    reset: int = 0

    def count(self, events) -> None:
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                self.opened += 1
            elif isinstance(event, h2.events.StreamReset) and event.remote_reset:
                self.reset += 1


class _Calm(Exception):
    """Raised inside the protocol to leave a batch of events whose connection is being closed."""

    def __init__(self, why: str, what: str):
        super().__init__(why)
        self.what = what


class _ClosedStream:
    async def handle(self, event) -> None:
        pass


_SINK = _ClosedStream()


class _Streams(dict):
    def __missing__(self, stream_id):
        return _SINK


def install() -> None:
    protocol = hypercorn_h2.H2Protocol
    if getattr(protocol, "_pp_adjusted", False):
        return
    original_init, original_initiate, original_handle = protocol.__init__, protocol.initiate, protocol.handle
    original_events, original_create = protocol._handle_events, protocol._create_stream

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.streams = _Streams(self.streams)
        self._pp_tally = _Tally()
        self._pp_budget, self._pp_received = ControlBudget(time.monotonic()), FrameScan(preface=True)
        self._pp_calmed = False
        self.send = _earning(self.send, self._pp_budget)
        settings = dict(self.connection.local_settings.items())  # what hypercorn chose, plus h2's defaults
        settings[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE] = RECEIVE_WINDOW
        self.connection.local_settings = h2.settings.Settings(client=False, initial_values=settings)

    async def initiate(self, *args, **kwargs):
        await original_initiate(self, *args, **kwargs)
        # the connection-wide window is not a setting: open it with one WINDOW_UPDATE
        self.connection.increment_flow_control_window(RECEIVE_WINDOW - 65535)
        await self._flush()

    async def handle(self, event):
        if isinstance(event, RawData):
            if self._pp_calmed:  # what was on its way before our GOAWAY: nothing of it is parsed
                return
            why = _over_budget(self._pp_received, self._pp_budget, event.data)
            if why is not None:
                return await _close_calmly(self, why, "control frames")
        await original_handle(self, event)

    async def _handle_events(self, events):
        self._pp_tally.count(events)
        try:
            if too_many_resets(self._pp_tally.opened, self._pp_tally.reset):
                raise _Calm(f"{self._pp_tally.reset} of {self._pp_tally.opened} streams reset by the client", "resets")
            await original_events(self, events)
        except _Calm as why:
            await _close_calmly(self, str(why), why.what)

    async def _create_stream(self, request):
        try:
            await original_create(self, request)
        except priority.TooManyStreamsError:
            raise _Calm("more streams waiting to send than hypercorn's priority tree holds", "streams") from None

    protocol.__init__, protocol.initiate, protocol.handle = __init__, initiate, handle
    protocol._handle_events, protocol._create_stream = _handle_events, _create_stream
    protocol._pp_adjusted = True


def _over_budget(scan: FrameScan, budget: ControlBudget, data: bytes) -> str | None:
    """Count a received chunk's frames a slice at a time against the connection's budget, before h2 parses
    any of them; why it is past the budget, or None. A flood is caught within its first slice."""
    now = time.monotonic()
    for start in range(0, len(data), SLICE_BYTES):
        why = budget.charge(scan.feed(data[start:start + SLICE_BYTES]), now)
        if why is not None:
            return why
    return None


def _earning(send, budget: ControlBudget):
    """`send`, counting the DATA frames the server sends: each earns the client WINDOW_UPDATEs to grant."""
    scan = FrameScan(preface=False)

    async def send_counted(event):
        if isinstance(event, RawData):
            budget.earn(scan.feed(event.data))
        await send(event)
    return send_counted


async def _close_calmly(protocol, why: str, what: str) -> None:
    """GOAWAY ENHANCE_YOUR_CALM, then the connection closes; the server and its other connections go on."""
    protocol._pp_calmed = True
    CALMED[what] += 1
    calmed = sum(CALMED.values())
    if calmed <= 10 or calmed % 1000 == 0:  # a flooder that reconnects logs a few lines, not one per connection
        log.warning("closing an HTTP/2 connection from %s: %s (%d calmed so far)", protocol.client, why, calmed)
    if not protocol.closed:
        protocol.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        await protocol._flush()
        await protocol.send(Closed())
