"""Stage 0: takes prompts, tokenizes, embeds and runs its blocks; then, for each token the last stage
feeds back, runs one decode step (spec §3.3, row First)."""
from __future__ import annotations

from node.wire import Activation, ActivationMeta, InferenceRequest, NextToken, RequestStart
from worker.errors import WorkerError
from worker.partition import Role

from .actions import Refused, Send, error_reply, timed, wrong_role
from .topology import stage_name


class FirstActor:
    role = Role.FIRST

    def __init__(self, stage: int, num_stages: int):
        self.stage, self.num_stages = stage, num_stages
        self.next = stage_name(stage + 1)
        self.current: str | None = None  # admission state; event loop only

    def admit(self, msg) -> None:
        if isinstance(msg, InferenceRequest):
            self.current = msg.request_id  # a new request supersedes the one in flight
        elif isinstance(msg, NextToken):
            if msg.request_id != self.current:
                raise Refused(404, f"unknown request {msg.request_id!r} at stage 0 (never started, or superseded)")
        else:
            raise wrong_role(self.stage, self.role, msg)

    def process(self, msg, worker) -> list:
        try:
            return self._start(msg, worker) if isinstance(msg, InferenceRequest) else self._step(msg, worker)
        except WorkerError as exc:
            worker.release(msg.request_id)
            return [error_reply(self.stage, msg.request_id, msg.reply_to, exc)]

    def _start(self, req: InferenceRequest, worker) -> list:
        ms: list[float] = []
        with timed(ms):
            ids = worker.tokenize(req.prompt, chat=req.chat)
            hidden = worker.embed_and_forward(req.request_id, ids, 0)
        start = RequestStart(req.max_tokens, req.sampling, tuple(ids))
        meta = ActivationMeta(req.request_id, 0, len(ids), True, req.reply_to, tuple(ms), start)
        return [Send(self.next, Activation(meta, hidden))]

    def _step(self, tok: NextToken, worker) -> list:
        if tok.done:
            worker.release(tok.request_id)
            return []
        ms: list[float] = []
        with timed(ms):
            hidden = worker.decode_step(tok.request_id, tok.token_id, tok.position)
        meta = ActivationMeta(tok.request_id, tok.position, 1, False, tok.reply_to, tuple(ms))
        return [Send(self.next, Activation(meta, hidden))]
