"""Stage 0's door (roles/first.py): a new request's prompt checked and tokenized, and, while no sequence slot
can be had for it, its place in a FIFO of `max_queue`; past that it is refused with 429 and Retry-After.
No I/O: stage 0 decides when a slot frees, and which request starts in it, with the functions it passes."""
from __future__ import annotations

import collections
from typing import Callable

from worker.errors import WorkerError

from .actions import PROMPT_INVALID, PROMPT_TOO_LONG, Progress, Refused, error_reply, failure
from .messages import EndReason, EndRequest, InferenceRequest
from .prefix import Start

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, stage: int, *, tokenize: Callable[[str, bool], list[int]], max_context: int, max_queue: int,
                 clock: Callable[[], float], check_tokens: Callable[[list[int]], None]):
        self.stage, self.max_queue, self.clock = stage, max_queue, clock
        self._tokenize, self.max_context = tokenize, max_context
        self._check_tokens = check_tokens  # the worker's: raises WorkerError for ids out of its vocabulary
        self.waiting: collections.OrderedDict[str, tuple[InferenceRequest, list[int], float]] = \
            collections.OrderedDict()

    def prompt_ids(self, req: InferenceRequest) -> list[int]:
        """The request's prompt ids, tokenized here unless it brings them; refused (400) if they cannot be."""
        try:
            ids = list(req.prompt_token_ids) or self._tokenize(req.prompt, req.chat)
            if len(ids) >= self.max_context:
                raise Refused(400, f"prompt: {len(ids)} tokens leave no room in the context of {self.max_context}",
                              code=PROMPT_TOO_LONG)
            if req.prompt_token_ids:
                self._check_tokens(ids)  # the worker's check, at admission rather than in a step
        except WorkerError as exc:
            raise Refused(400, f"prompt: {exc}", code=PROMPT_INVALID) from None
        return ids

    def wait(self, req: InferenceRequest, ids: list[int], capacity: int) -> None:
        """Queue a request no slot can be had for yet; refused (429) when the queue is full."""
        if len(self.waiting) >= self.max_queue:
            raise Refused(429, f"all {capacity} sequence slots are busy and {self.max_queue} requests are "
                               f"waiting; retry later", retry_after_s=RETRY_AFTER_S)
        self.waiting[req.request_id] = (req, ids, self.clock())

    def wait_first(self, req: InferenceRequest, ids: list[int]) -> None:
        """A preempted request (roles/kv_budget.py) waits first in line, whatever the queue's length: it was
        admitted once, and what it has generated is kept."""
        self.waiting[req.request_id] = (req, ids, self.clock())
        self.waiting.move_to_end(req.request_id, last=False)

    def start_waiting(self, plan: Callable[[InferenceRequest, list[int]], Start | None],
                      start: Callable[[InferenceRequest, list[int], float, Start], None]) -> list:
        """Start waiting requests, oldest first, while `plan` finds a slot; `start` takes the time each waited
        (ms). One that cannot start (its planning or start raises) fails alone, answered, and the next one is
        tried: it must not stay first in line and raise again at every request's end (which would end none of
        them)."""
        actions = []
        while self.waiting:
            req, ids, since = next(iter(self.waiting.values()))
            try:
                if (planned := plan(req, ids)) is None:
                    break
                del self.waiting[req.request_id]
                start(req, ids, (self.clock() - since) * 1000.0, planned)
            except Exception as exc:  # noqa: BLE001 - this request's own fault, whatever it is
                actions += self._failed_to_start(req, described(exc))
        return actions

    def cancel(self, request_id: str) -> list:
        """Drop a waiting request quietly: nothing holds a slot for it ([]: it is not waiting)."""
        if self.waiting.pop(request_id, None) is None:
            return []
        return [Progress(request_id, end=EndRequest(request_id, EndReason.CANCELLED))]

    def prompt_tokens(self, request_id: str) -> int | None:
        waiting = self.waiting.get(request_id)
        return None if waiting is None else len(waiting[1])

    def _failed_to_start(self, req: InferenceRequest, error: str) -> list:
        """A waiting request that could not start: no stage holds anything of it, so it ends here alone."""
        self.waiting.pop(req.request_id, None)
        end = failure(req.request_id, self.stage, f"could not start the request: {error}")
        return [Progress(req.request_id, end=end), error_reply(req.reply_to, end)]


def described(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"
