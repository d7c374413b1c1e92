"""Link stream frames: every message survives the trip whole however the bytes are cut, heartbeats vanish,
and a frame that is not right is refused naming what is wrong, after the good frames before it."""
import random
import struct

import numpy as np
import pytest

from node.transport import frames
from roles.messages import (
    Activation, EndReason, EndRequest, NextTokens, RequestStart, SegmentMeta, Token, WireError)
from worker.contract import Sampling, TokenLogprob

DIM = 8


def hidden(rows: int, seed: int) -> bytes:
    return np.random.default_rng(seed).standard_normal((rows, DIM)).astype("<f4").tobytes()


START = RequestStart(max_tokens=7, sampling=Sampling(0.7, 0.9, 3), prompt_token_ids=(1, 2, 3), reply_to=None,
                     queued_ms=1.5)
MESSAGES = [
    Activation.of([(SegmentMeta("a", 0, 3, (0.25,), START), hidden(3, 1)),
                   (SegmentMeta("ünïcode-b", 9, 1, (1.0, 2.0 / 3.0)), hidden(1, 2))]),
    NextTokens((Token("a", 5, 3, False), Token("b", 128009, 10, True))),
    NextTokens((Token("c", 7, 4, False, 1, TokenLogprob(7, -0.25, ((7, -0.25), (2, -1.5))),
                      (TokenLogprob(3, -2.0), TokenLogprob(4, -9999.0, ((1, -0.1),)))),)),
    EndRequest("a", EndReason.FAILED, "stage 2: boom", 2),
    EndRequest("b", EndReason.FINISHED),
]


def read_all(data: bytes, cuts: list[int]) -> list:
    reader, out, at = frames.FrameReader(DIM), [], 0
    for cut in [*cuts, len(data)]:
        reader.feed(data[at:cut])
        out += list(reader.frames())
        at = cut
    return out


def test_every_message_arrives_equal_with_its_seq_and_stamp_however_the_bytes_are_cut():
    data = b"".join(frames.encode(m, seq, 100.0 + seq) for seq, m in enumerate(MESSAGES, start=1))
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, 20)))
        got = read_all(data, cuts)
        assert [m for _, _, m in got] == MESSAGES
        assert [(seq, at) for seq, at, _ in got] == [(n, 100.0 + n) for n in range(1, len(MESSAGES) + 1)]


def test_byte_by_byte_is_the_same_as_all_at_once():
    data = b"".join(frames.encode(m, 1, 0.0) for m in MESSAGES)
    assert read_all(data, list(range(1, len(data)))) == read_all(data, [])


def test_heartbeats_are_dropped():
    data = frames.heartbeat(1.0) + frames.encode(MESSAGES[1], 1, 2.0) + frames.heartbeat(3.0)
    assert read_all(data, []) == [(1, 2.0, MESSAGES[1])]


def test_a_message_that_is_not_a_pipeline_message_is_not_framed():
    with pytest.raises(TypeError, match="does not travel"):
        frames.encode("hello", 1, 0.0)


def frame(kind: int, payload: bytes) -> bytes:
    return frames.HEADER.pack(frames.HEADER.size - 4 + len(payload), kind, 1, 0.0) + payload


@pytest.mark.parametrize("data, error", [
    (frame(9, b""), "unknown kind 9"),
    (frames.HEADER.pack(3, 1, 1, 0.0), "outside"),
    (frame(frames.NEXT_TOKENS, struct.pack(">H", 2) + struct.pack(">H", 1) + b"a" + struct.pack(">IIBI", 1, 2, 0, 0)),
     "kind 2"),  # says two tokens, holds one
    (frame(frames.NEXT_TOKENS, struct.pack(">H", 1) + struct.pack(">H", 1) + b"a" + struct.pack(">IIBI", 1, 2, 0, 0)
           + struct.pack(">I", 0) + b"xx"), "after the last token"),
    (frame(frames.NEXT_TOKENS, struct.pack(">H", 1) + struct.pack(">H", 1) + b"a" + struct.pack(">IIBI", 1, 2, 0, 0)
           + struct.pack(">I", 12) + b'{"logprob":1}'[:12]), "not JSON"),  # logprobs cut short
    (frame(frames.NEXT_TOKENS, struct.pack(">H", 1) + struct.pack(">H", 2) + b"\xff\xfe" + struct.pack(">IIBI", 1, 2, 0, 0)),
     "utf-8"),
    (frame(frames.END, b'{"request_id": "a", "reason": "exploded"}'), "reason"),
])
def test_a_malformed_frame_is_refused_naming_what_is_wrong(data, error):
    with pytest.raises(WireError, match=error):
        read_all(frames.encode(MESSAGES[3], 1, 0.0) + data, [])


def test_frames_before_a_malformed_one_are_still_read():
    reader = frames.FrameReader(DIM)
    reader.feed(frames.encode(MESSAGES[2], 1, 0.0) + frame(9, b""))
    got = reader.frames()
    assert next(got)[2] == MESSAGES[2]
    with pytest.raises(WireError):
        next(got)


def test_hidden_rows_must_match_the_segments():
    act = Activation.of([(SegmentMeta("a", 4, 2, ()), hidden(2, 1))])
    data = frames.encode(act, 1, 0.0)
    size, kind, seq, at = frames.HEADER.unpack_from(data)
    one_float_short = frames.HEADER.pack(size - 4, kind, seq, at) + data[frames.HEADER.size:-4]
    with pytest.raises(WireError, match="expected 2 rows"):
        read_all(one_float_short, [])
    reader = frames.FrameReader(DIM + 1)
    reader.feed(data)
    with pytest.raises(WireError, match="hidden_dim 9"):
        list(reader.frames())


def test_a_segment_s_rules_hold_on_the_stream_too():
    bad = Activation.of([(SegmentMeta("a", 4, 1, ()), hidden(1, 1))])
    data = bytearray(frames.encode(bad, 1, 0.0))
    # position 4 -> 0 without a start: the same refusal as over JSON
    at = data.index(struct.pack(">II", 4, 1))
    data[at:at + 4] = struct.pack(">I", 0)
    with pytest.raises(WireError, match="start"):
        read_all(bytes(data), [])
