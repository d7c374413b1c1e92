"""A middle stage: runs its blocks on each request's rows and passes them on, request id, position and
seq_len unchanged (docs/design.md, Roles), batching whatever is waiting into one step. An EndRequest from
upstream frees the request's slot and goes on down the chain. Rows that cannot be passed on are reported
lost to stage 0, which replays the request (roles/messages.py)."""
from __future__ import annotations

from worker.contract import StepItem, Worker
from worker.partition import Role, Shard

from .actions import (Entries, Held, Send, admit_segments, compute, each_segment, error_reply, failure, from_cache,
                      lost, pass_on, wrong_role)
from .downstream import DownstreamActor
from .messages import Activation, EndReason, EndRequest
from .schedule import StageQueue, Step, Unit
from .topology import stage_name


class MiddleActor(DownstreamActor):
    role = Role.MIDDLE

    def __init__(self, shard: Shard, *, max_rows: int, prompt_rows: int | None = None):
        self.shard, self.stage = shard, shard.index
        self.next, self.entry = stage_name(shard.index + 1), stage_name(0)
        self.queue = StageQueue(max_rows, prompt_rows)
        self.entries = Entries(self._end_here)
        self.expected: dict[str, Held] = {}  # live requests: their life and where their next rows start
        self.reply_to: dict[str, str | None] = {}
        self.prompt_len: dict[str, int] = {}
        self.missed: set[tuple[str, int]] = set()  # lives whose prefix-cache entry is not held here

    # -- event loop --------------------------------------------------------------------------
    def admit(self, msg) -> list:
        if isinstance(msg, EndRequest):
            if not self._reclaimed(msg):
                self._end_here(msg.request_id, keep_as=msg.keep_as)
            return [Send(self.next, msg)]
        if not isinstance(msg, Activation):
            raise wrong_role(self.stage, self.role, msg)
        if (msg := self.entries.admit(msg)) is None:
            return []
        return each_segment(admit_segments(self.expected, self.queue, msg, self.stage), self._take, self._fail)

    def _take(self, s, hidden: bytes) -> None:
        if s.start is not None:
            if s.generation > 0:  # a replay: the slot of the earlier life is overwritten
                self.queue.restart(s.request_id)
            self.reply_to[s.request_id] = s.start.reply_to
            self.prompt_len[s.request_id] = s.start.prefill_len
        decode = s.position >= self.prompt_len[s.request_id]
        self.queue.add(Unit(s.request_id, s.position, s.seq_len, decode, hidden=hidden, stage_ms=s.stage_ms,
                            start=s.start, generation=s.generation))

    def finish(self, step: Step, outcome) -> list:
        return pass_on(step, outcome, dest=self.next, live=self.is_live, refused=self._refused)

    def undeliverable(self, send: Send, error: str) -> list:
        """Rows that could not go on are reported lost to stage 0, which replays their requests (the slot
        here is kept: the replay overwrites it); a failure report that could not reach stage 0 goes to the
        asker directly."""
        if isinstance(send.message, Activation):
            problem = f"could not deliver Activation to {send.dest}: {error}"
            live = {s.request_id: s.generation for s in send.message.meta.segments
                    if self.is_live(s.request_id, s.generation)}
            return [Send(self.entry, lost(rid, self.stage, gen, problem)) for rid, gen in live.items()]
        end = send.message
        if end.reason is EndReason.LOST:
            return []  # stage 0 is gone: its requests went with it
        if send.dest == self.entry and end.error is not None and end.request_id in self.reply_to:
            return [error_reply(self.reply_to.pop(end.request_id), end)]
        return []

    # -- compute thread ----------------------------------------------------------------------
    def run(self, step: Step, worker: Worker):
        return compute(step, worker, [StepItem(u.request_id, u.position, hidden=u.hidden, seq_len=u.rows,
                                               from_cache=from_cache(u.start)) for u in step.units])

    # -- internals ---------------------------------------------------------------------------
    def _fail(self, request_id: str, error: str, param: str = "") -> list:
        """Computing the request failed: report it to stage 0, which ends it everywhere (never replaying it)
        and tells the asker."""
        held = self.expected.get(request_id)
        end = failure(request_id, self.stage, error, held.generation if held else 0, poison=True, param=param)
        self._end_here(request_id, keep_reply_to=True)
        return [Send(self.entry, end)]

    def _end_here(self, request_id: str, *, keep_reply_to: bool = False, keep_as: str = "") -> list:
        if not self.queue.ended(request_id):
            self.queue.end(request_id, keep_as)
        self._forget_life(request_id)
        if not keep_reply_to:
            self.reply_to.pop(request_id, None)
        return []

    def _forget_life(self, request_id: str) -> None:
        self._forget_missed(request_id)
        self.expected.pop(request_id, None)
        self.entries.drop(request_id)
        self.prompt_len.pop(request_id, None)

