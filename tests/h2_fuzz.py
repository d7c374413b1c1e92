"""Test helper: a seeded generator of hostile bytes for a node's HTTP edge, one connection's worth per case, and
the raw frames it is made of. HTTP/2 frames are built by hand (a 9-byte header and a payload) and header blocks
encoded with hpack directly: h2's own client refuses to send what is malformed, and malformed is the point."""
from __future__ import annotations

import base64
import random
import struct

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x4, 0x8, 0x20

METHODS = [b"GET", b"POST", b"CONNECT", b"HEAD", b"OPTIONS", b"get", b"PO\xffST", b"G\xc3\xa9T", b"", b"GET\r\n",
           b"\x00", b"M" * 300]
PATHS = [b"/health", b"/v1/chat/completions", b"/v1/models", b"/v1/link?link=a&from=b", b"*", b"", b"health",
         b"/\xff\xfe", b"/caf\xc3\xa9", b"/%ff%fe", b"/a\x00b", b"/a\r\nb", b"/" + b"x" * 5000, b"/v1/\xed\xa0\x80"]
PSEUDO = [b":method", b":path", b":scheme", b":authority", b":protocol", b":status", b":bogus"]


def frame(kind: int, flags: int, stream_id: int, payload: bytes, *, length: int | None = None) -> bytes:
    """One HTTP/2 frame; `length` makes its header lie about the payload."""
    size = len(payload) if length is None else length
    return struct.pack(">I", size & 0xFFFFFF)[1:] + bytes([kind & 0xFF, flags & 0xFF]) + \
        struct.pack(">I", stream_id & 0xFFFFFFFF) + payload


def settings(pairs: list[tuple[int, int]]) -> bytes:
    return b"".join(struct.pack(">HI", key & 0xFFFF, value & 0xFFFFFFFF) for key, value in pairs)


def header_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    return hpack.Encoder().encode(headers)


def request_headers(method: bytes = b"GET", path: bytes | None = b"/health") -> list[tuple[bytes, bytes]]:
    headers = [(b":method", method), (b":scheme", b"http"), (b":authority", b"node")]
    return headers + ([] if path is None else [(b":path", path)])


