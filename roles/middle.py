"""A middle stage: runs its blocks on each activation and passes it on, request id, position,
seq_len and prefill flag unchanged (spec §3.3, row Middle)."""
from __future__ import annotations

import attrs

from node.wire import Activation
from worker.errors import WorkerError
from worker.partition import Role

from .actions import Send, admit_activation, error_reply, timed
from .topology import stage_name


class MiddleActor:
    role = Role.MIDDLE

    def __init__(self, stage: int, num_stages: int):
        self.stage, self.num_stages = stage, num_stages
        self.next = stage_name(stage + 1)
        self.current: str | None = None

    def admit(self, msg) -> None:
        self.current = admit_activation(self.current, msg, self.stage, self.role)

    def process(self, act: Activation, worker) -> list:
        m = act.meta
        ms: list[float] = []
        try:
            with timed(ms):
                hidden = worker.forward_range(m.request_id, act.hidden, m.position, m.seq_len)
        except WorkerError as exc:
            worker.release(m.request_id)
            return [error_reply(self.stage, m.request_id, m.reply_to, exc)]
        meta = attrs.evolve(m, stage_ms=(*m.stage_ms, *ms))
        return [Send(self.next, Activation(meta, hidden))]
