"""The budget of control frames one HTTP/2 client may send on a connection, decided from the bytes alone.

Frames that carry no request cost the server all the same: h2 parses each, and hypercorn answers a PING or a
SETTINGS with an ACK of its own, all on the event loop. At ~190k frames/s from 8 connections that stalled
/health 2.4 s and got a stage declared dead (CVE-2019-9512 ping flood, 9515 settings flood, 9518 empty
frames). So each received chunk is counted here before h2 sees a byte of it: `FrameScan` reads only the
9-byte frame headers (and a padded DATA frame's pad length), and `ControlBudget.charge` says whether the
chunk takes the connection past its budget; if it does, not one frame of the chunk is parsed.

The budget is one token bucket for all these kinds together (`BUDGET`): a burst a connection may send at
once, refilled at a rate, so a flooder is caught within its first chunk (a 64 KiB read holds ~3,800 PINGs)
and a reconnecting one on each new connection, while a client that pings every second for hours never is.

WINDOW_UPDATE (and PRIORITY) are special. A client that reads a long answer grants credit as it goes, at
most one WINDOW_UPDATE for the stream and one for the connection per DATA frame the server sent (h2's own
client sends them per half window read; httpx opens 16 MiB windows and sends few); and httpx opens each new
stream's window with one as it sends the request. So each DATA frame the server sends earns the client
`EARNED_PER_DATA` frames of credit, each stream it opens (a HEADERS frame) `EARNED_PER_STREAM` (its window and
a PRIORITY), spent on WINDOW_UPDATE, then PRIORITY, then PING (gRPC-style clients probe bandwidth with one per
burst of data); only frames beyond the credit draw on the bucket. A streamed answer read for hours, or 100
requests sent at once, is never calmed; a flood of grants nothing explains is. The credit banked is capped
(`EARNED_CAP`) so that a long download does not buy a flood later.

Pure: no I/O, no clock of its own (the caller passes `now`).
"""
from __future__ import annotations

import collections
import enum
import struct

import attrs

PREFACE_BYTES = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", before the client's first frame
_HEADER = struct.Struct(">BHBB")  # length (24 bits: 8 + 16), type, flags; the stream id is not needed
HEADER_BYTES = 9
END_STREAM, PADDED = 0x1, 0x8


class Kind(enum.Enum):
    """What a frame costs against: the control frames, and DATA (which earns credit when the server sends it)."""
    PING = "PING"
    SETTINGS = "SETTINGS"
    PRIORITY = "PRIORITY"  # and RFC 9218's PRIORITY_UPDATE
    EMPTY_DATA = "empty DATA"  # no payload and no END_STREAM
    WINDOW_UPDATE = "WINDOW_UPDATE"
    UNKNOWN = "unknown-type"  # extension frames h2 parses and drops
    DATA = "DATA"  # any DATA frame: not budgeted; each we send earns credit
    HEADERS = "HEADERS"  # not budgeted here (a stream's cost is the reset budget's); each received earns credit

    @classmethod
    def of(cls, kind: int, flags: int, payload: int) -> Kind | None:
        """The kind of a frame from its header (`payload`: its data length less padding; None: not known yet)."""
        if kind == 0:
            return cls.EMPTY_DATA if payload == 0 and not flags & END_STREAM else cls.DATA
        return _BY_TYPE.get(kind, cls.UNKNOWN if kind > 0x9 else None)


_BY_TYPE = {0x1: Kind.HEADERS, 0x2: Kind.PRIORITY, 0x4: Kind.SETTINGS, 0x6: Kind.PING, 0x8: Kind.WINDOW_UPDATE,
            0x10: Kind.PRIORITY}


@attrs.frozen
class Rate:
    burst: int  # frames a connection may send at once
    per_s: float  # and then this many a second


# Control frames nothing explains, all kinds together: a client's SETTINGS and its ACK of ours, a keep-alive
# PING every few seconds, now and then an empty chunk of a streamed body. One bucket, not one per kind, so
# that a flooder cannot mix kinds for six budgets' worth.
BUDGET = Rate(100, 10.0)
BUDGETED = (Kind.PING, Kind.SETTINGS, Kind.PRIORITY, Kind.EMPTY_DATA, Kind.WINDOW_UPDATE, Kind.UNKNOWN)
EARNED_PER_DATA = 2  # the stream's WINDOW_UPDATE and the connection's, for each DATA frame we send
EARNED_PER_STREAM = 2  # the window a client opens for the answer as it sends a request, and its PRIORITY
EARNED_CAP = 4096  # credit a connection may bank: DATA frames still to be acknowledged, not a licence to flood
EARNS = (Kind.WINDOW_UPDATE, Kind.PRIORITY, Kind.PING)  # the kinds credit pays for, in this order


