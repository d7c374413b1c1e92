"""What the stages after the first share: a queue of rows that arrived from the stage before, and the
life (generation) of each request they hold, which a replay by stage 0 moves on."""
from __future__ import annotations

from .actions import is_live, step_failed
from .schedule import Step


class DownstreamActor:
    """Base of MiddleActor and LastActor: each sets `queue` (a StageQueue), `expected` (request id -> the
    Held life it computes) and `_fail(request_id, error) -> actions`."""

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
