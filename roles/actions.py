"""What an actor asks the node to do, how it refuses a message, and the checks every role shares."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import attrs

from worker.contract import FromCache, TokenLogprob, Worker
from worker.errors import WorkerError

from .messages import Activation, EndReason, EndRequest, InferenceResponse, NextTokens, RequestStart, SegmentMeta
from .schedule import StageQueue, Step, Unit


class Refused(Exception):
    """A message this stage does not take; `status` is the HTTP status to answer with, and `code`, where the
    request's prompt is at fault, says how: PROMPT_TOO_LONG or PROMPT_INVALID (the API shapes these its way)."""

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after_s, self.code = status, message, retry_after_s, code


UNKNOWN_REQUEST = 404  # Refused.status: rows or tokens of a request this stage never started, or has ended
PROMPT_TOO_LONG = "context_length_exceeded"  # Refused.code: the prompt leaves no room in the context
PROMPT_INVALID = "invalid_value"  # Refused.code: the prompt cannot be tokenized, or names tokens out of range


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
    logprob: TokenLogprob | None = None  # the Token's, as the last stage sent them
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


def wrong_role(stage: int, role, message) -> Refused:
    kind = type(message).__name__
    return Refused(409, f"stage {stage} ({role.value}) does not accept {kind} messages")


def failure(request_id: str, stage: int, error: str, generation: int = 0, *, poison: bool = False,
            param: str = "") -> EndRequest:
    """To stage 0: this life of the request failed here (a failure of a life since replayed is ignored,
    unless it is `poison`: computing the request failed, which no replay mends). `param`: the request's own
    parameter that failed it, if any (EndRequest.param)."""
    return EndRequest(request_id, EndReason.FAILED, f"stage {stage}: {error}", stage, generation, poison, param=param)


def lost(request_id: str, stage: int, generation: int, error: str) -> EndRequest:
    """To stage 0: the rows of this life of the request did not get past `stage`; replay it."""
    return EndRequest(request_id, EndReason.LOST, f"stage {stage}: {error}", stage, generation)


def error_reply(reply_to: str | None, end: EndRequest) -> Reply:
    return Reply(reply_to, InferenceResponse(end.request_id, error=end.error, failed_stage=end.failed_stage))


@contextmanager
def timed(into: list):
    """Append the elapsed milliseconds of the block to `into`."""
    start = time.perf_counter()
    yield
    into.append((time.perf_counter() - start) * 1000.0)


@attrs.define
class Held:
    """A request live at a middle or last stage: its life (generation) and where its next rows start."""

    generation: int
    next_position: int


def is_live(held: dict[str, Held], request_id: str, generation: int) -> bool:
    """Whether this life of the request is live at a middle or last stage (it started there, has not ended,
    no replay since)."""
    now = held.get(request_id)
    return now is not None and now.generation == generation


def admit_segments(held: dict[str, Held], queue: StageQueue, act: Activation, stage: int) -> list[tuple]:
    """Middle and last stages: check every segment of an activation before taking any (a message is taken
    whole or refused whole), then record where each request's next rows must start. `held` maps the
    requests live here to their life and next position. Returns (segment, rows' bytes) for the rows to
    compute: rows of a request that ended here, or of an earlier life than the one held, are dropped. A
    segment that starts a later life than the one held starts the request over (a replay): the actor
    frees the old slot when it meets that start."""
    planned: dict[str, Held] = {}
    taken = []
    for s, hidden in act.split():
        rid = s.request_id
        if queue.ended(rid):
            continue
        now = planned.get(rid, held.get(rid))
        if now is not None and s.generation < now.generation:
            continue  # rows of a life a replay has replaced
        if s.start is not None:
            if now is not None and s.generation == now.generation:
                raise Refused(409, f"request {rid!r} starts twice at stage {stage}")
        elif now is None or s.generation > now.generation:
            raise Refused(UNKNOWN_REQUEST, f"unknown request {rid!r} (generation {s.generation}) at stage {stage} "
                               f"(never started here, or ended)")
        elif s.position != now.next_position:
            raise Refused(409, f"request {rid!r} at stage {stage}: rows at position {s.position}, "
                               f"expected {now.next_position}")
        planned[rid] = Held(s.generation, s.position + s.seq_len)
        taken.append((s, hidden))
    held.update(planned)
    return taken


