"""The last stage: runs its blocks, the final norm and head, samples, feeds the token back to stage 0,
and when the request ends detokenizes and replies to whoever asked (spec §3.3, row Last)."""
from __future__ import annotations

import time

import attrs

from node.wire import Activation, InferenceResponse, NextToken, RequestStart
from worker.errors import WorkerError
from worker.partition import Role
from worker.stopping import generation_done

from .actions import Reply, Send, admit_activation, error_reply, timed
from .topology import stage_name


@attrs.define
class _Progress:
    start: RequestStart
    tokens: list[int]
    stage_ms: list[float]  # compute per stage, summed over the request's steps
    first_token_at: float = 0.0  # time.monotonic() when the first token was sampled


class LastActor:
    role = Role.LAST

    def __init__(self, stage: int, num_stages: int):
        self.stage, self.num_stages = stage, num_stages
        self.feedback = stage_name(0)  # the first stage owns the embedding, so tokens go back there
        self.current: str | None = None  # admission state; event loop only
        self._progress: dict[str, _Progress] = {}  # compute thread only

    def admit(self, msg) -> None:
        self.current = admit_activation(self.current, msg, self.stage, self.role)

    def process(self, act: Activation, worker) -> list:
        m = act.meta
        try:
            return self._step(act, worker)
        except WorkerError as exc:
            worker.release(m.request_id)
            self._progress.pop(m.request_id, None)
            return [error_reply(self.stage, m.request_id, m.reply_to, exc)]

    def _step(self, act: Activation, worker) -> list:
        m = act.meta
        if m.is_prefill:  # one request at a time, as the worker: a new one supersedes
            self._progress = {m.request_id: _Progress(m.start, [], [0.0] * self.num_stages)}
        prog = self._progress.get(m.request_id)
        if prog is None:
            raise WorkerError(f"unknown request {m.request_id!r} (never started here, finished, or superseded)")
        ms: list[float] = []
        with timed(ms):
            sampled = worker.forward_and_sample(m.request_id, act.hidden, m.position, m.seq_len, prog.start.sampling)
        for i, t in enumerate((*m.stage_ms, *ms)):
            prog.stage_ms[i] += t
        prog.tokens.append(sampled.token_id)
        if len(prog.tokens) == 1:
            prog.first_token_at = time.monotonic()
        position = m.position + m.seq_len
        done = generation_done(sampled.token_id, generated=len(prog.tokens), max_tokens=prog.start.max_tokens,
                               next_position=position, max_context=worker.info.max_context,
                               stop_ids=worker.info.stop_ids)
        feedback = Send(self.feedback, NextToken(m.request_id, sampled.token_id, position, done, m.reply_to))
        if not done:
            return [feedback]
        return [self._finish(m.request_id, m.reply_to, prog, worker), feedback]

    def _finish(self, request_id: str, reply_to: str | None, prog: _Progress, worker) -> Reply:
        text = worker.detokenize([t for t in prog.tokens if t not in worker.info.stop_ids])
        worker.release(request_id)
        del self._progress[request_id]
        return Reply(reply_to, InferenceResponse(request_id, text, tuple(prog.tokens), prog.start.prompt_token_ids,
                                                 tuple(prog.stage_ms), time.monotonic() - prog.first_token_at))
