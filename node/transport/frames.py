"""The binary frames of a link stream: one long-lived HTTP/2 request body from a stage to its next carries
the pipeline's messages one after another, each length-prefixed, since HTTP/2 keeps no message boundaries.

    frame   = u32 length of the rest | u8 kind | u64 seq | f64 sent_at | payload
    kind 0  heartbeat: no payload, seq 0; proves the connection still takes writes (node/transport/streams.py)
    kind 1  Activation: u16 segments, each: str request_id | u32 position | u32 seq_len | u32 generation |
            u8 n, n x f64 stage_ms | u32 length + JSON of RequestStart (0: none); then the hidden rows
            (float32, little-endian) to the end of the frame
    kind 2  NextTokens: u16 tokens, each: str request_id | u32 token_id | u32 position | u8 done |
            u32 generation | u32 length + JSON of the token's logprobs, {logprob, prompt_logprobs} (0: none)
    kind 3  EndRequest, as JSON (rare: a request's end, or a failure report)

    str = u16 length + UTF-8. Integers big-endian.

The per-token path (decode rows and fed-back tokens) is fixed binary; JSON is left for the rare
messages. `seq` numbers a link's frames so a re-opened stream can skip what already arrived; `sent_at`
is the sender's clock when the frame was written (see node/observe/hops.py on clocks). A frame that cannot be
parsed raises WireError naming what is wrong; nothing of it is delivered. A sender cuts what it sends to
frame_limit, the receiver's limit (`bodies`); a request's part that alone is over it is not sent.
"""
from __future__ import annotations

import struct

import attrs

from roles.messages import (
    Activation, ActivationMeta, EndRequest, NextTokens, RequestStart, SegmentMeta, Token, WireError)
from worker.contract import TokenLogprob

from node.transport import wire

HEADER = struct.Struct(">IBQd")  # length, kind, seq, sent_at
_PREFIX = struct.Struct(">I")
_BODY_HEAD = HEADER.size - _PREFIX.size  # kind, seq, sent_at: counted in the length
_U8, _U16, _U32, _F64 = (struct.Struct(f) for f in (">B", ">H", ">I", ">d"))
_SEGMENT = struct.Struct(">III")
_TOKEN = struct.Struct(">IIBI")
HEARTBEAT, ACTIVATION, NEXT_TOKENS, END = 0, 1, 2, 3
# What a legitimate sender can put in one frame (node/transport/links.py splits its batches to fit): a peer's
# frame header claiming more is refused before a byte of it is buffered.
MAX_FRAME_ROWS = 1024  # hidden rows of one activation frame: several steps' worth at any max_batch in use
MAX_FRAME_TOKENS = 1024  # fed-back tokens of one NextTokens frame: one per slot, with room to spare
# The rest of a frame: ids, RequestStarts (prompt ids, sampling), logprobs, JSON. Kept at 16 MiB rather than
# raised to what a full context's prompt logprobs could take (131072 tokens x ~610 B at logprobs=20 = ~80 MB):
# a receiver buffers up to one frame per inbound link (MAX_INBOUND_LINKS of them), so this bounds what peers
# can make it hold. Senders cut batches to fit (bodies below); a single request whose part alone is over it
# (echo + logprobs=20 past ~27,000 prompt tokens) fails alone, naming this limit.
MAX_FRAME_META = 16 << 20


def frame_limit(kind: int, hidden_dim: int) -> int:
    """The most bytes (after the length prefix) a frame of `kind` may hold: rows x dim x 4 plus metadata for
    an activation, the metadata alone otherwise; a heartbeat holds nothing; an unknown kind, nothing."""
    if kind == ACTIVATION:
        return _BODY_HEAD + MAX_FRAME_ROWS * hidden_dim * 4 + MAX_FRAME_META
    if kind in (NEXT_TOKENS, END):
        return _BODY_HEAD + MAX_FRAME_META
    return _BODY_HEAD


def meta_room(kind: int) -> int:
    """The most bytes a frame of `kind` may hold besides hidden rows: frame_limit's, for senders' cutting."""
    return frame_limit(kind, hidden_dim=0)


@attrs.frozen
class Body:
    """A message encoded as one frame's body, but for its header (seq, sent_at: given when it is sent)."""

    message: object
    kind: int
    payload: tuple[bytes, ...]

    @property
    def size(self) -> int:
        return _BODY_HEAD + sum(len(p) for p in self.payload)

    def frame(self, seq: int, sent_at: float) -> bytes:
        return b"".join([HEADER.pack(self.size, self.kind, seq, sent_at), *self.payload])


