"""A middle stage: runs its blocks on each request's rows and passes them on, request id, position and
seq_len unchanged (spec §3.3, row Middle), batching whatever is waiting into one step. An EndRequest from
upstream frees the request's slot and goes on down the chain."""
from __future__ import annotations

from worker.partition import Role
from worker.stage import StepItem

from .actions import Send, admit_segments, compute, error_reply, failure, pass_on, wrong_role
from .messages import Activation, EndRequest
from .schedule import StageQueue, Step, Unit
from .topology import stage_name


class MiddleActor:
    role = Role.MIDDLE

    def __init__(self, stage: int, num_stages: int, *, max_rows: int):
        self.stage, self.num_stages = stage, num_stages
        self.next, self.entry = stage_name(stage + 1), stage_name(0)
        self.queue = StageQueue(max_rows)
        self.expected: dict[str, int] = {}  # live requests: the position their next rows start at
        self.reply_to: dict[str, str | None] = {}
        self.prompt_len: dict[str, int] = {}

    # -- event loop --------------------------------------------------------------------------
    def admit(self, msg) -> list:
        if isinstance(msg, EndRequest):
            return self._end_here(msg.request_id) + [Send(self.next, msg)]
        if not isinstance(msg, Activation):
            raise wrong_role(self.stage, self.role, msg)
        for s, hidden in admit_segments(self.expected, self.queue, msg, self.stage):
            if s.start is not None:
                self.reply_to[s.request_id] = s.start.reply_to
                self.prompt_len[s.request_id] = len(s.start.prompt_token_ids)
            decode = s.position >= self.prompt_len[s.request_id]
            self.queue.add(Unit(s.request_id, s.position, s.seq_len, decode, hidden=hidden, stage_ms=s.stage_ms,
                                start=s.start))
        return []

    def plan(self) -> Step | None:
        return self.queue.next_step()

    def finish(self, step: Step, outcome) -> list:
        return pass_on(step, outcome, dest=self.next, live=self.expected.__contains__, fail=self._fail)

    def undeliverable(self, send: Send, error: str) -> list:
        """Rows that could not go on fail their requests; a failure report that could not reach stage 0
        goes to the asker directly."""
        if isinstance(send.message, Activation):
            actions = []
            for s in send.message.meta.segments:
                if s.request_id in self.expected:
                    actions += self._fail(s.request_id, f"could not deliver Activation to {send.dest}: {error}")
            return actions
        end = send.message
        if send.dest == self.entry and end.error is not None and end.request_id in self.reply_to:
            return [error_reply(self.reply_to.pop(end.request_id), end)]
        return []

    def holds(self, request_id: str) -> bool:
        """Whether the request is live at this stage (it started here and has not ended)."""
        return request_id in self.expected

    def health(self) -> dict:
        return {"slots": {"active": len(self.expected)}}

    # -- compute thread ----------------------------------------------------------------------
    def run(self, step: Step, worker):
        return compute(step, worker, [StepItem(u.request_id, u.position, hidden=u.hidden, seq_len=u.rows)
                                      for u in step.units])

    # -- internals ---------------------------------------------------------------------------
    def _fail(self, request_id: str, error: str) -> list:
        """Report to stage 0, which ends the request everywhere and tells the asker."""
        end = failure(request_id, self.stage, error)
        self._end_here(request_id, keep_reply_to=True)
        return [Send(self.entry, end)]

    def _end_here(self, request_id: str, *, keep_reply_to: bool = False) -> list:
        if not self.queue.ended(request_id):
            self.queue.end(request_id)
        self.expected.pop(request_id, None)
        self.prompt_len.pop(request_id, None)
        if not keep_reply_to:
            self.reply_to.pop(request_id, None)
        return []

