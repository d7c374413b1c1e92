"""What an actor asks the node to do, how it refuses a message, and the checks every role shares."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import attrs

from worker.errors import WorkerError

from .messages import Activation, EndReason, EndRequest, InferenceResponse, NextTokens, SegmentMeta
from .schedule import StageQueue, Step


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


@attrs.frozen
class Progress:
    """Stage 0 to whoever follows a request at the entry (the OpenAI API): a token came back, or the
    request ended (`end`)."""

    request_id: str
    token_id: int | None = None
    done: bool = False
    end: EndRequest | None = None


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


def compute(step: Step, worker, items: list) -> tuple[list, float]:
    """On the compute thread: free the slots of ended requests, then run the step's items as one batch.
    Returns the results and the step's wall time in ms."""
    for rid in step.release:
        worker.release(rid)
    ms: list[float] = []
    with timed(ms):
        results = worker.run(items) if items else []
    return results, ms[0]


def pass_on(step: Step, outcome: tuple[list, float], *, dest: str, live: Callable[[str], bool],
            fail: Callable[[str, str], list]) -> list:
    """First and middle stages: the step's rows go on to `dest` as one activation, each segment with this
    stage's compute time appended; a refused item fails its request; rows of requests that ended while
    the step computed are dropped."""
    results, ms = outcome
    segments, actions = [], []
    for unit, out in zip(step.units, results):
        if not live(unit.request_id):
            continue
        if isinstance(out, WorkerError):
            actions += fail(unit.request_id, str(out))
            continue
        meta = SegmentMeta(unit.request_id, unit.position, unit.rows, (*unit.stage_ms, ms), unit.start)
        segments.append((meta, out))
    if segments:
        actions.insert(0, Send(dest, Activation.of(segments)))
    return actions