@attrs.frozen
class TooLarge:
    """A part of a message (one request's) that alone is more than a frame takes: it is not sent."""

    message: object
    error: str  # the same for each part of one request


def bodies(message) -> tuple[list[Body], list[TooLarge]]:
    """`message` as frame bodies that each fit frame_limit, each piece (a request's segment, a token)
    encoded once; a piece too large alone for any frame comes back as TooLarge, so that only its request
    fails. Pieces keep their order; hidden rows are not counted (links.coalesce bounds their number)."""
    if isinstance(message, EndRequest):
        body = Body(message, END, (wire.encode(message),))
        return ([body], []) if body.size <= meta_room(END) else ([], [TooLarge(message, _too_large(body.size))])
    if isinstance(message, Activation):
        kind, build, items = ACTIVATION, Activation.of, message.meta.segments
        parts = [_segment(seg) for seg in items]
    elif isinstance(message, NextTokens):
        kind, build, items = NEXT_TOKENS, lambda tokens: NextTokens(tuple(tokens)), message.tokens
        parts = [_token(t) for t in items]
    else:
        raise TypeError(f"{type(message).__name__} does not travel on a link stream")
    sizes, room = [sum(map(len, p)) for p in parts], meta_room(kind) - _BODY_HEAD - _U16.size
    if sum(sizes) <= room:  # the common case: as it is, its rows not copied
        return [_body(kind, message, parts)], []
    pieces = message.split() if kind == ACTIVATION else items
    out, too_large, group, used, failed = [], [], [], 0, {}
    for piece, item, piece_parts, size in zip(pieces, items, parts, sizes):
        if size > room or item.request_id in failed:  # a request's later rows go where its start went
            failed.setdefault(item.request_id, _too_large(_BODY_HEAD + _U16.size + size))
            too_large.append(TooLarge(build([piece]), failed[item.request_id]))
            continue
        if group and used + size > room:
            out.append(_body(kind, build([p for p, _ in group]), [pp for _, pp in group]))
            group, used = [], 0
        group.append((piece, piece_parts))
        used += size
    if group:
        out.append(_body(kind, build([p for p, _ in group]), [pp for _, pp in group]))
    return out, too_large


def _body(kind: int, message, parts: list[list[bytes]]) -> Body:
    payload = [_U16.pack(len(parts)), *(p for piece_parts in parts for p in piece_parts)]
    return Body(message, kind, tuple(payload + [message.hidden] if kind == ACTIVATION else payload))


def _too_large(size: int) -> str:
    return (f"this request's part of a link frame is {size} bytes besides hidden rows, more than a frame takes "
            f"({MAX_FRAME_META}, frames.MAX_FRAME_META; a long prompt's logprobs or start can be): not sent")


def encode(message, seq: int, sent_at: float) -> bytes:
    if isinstance(message, Activation):
        kind, payload = ACTIVATION, _activation(message)
    elif isinstance(message, NextTokens):
        kind, payload = NEXT_TOKENS, _next_tokens(message)
    elif isinstance(message, EndRequest):
        kind, payload = END, [wire.encode(message)]
    else:
        raise TypeError(f"{type(message).__name__} does not travel on a link stream")
    size = _BODY_HEAD + sum(len(p) for p in payload)
    return b"".join([HEADER.pack(size, kind, seq, sent_at), *payload])


def heartbeat(sent_at: float) -> bytes:
    return HEADER.pack(_BODY_HEAD, HEARTBEAT, 0, sent_at)


def _str(text: str) -> bytes:
    data = text.encode()
    return _U16.pack(len(data)) + data


def _activation(act: Activation) -> list[bytes]:
    return [_U16.pack(len(act.meta.segments)), *(p for s in act.meta.segments for p in _segment(s)), act.hidden]


def _segment(s: SegmentMeta) -> list[bytes]:
    start = b"" if s.start is None else wire.encode(s.start)
    return [_str(s.request_id), _SEGMENT.pack(s.position, s.seq_len, s.generation),
            _U8.pack(len(s.stage_ms)), struct.pack(f">{len(s.stage_ms)}d", *s.stage_ms), _U32.pack(len(start)), start]


@attrs.frozen
class _Logprobs:
    """A token's logprobs, where they were asked for: the rare part of a fed-back token, as JSON."""

    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