def each_segment(taken: list[tuple], take: Callable[[SegmentMeta, bytes], None],
                 fail: Callable[[str, str], list]) -> list:
    """Middle and last stages: take each admitted segment on its own; one whose taking raises fails its
    request alone (`fail(request_id, error)`: reported to stage 0, which ends it everywhere), and the
    message's other requests go on. Returns what the failures send."""
    actions, failed = [], set()
    for s, hidden in taken:
        if s.request_id in failed:
            continue  # its later rows: the request is over here
        try:
            take(s, hidden)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is this request's
            failed.add(s.request_id)
            actions += fail(s.request_id, f"could not take its rows: {type(exc).__name__}: {exc}")
    return actions


class Entries:
    """Middle and last stages: which stage 0 owns each request held here (RequestStart.entry). When a start
    from another stage 0 arrives, the one before was replaced and its requests are gone with it: they are
    ended here (`end_here`), at once and in order with the new entry's rows, so their slots are free for
    the new entry's requests. Rows that start a request for an entry replaced since are dropped."""

    def __init__(self, end_here: Callable[[str], None]):
        self.current: str | None = None
        self.retired: set[str] = set()
        self.owner: dict[str, str] = {}
        self._end_here = end_here

    def admit(self, act: Activation) -> Activation | None:
        """The activation without the starts of a replaced entry's requests; a new entry is switched to first."""
        for s in act.meta.segments:
            entry = s.start.entry if s.start is not None else ""
            if entry and entry != self.current and entry not in self.retired:
                self.forget_except(entry)
        rows = [(s, h) for s, h in act.split() if s.start is None or s.start.entry not in self.retired]
        for s, _ in rows:
            if s.start is not None and s.start.entry:
                self.owner[s.request_id] = s.start.entry
        return Activation.of(rows) if rows else None

    def forget_except(self, entry: str) -> None:
        """`entry` is stage 0 now: end every request of another one."""
        if self.current not in (None, entry):
            self.retired.add(self.current)
        self.current = entry
        for rid, owner in list(self.owner.items()):
            if owner != entry:
                self._end_here(rid)

    def drop(self, request_id: str) -> None:
        self.owner.pop(request_id, None)


def from_cache(start: RequestStart | None) -> FromCache | None:
    """What a request's first step tells the worker about its slot (the prefix cache); None: a free slot."""
    if start is None or not (start.cache_entry or start.drop):
        return None
    return FromCache(start.cache_entry, start.take, start.drop)


def compute(step: Step, worker: Worker, items: list) -> tuple[list, float]:
    """On the compute thread: tell the worker of replayed requests, free the slots of ended ones and the KV of
    dropped prefix-cache entries, then run
    the step's items as one batch. Returns the results and the step's wall time in ms."""
    for rid in step.restart:
        worker.restart(rid)
    for rid, keep_as in step.release:
        worker.release(rid, keep_as=keep_as)
    if step.forget:
        worker.forget(step.forget)
    ms: list[float] = []
    with timed(ms):
        results = worker.run(items) if items else []
    return results, ms[0]


def step_failed(step: Step, queue: StageQueue, error: str, *, live: Callable[[str, int], bool],
                fail: Callable[[str, str], list]) -> list:
    """The compute of a step raised (not a WorkerError refusing one item: something nobody expected). Each
    live request with rows in it fails with `error`, since its KV cache may be half-written; the slots the
    step was to free are freed before the next step instead (freeing twice is harmless)."""
    queue.release_again(step.release)
    actions = []
    for rid, generation in dict.fromkeys((u.request_id, u.generation) for u in step.units):
        if live(rid, generation):
            actions += fail(rid, error)
    return actions


def pass_on(step: Step, outcome: tuple[list, float], *, dest: str, live: Callable[[str, int], bool],
            refused: Callable[[Unit, WorkerError], list]) -> list:
    """First and middle stages: the step's rows go on to `dest` as one activation, each segment with this
    stage's compute time appended; a refused item is its request's (`refused` says what follows); rows of
    requests that ended while the step computed, or were replayed meanwhile (`live(request_id, generation)`
    says), are dropped."""
    results, ms = outcome
    segments, actions = [], []
    for unit, out in zip(step.units, results):
        if not live(unit.request_id, unit.generation):
            continue
        if isinstance(out, WorkerError):
            actions += refused(unit, out)
            continue
        meta = SegmentMeta(unit.request_id, unit.position, unit.rows, (*unit.stage_ms, ms), unit.start,
                           unit.generation)
        segments.append((meta, out))
    if segments:
        actions.insert(0, Send(dest, Activation.of(segments)))
    return actions
