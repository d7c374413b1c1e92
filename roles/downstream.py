"""What the stages after the first share: a queue of rows that arrived from the stage before, and the
life (generation) of each request they hold, which a replay by stage 0 moves on."""
from __future__ import annotations

from worker.errors import InvalidParam, PrefixMissing, WorkerError

from .actions import Send, is_live, lost, step_failed
from .messages import EndReason, EndRequest
from .schedule import Step, Unit
from .topology import stage_name


class DownstreamActor:
    """Base of MiddleActor and LastActor: each sets `queue` (a StageQueue), `expected` (request id -> the
    Held life it computes), `missed` (an empty set), `_fail(request_id, error, param) -> actions` and
    `_forget_life(request_id)` (what it holds of the request's life, but the slot)."""

    def _reclaimed(self, end: EndRequest) -> bool:
        """Stage 0's KV budget (roles/kv_budget.py): a preempted request's life is over here, its slot freed, or
        an evicted prefix-cache entry's KV goes. False: not such a message."""
        if end.reason is EndReason.DROPPED:
            self.queue.forget(end.request_id)
            return True
        if end.reason is not EndReason.PREEMPTED:
            return False
        held = self.expected.get(end.request_id)
        if held is None or held.generation <= end.generation:  # links keep order: no later life can be here yet
            self.queue.free(end.request_id)
            self._forget_life(end.request_id)
        return True

    def _refused(self, unit: Unit, error: WorkerError) -> list:
        """The worker refused a request's rows. Where the prefix-cache entry its life was to start from is not
        held here, stage 0 hears it once as lost rows (it replays the request from its first token) and the
        life's later rows, which find no request here, are dropped; any other refusal fails the request."""
        life = (unit.request_id, unit.generation)
        if isinstance(error, PrefixMissing):
            self.missed.add(life)
            return [Send(stage_name(0), lost(unit.request_id, self.stage, unit.generation, str(error)))]
        if life in self.missed:
            return []
        return self._fail(unit.request_id, str(error), error.param if isinstance(error, InvalidParam) else "")

    def _forget_missed(self, request_id: str) -> None:
        self.missed = {life for life in self.missed if life[0] != request_id}

    def plan(self) -> Step | None:
        return self.queue.next_step()

    def step_failed(self, step: Step, error: str) -> list:
        """The step's compute raised: its requests fail (roles.actions.step_failed)."""
        return step_failed(step, self.queue, error, live=self.is_live, fail=self._fail)

    def is_live(self, request_id: str, generation: int) -> bool:
        """Whether this life of the request is live here (roles.actions.is_live)."""
        return is_live(self.expected, request_id, generation)

    def health(self) -> dict:
        return {"slots": {"active": len(self.expected)}}