def _next_tokens(msg: NextTokens) -> list[bytes]:
    return [_U16.pack(len(msg.tokens)), *(p for t in msg.tokens for p in _token(t))]


def _token(t: Token) -> list[bytes]:
    extra = b"" if t.logprob is None and not t.prompt_logprobs else wire.encode(_Logprobs(t.logprob, t.prompt_logprobs))
    return [_str(t.request_id), _TOKEN.pack(t.token_id, t.position, t.done, t.generation), _U32.pack(len(extra)), extra]


class FrameReader:
    """Bytes in as they arrive, whole frames out: after `feed(chunk)`, `frames()` yields each whole frame as
    (seq, sent_at, message); heartbeats are read and dropped. A frame that cannot be parsed raises
    WireError from `frames()`, after the frames before it were yielded; so does a header claiming more than
    frame_limit, as soon as it is in, so the buffer never holds more than one frame's limit and a chunk."""

    def __init__(self, hidden_dim: int):
        self.hidden_dim = hidden_dim
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk

    def frames(self):
        buf = self._buffer
        while len(buf) >= HEADER.size:
            size, kind, seq, sent_at = HEADER.unpack_from(buf)
            if not _BODY_HEAD <= size <= (limit := frame_limit(kind, self.hidden_dim)):
                raise WireError(f"link frame of kind {kind} and {size} bytes: outside {_BODY_HEAD}..{limit}")
            end = _PREFIX.size + size
            if len(buf) < end:
                return
            message = None
            if kind != HEARTBEAT:
                payload = memoryview(buf)[HEADER.size:end]
                try:
                    message = self._decode(kind, payload)
                finally:
                    payload.release()  # the buffer shrinks next; no view of it may be alive then
            del buf[:end]
            if message is not None:
                yield seq, sent_at, message

    def _decode(self, kind: int, payload: memoryview):
        try:
            if kind == ACTIVATION:
                return _read_activation(_Cursor(payload), self.hidden_dim)
            if kind == NEXT_TOKENS:
                return _read_next_tokens(_Cursor(payload))
            if kind == END:
                return wire.decode(EndRequest, bytes(payload))
        except (struct.error, UnicodeDecodeError) as exc:
            raise WireError(f"link frame of kind {kind}: {exc}") from None
        raise WireError(f"link frame of unknown kind {kind}")


class _Cursor:
    def __init__(self, data: memoryview):
        self.data, self.at = data, 0

    def take(self, fmt: struct.Struct) -> tuple:
        values = fmt.unpack_from(self.data, self.at)
        self.at += fmt.size
        return values

    def bytes(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise struct.error(f"{n} bytes wanted at offset {self.at}, frame ends at {len(self.data)}")
        out = bytes(self.data[self.at:self.at + n])
        self.at += n
        return out

    def str(self) -> str:
        (n,) = self.take(_U16)
        return self.bytes(n).decode()

    def rest(self) -> bytes:
        out = bytes(self.data[self.at:])
        self.at = len(self.data)
        return out


def _read_activation(c: _Cursor, hidden_dim: int) -> Activation:
    (n,) = c.take(_U16)
    segments = []
    for _ in range(n):
        rid = c.str()
        position, seq_len, generation = c.take(_SEGMENT)
        (n_ms,) = c.take(_U8)
        stage_ms = c.take(struct.Struct(f">{n_ms}d"))
        (start_len,) = c.take(_U32)
        start = wire.decode(RequestStart, c.bytes(start_len)) if start_len else None
        segments.append(SegmentMeta(rid, position, seq_len, tuple(stage_ms), start, generation))
    return wire.checked_activation(ActivationMeta(tuple(segments)), c.rest(), hidden_dim)


def _read_next_tokens(c: _Cursor) -> NextTokens:
    (n,) = c.take(_U16)
    tokens = []
    for _ in range(n):
        rid = c.str()
        token_id, position, done, generation = c.take(_TOKEN)
        (extra_len,) = c.take(_U32)
        extra = wire.decode(_Logprobs, c.bytes(extra_len)) if extra_len else _Logprobs()
        tokens.append(Token(rid, token_id, position, bool(done), generation, extra.logprob, extra.prompt_logprobs))
    if c.at != len(c.data):
        raise WireError(f"NextTokens frame: {len(c.data) - c.at} bytes after the last token")
    return NextTokens(tuple(tokens))
