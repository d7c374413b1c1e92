"""What an actor asks the node to do, how it refuses a message, and the checks every role shares."""
from __future__ import annotations

import time
from contextlib import contextmanager

import attrs

from .messages import Activation, EndReason, EndRequest, InferenceResponse, NextTokens, SegmentMeta
from .schedule import StageQueue


class Refused(Exception):
    """A message this stage does not take; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


@attrs.frozen
class Send:
    dest: str  # a registry name, e.g. "pp-stage-1"
    message: Activation | NextTokens | EndRequest


@attrs.frozen
class Reply:
    reply_to: str | None  # base URL of whoever asked; None: keep it on this node for the asker to fetch
    response: InferenceResponse


def wrong_role(stage: int, role, message) -> Refused:
    kind = type(message).__name__
    return Refused(409, f"stage {stage} ({role.value}) does not accept {kind} messages")


def failure(request_id: str, stage: int, error: str) -> EndRequest:
    return EndRequest(request_id, EndReason.FAILED, f"stage {stage}: {error}", stage)


def error_reply(reply_to: str | None, end: EndRequest) -> Reply:
    return Reply(reply_to, InferenceResponse(end.request_id, error=end.error, failed_stage=end.failed_stage))


@contextmanager
def timed(into: list):
    """Append the elapsed milliseconds of the block to `into`."""
    start = time.perf_counter()
    yield
    into.append((time.perf_counter() - start) * 1000.0)


def admit_segments(expected: dict[str, int], queue: StageQueue, act: Activation, stage: int) -> list[tuple]:
    """Middle and last stages: check every segment of an activation before taking any (a message is taken
    whole or refused whole), then record where each request's next rows must start. `expected` maps the
    requests live here to that position. Returns (segment, rows' bytes) for the requests still live:
    rows of a request that ended here are dropped."""
    planned: dict[str, int] = {}
    for s in act.meta.segments:
        rid = s.request_id
        if queue.ended(rid):
            continue
        want = planned.get(rid, expected.get(rid))
        if s.start is not None and want is not None:
            raise Refused(409, f"request {rid!r} starts twice at stage {stage}")
        if s.start is None and want is None:
            raise Refused(404, f"unknown request {rid!r} at stage {stage} (never started here, or ended)")
        if s.start is None and s.position != want:
            raise Refused(409, f"request {rid!r} at stage {stage}: rows at position {s.position}, expected {want}")
        planned[rid] = s.position + s.seq_len
    expected.update(planned)
    return [(s, h) for s, h in act.split() if s.request_id in planned]


def segment_of(meta: SegmentMeta, ms: float) -> SegmentMeta:
    """The segment as this stage passes it on: its compute time appended."""
    return attrs.evolve(meta, stage_ms=(*meta.stage_ms, ms))