@attrs.frozen
class Bucket:
    tokens: float
    at: float  # when `tokens` was counted


def drawn(bucket: Bucket, rate: Rate, now: float, frames: int) -> Bucket:
    """The bucket after `frames` more at `now`: refilled for the time since, up to the burst, less the frames.
    Negative tokens: over budget."""
    refilled = min(float(rate.burst), bucket.tokens + max(0.0, now - bucket.at) * rate.per_s)
    return Bucket(refilled - frames, now)


def spend_earned(earned: int, counts: collections.Counter) -> tuple[int, collections.Counter]:
    """Pay for WINDOW_UPDATEs, then PRIORITY, then PINGs from credit: (credit left, what still counts)."""
    left = collections.Counter(counts)
    for kind in EARNS:
        paid = min(earned, left[kind])
        earned, left[kind] = earned - paid, left[kind] - paid
    return earned, left


class ControlBudget:
    """One connection's bucket and earned credit; `charge` each received chunk's counts, `earn` each sent one's."""

    def __init__(self, now: float, rate: Rate = BUDGET):
        self.rate, self.bucket, self.earned = rate, Bucket(float(rate.burst), now), 0

    def earn(self, sent: collections.Counter) -> None:
        self.earned = min(EARNED_CAP, self.earned + EARNED_PER_DATA * sent[Kind.DATA])

    def charge(self, received: collections.Counter, now: float) -> str | None:
        """Take a chunk's frames; why the connection is past its budget, or None."""
        self.earned = min(EARNED_CAP, self.earned + EARNED_PER_STREAM * received[Kind.HEADERS])
        self.earned, counts = spend_earned(self.earned, received)
        frames = sum(counts[kind] for kind in BUDGETED)
        if not frames:
            return None
        self.bucket = drawn(self.bucket, self.rate, now, frames)
        if self.bucket.tokens >= 0:
            return None
        what = ", ".join(f"{counts[kind]} {kind.value}" for kind in BUDGETED if counts[kind])
        return (f"control frames past the budget of {self.rate.burst} at once and {self.rate.per_s:g}/s beyond what"
                f" its requests and our DATA explain ({what} in the slice that crossed it)")


class FrameScan:
    """Counts the frames of a byte stream fed in chunks, by kind, reading only their headers (and a padded DATA
    frame's pad length). Malformed framing is h2's to refuse; here it only miscounts what follows."""

    def __init__(self, *, preface: bool):
        self._skip = PREFACE_BYTES if preface else 0  # bytes to pass: the preface, or the rest of a payload
        self._head = b""  # a frame header split across chunks
        self._padded: tuple[int, int] | None = None  # (flags, length) of a padded DATA frame, its pad length next

    def feed(self, data: bytes) -> collections.Counter:
        counts: collections.Counter = collections.Counter()
        i, n = 0, len(data)
        while i < n:
            if self._padded is not None:  # the first payload byte of a padded DATA frame: its pad length
                flags, length = self._padded
                counts[Kind.of(0, flags, max(0, length - 1 - data[i]))] += 1
                self._padded = None
            if self._skip:
                step = min(self._skip, n - i)
                i, self._skip = i + step, self._skip - step
                continue
            i = self._header(data, i, counts)
        return counts

    def _header(self, data: bytes, i: int, counts: collections.Counter) -> int:
        """Read (the rest of) a frame header at i and count its frame; where the scan goes on."""
        if self._head or len(data) - i < HEADER_BYTES:
            taken = data[i:i + HEADER_BYTES - len(self._head)]
            self._head += taken
            if len(self._head) < HEADER_BYTES:
                return i + len(taken)
            head, self._head, i = self._head, b"", i + len(taken)
            high, low, kind, flags = _HEADER.unpack_from(head)
        else:
            high, low, kind, flags = _HEADER.unpack_from(data, i)
            i += HEADER_BYTES
        length = high << 16 | low
        if kind == 0 and flags & PADDED and length:
            self._padded = (flags, length)
        else:
            frame = Kind.of(kind, flags, length)
            if frame is not None:
                counts[frame] += 1
        self._skip = length
        return i
