"""Stage 0, pp-entry: admits prompts, tokenizes, embeds and runs its blocks; for each token the last stage
feeds back, runs a decode step (spec §3.3, row First). It also owns every request's life:

- Admission: at most `capacity` requests hold sequence slots at once (the smallest max_seqs of the chain);
  later ones wait in a FIFO of `max_queue`, and past that the entry answers 429 with Retry-After.
- Ending: a request ends here — finished (the last stage's done token), cancelled (the asker), or failed
  (any stage reports it, or stage 0 cannot pass it on). Stage 0 then frees its slot, sends an EndRequest
  down the chain so every stage frees its own, replies the error to the asker for a failure, and starts
  the oldest waiting request. The EndRequest travels the same ordered links as the activations, so each
  stage frees a slot before the rows of the request that takes it next arrive.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

import attrs

from worker.errors import WorkerError
from worker.partition import Role
from worker.stage import StepItem

from .actions import Progress, Refused, Send, compute, error_reply, failure, pass_on, wrong_role
from .messages import Activation, CancelRequest, EndReason, EndRequest, InferenceRequest, NextTokens, RequestStart
from .schedule import StageQueue, Step, Unit
from .topology import stage_name

RETRY_AFTER_S = 1


@attrs.define
class _Live:
    request: InferenceRequest
    next_position: int  # where the next fed-back token goes


class FirstActor:
    role = Role.FIRST

    def __init__(self, stage: int, num_stages: int, *, tokenize: Callable[[str, bool], list[int]], max_context: int,
                 max_rows: int, capacity: int, max_queue: int, clock: Callable[[], float] = time.monotonic):
        self.stage, self.num_stages = stage, num_stages
        self.next = stage_name(stage + 1)
        self._tokenize, self.max_context, self.clock = tokenize, max_context, clock
        self.capacity, self.max_queue = capacity, max_queue
        self.queue = StageQueue(max_rows)
        self.live: dict[str, _Live] = {}
        self.waiting: collections.OrderedDict[str, tuple[InferenceRequest, list[int], float]] = \
            collections.OrderedDict()

    # -- event loop --------------------------------------------------------------------------
    def admit(self, msg) -> list:
        if isinstance(msg, InferenceRequest):
            return self._admit_request(msg)
        if isinstance(msg, NextTokens):
            return self._admit_tokens(msg)
        if isinstance(msg, CancelRequest):
            return self._cancel(msg.request_id)
        if isinstance(msg, EndRequest):  # a stage failed it
            return self.end(msg) if msg.request_id in self.live else []
        raise wrong_role(self.stage, self.role, msg)

    def plan(self) -> Step | None:
        return self.queue.next_step()

    def finish(self, step: Step, outcome) -> list:
        return pass_on(step, outcome, dest=self.next, live=self.live.__contains__,
                       fail=lambda rid, error: self.end(failure(rid, self.stage, error)))

    def undeliverable(self, send: Send, error: str) -> list:
        if not isinstance(send.message, Activation):
            return []  # an EndRequest lost with its stage: nothing left there to free
        actions = []
        for s in send.message.meta.segments:
            if s.request_id in self.live:
                problem = f"could not deliver Activation to {send.dest}: {error}"
                actions += self.end(failure(s.request_id, self.stage, problem))
        return actions

    def end(self, end: EndRequest) -> list:
        """End a live request everywhere; start waiting ones in the slots that frees."""
        live = self.live.pop(end.request_id)
        self.queue.end(end.request_id)
        actions = [Progress(end.request_id, end=end), Send(self.next, EndRequest(end.request_id, end.reason))]
        if end.reason is EndReason.FAILED:
            actions.append(error_reply(live.request.reply_to, end))
        self._start_waiting()
        return actions

    def holds(self, request_id: str) -> bool:
        """Whether the request is live at this stage (it started here and has not ended)."""
        return request_id in self.live

    def health(self) -> dict:
        return {"slots": {"capacity": self.capacity, "active": len(self.live)},
                "queue": {"waiting": len(self.waiting), "max": self.max_queue}}

    # -- compute thread ----------------------------------------------------------------------
    def run(self, step: Step, worker):
        return compute(step, worker, [StepItem(u.request_id, u.position, tokens=u.tokens) for u in step.units])

    # -- internals ---------------------------------------------------------------------------
    def _admit_request(self, req: InferenceRequest) -> list:
        rid = req.request_id
        if rid in self.live or rid in self.waiting:
            raise Refused(409, f"request {rid!r} is already in flight")
        try:
            ids = list(req.prompt_token_ids) or self._tokenize(req.prompt, req.chat)
        except WorkerError as exc:
            raise Refused(400, f"prompt: {exc}") from None
        if len(ids) >= self.max_context:
            raise Refused(400, f"prompt: {len(ids)} tokens leave no room in the context of {self.max_context}")
        if len(self.live) < self.capacity and not self.waiting:
            self._start(req, ids, 0.0)
        elif len(self.waiting) < self.max_queue:
            self.waiting[rid] = (req, ids, self.clock())
        else:
            raise Refused(429, f"all {self.capacity} sequence slots are busy and {self.max_queue} requests are "
                               f"waiting; retry later", retry_after_s=RETRY_AFTER_S)
        return []

    def _start(self, req: InferenceRequest, ids: list[int], queued_ms: float) -> None:
        self.live[req.request_id] = _Live(req, len(ids))
        start = RequestStart(req.max_tokens, req.sampling, tuple(ids), req.reply_to, round(queued_ms, 3))
        self.queue.add(Unit(req.request_id, 0, len(ids), decode=False, tokens=tuple(ids), start=start))

    def _start_waiting(self) -> None:
        while self.waiting and len(self.live) < self.capacity:
            _, (req, ids, since) = self.waiting.popitem(last=False)
            self._start(req, ids, (self.clock() - since) * 1000.0)

    def _admit_tokens(self, msg: NextTokens) -> list:
        for t in msg.tokens:  # taken whole or refused whole
            live = self.live.get(t.request_id)
            if live is None and not self.queue.ended(t.request_id):
                raise Refused(404, f"unknown request {t.request_id!r} at stage 0 (never started, or ended)")
            if live is not None and t.position != live.next_position:
                raise Refused(409, f"request {t.request_id!r}: token for position {t.position}, "
                                   f"expected {live.next_position}")
        actions = []
        for t in msg.tokens:
            if t.request_id not in self.live:
                continue  # ended here while the token was on its way
            actions.append(Progress(t.request_id, t.token_id, t.done))
            if t.done:
                actions += self.end(EndRequest(t.request_id, EndReason.FINISHED))
            else:
                self.live[t.request_id].next_position = t.position + 1
                self.queue.add(Unit(t.request_id, t.position, 1, decode=True, tokens=(t.token_id,)))
        return actions

    def _cancel(self, request_id: str) -> list:
        if self.waiting.pop(request_id, None) is not None:  # never started: nothing holds a slot for it
            return [Progress(request_id, end=EndRequest(request_id, EndReason.CANCELLED))]
        if request_id in self.live:
            return self.end(EndRequest(request_id, EndReason.CANCELLED))
        return []  # already over: cancelling is idempotent