class Fuzz:
    """Cases from one seed: `case()` is (kind, bytes) with kind "h2" or "h1"."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def case(self) -> tuple[str, bytes]:
        return ("h2", self.h2()) if self.rng.random() < 0.7 else ("h1", self.h1())

    # -- HTTP/2 -----------------------------------------------------------------------------------------------

    def h2(self) -> bytes:
        r = self.rng
        out = [PREFACE if r.random() < 0.95 else PREFACE[:r.randrange(len(PREFACE))]]
        out.append(frame(SETTINGS, 0, 0, settings(self.odd_settings()) if r.random() < 0.3 else b""))
        opened: list[int] = []
        for _ in range(r.randint(1, 12)):
            out.append(self.h2_frame(opened))
        return b"".join(out)

    def odd_settings(self) -> list[tuple[int, int]]:
        r = self.rng
        values = [0, 1, 2 ** 14 - 1, 2 ** 24, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1]
        return [(r.choice([0, 1, 2, 3, 4, 5, 6, 8, 9, 0xFFFF]), r.choice(values)) for _ in range(r.randint(1, 6))]

    def stream_id(self, opened: list[int]) -> int:
        r = self.rng
        pick = r.random()
        if pick < 0.15:
            return 0
        if pick < 0.3:
            return r.randrange(2, 1000, 2)  # even: a server's
        if pick < 0.55 and opened:
            return r.choice(opened)  # opened, maybe closed by now
        if pick < 0.6:
            return r.choice([0x7FFFFFFF, 0xFFFFFFFF])
        sid = (max(opened) + 2) if opened and r.random() < 0.7 else r.randrange(1, 2 ** 20, 2)
        return sid & 0xFFFFFFFF

    def h2_frame(self, opened: list[int]) -> bytes:
        r = self.rng
        kind = r.choice([DATA, HEADERS, HEADERS, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING,
                         GOAWAY, WINDOW_UPDATE, CONTINUATION, r.randrange(10, 256)])
        sid = self.stream_id(opened)
        flags = r.choice([0, END_STREAM, END_HEADERS, END_HEADERS | END_STREAM, PADDED, PRIORITY_FLAG, r.randrange(256)])
        if kind == HEADERS:
            payload = header_block(self.headers())
            if flags & PADDED:
                payload = bytes([r.randrange(256)]) + payload
            if flags & PRIORITY_FLAG:
                payload = struct.pack(">IB", r.randrange(2 ** 32), r.randrange(256)) + payload
            if sid % 2 and sid not in opened:
                opened.append(sid)
        elif kind == CONTINUATION:
            payload = header_block(self.headers())
        elif kind == PRIORITY:
            payload = struct.pack(">IB", r.choice([0, sid, r.randrange(2 ** 32)]), r.randrange(256))
        elif kind == WINDOW_UPDATE:
            payload = struct.pack(">I", r.choice([0, 1, 2 ** 31 - 1, 2 ** 32 - 1, r.randrange(2 ** 31)]))
        elif kind == SETTINGS:
            payload = settings(self.odd_settings()) if not flags & 1 else b""
            if r.random() < 0.2:
                payload = payload[:-r.randint(1, 5)]  # not a multiple of 6
        elif kind in (RST_STREAM, GOAWAY):
            payload = struct.pack(">I", r.randrange(2 ** 32)) * (1 if kind == RST_STREAM else 2)
        elif kind == PING:
            payload = r.randbytes(r.choice([8, 8, 0, 7, 9]))
        else:
            payload = r.randbytes(r.choice([0, 1, 16, 300]))
        length = None if r.random() < 0.85 else r.choice([0, len(payload) + r.randint(1, 40),
                                                          max(0, len(payload) - 3), 2 ** 24 - 1])
        return frame(kind, flags, sid, payload, length=length)

    def headers(self) -> list[tuple[bytes, bytes]]:
        r = self.rng
        headers = request_headers(r.choice(METHODS), r.choice(PATHS))
        r.shuffle(headers)
        for _ in range(r.randint(0, 3)):
            pick = r.random()
            if pick < 0.3 and headers:
                headers.pop(r.randrange(len(headers)))  # missing :path, :method ...
            elif pick < 0.6:
                headers.append((r.choice(PSEUDO), r.choice(METHODS + PATHS)))  # duplicate or unknown
            else:
                headers.append((r.choice([b"content-length", b"te", b"connection", b"x-\xff", b"Upper",
                                          b"authorization", b"host"]), r.choice([b"-1", b"99999999999", b"gzip",
                                                                                 b"\xff\x00", b"Bearer x"])))
        return headers

    # -- HTTP/1.1 ---------------------------------------------------------------------------------------------

    def h1(self) -> bytes:
        r = self.rng
        method = r.choice(METHODS + [b"PRI"])
        target = r.choice(PATHS + [b"http://x/health", b"/health?\xff"])
        version = r.choice([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9", b"http/1.1", b""])
        lines = [method + b" " + target + b" " + version]
        headers = [b"Host: node"]
        if r.random() < 0.4:
            headers += [b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c",
                        b"HTTP2-Settings: " + self.http2_settings()]
        body = b""
        pick = r.random()
        if pick < 0.3:
            body = self.lying_chunks()
            headers.append(b"Transfer-Encoding: chunked")
        elif pick < 0.5:
            body = r.randbytes(r.randint(0, 64))
            headers.append(b"Content-Length: " + r.choice([str(len(body)).encode(), b"-5", b"1000000", b"abc",
                                                           str(len(body) + 10).encode()]))
        for _ in range(r.randint(0, 3)):
            headers.append(r.choice([b"X-\xff: \xfe", b"Bad Header: x", b": empty", b"Content-Length: 1",
                                     b"Content-Length: 2", b"Transfer-Encoding: gzip, chunked", b"X: " + b"y" * 9000,
                                     b"Expect: 100-continue", b"Authorization: Bearer \x00"]))
        eol = b"\r\n" if r.random() < 0.9 else b"\n"
        return eol.join(lines + headers) + eol + eol + body

    def http2_settings(self) -> bytes:
        r = self.rng
        good = base64.urlsafe_b64encode(settings(self.odd_settings())).rstrip(b"=")
        return r.choice([good, good[:-1], b"!!!notbase64", b"AAMAAABkAAQAAP__", b"=" * 5, b"\xff\xfe", b"",
                         base64.b64encode(r.randbytes(7)), b"A"])

    def lying_chunks(self) -> bytes:
        r = self.rng
        chunks = []
        for _ in range(r.randint(1, 3)):
            data = r.randbytes(r.randint(0, 20))
            size = r.choice([len(data), len(data) + 5, max(0, len(data) - 2), 2 ** 40])
            chunks.append(r.choice([b"%x" % size, b"zz", b"-1", b"%x;ext=1" % size]) + b"\r\n" + data + b"\r\n")
        return b"".join(chunks) + r.choice([b"0\r\n\r\n", b"", b"0\r\n"])
