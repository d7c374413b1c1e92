"""The last stage: runs its blocks, the final norm and head, samples, feeds each token back to stage 0,
and when a request ends detokenizes and replies to whoever asked (docs/design.md, Roles). One step samples
for every request whose rows in it end its prompt or are a decode row. A replay's first rows hold the
prompt and the tokens generated before it: sampling goes on after them, and the answer holds them all."""
from __future__ import annotations

import time
from typing import Callable

import attrs

from worker.contract import GREEDY, StepItem, TokenLogprob, Worker
from worker.errors import InvalidParam, WorkerError
from worker.grammar import GrammarError, Matcher
from worker.logprobs import token_logprobs
from worker.partition import Role, Shard
from worker.sampling import stop_set
from worker.stopping import generation_done

from .actions import (Entries, Held, Reply, Send, admit_segments, compute, each_segment, error_reply, failure,
                      from_cache, wrong_role)
from .downstream import DownstreamActor
from .messages import Activation, EndRequest, InferenceResponse, NextTokens, RequestStart, Token
from .schedule import StageQueue, Step, Unit
from .topology import stage_name


@attrs.define
class _Progress:
    start: RequestStart
    tokens: list[int]
    stage_ms: list[float]  # compute per stage, summed over the request's steps
    stops: frozenset[int]  # what ends it: the model's stop ids (unless ignore_eos) and its stop_token_ids
    first_token_at: float = 0.0  # clock() when the first token was sampled
    sampled_at: list[float] = attrs.field(factory=list)  # clock() at each token
    prompt_logprobs: list[TokenLogprob] = attrs.field(factory=list)  # asked for: sent with the first token
    matcher: Matcher | None = None  # constrained decoding: made and used on the compute thread only

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The prompt's logprobs were asked for and not yet sent (a replay's first token is not the first)."""
        return self.start.sampling.prompt_logprobs is not None and not self.start.replayed


@attrs.frozen
class _Sampled:
    """What the compute thread made of one item's logits."""

    token_id: int | None  # None: a prompt chunk before the last, nothing sampled
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # of the prompt tokens after these rows' positions


class LastActor(DownstreamActor):
    role = Role.LAST

    def __init__(self, shard: Shard, *, max_rows: int, prompt_rows: int | None = None,
                 detokenize: Callable[[list[int]], str],
                 stop_ids: frozenset[int], max_context: int, clock: Callable[[], float] = time.monotonic):
        self.shard, self.stage = shard, shard.index
        self.feedback = stage_name(0)  # the first stage owns the embedding, so tokens go back there
        self.queue = StageQueue(max_rows, prompt_rows)
        self.entries = Entries(self._end_here)
        self.expected: dict[str, Held] = {}
        self.progress: dict[str, _Progress] = {}
        self.failed_reply_to: dict[str, str | None] = {}  # until stage 0 has heard of the failure
        self.missed: set[tuple[str, int]] = set()  # lives whose prefix-cache entry is not held here
        self.detokenize, self.stop_ids, self.max_context, self.clock = detokenize, stop_ids, max_context, clock

    # -- event loop --------------------------------------------------------------------------
    def admit(self, msg) -> list:
        if isinstance(msg, EndRequest):
            if self._reclaimed(msg):
                return []
            self._end_here(msg.request_id, keep_as=msg.keep_as)
            self.failed_reply_to.pop(msg.request_id, None)
            return []
        if not isinstance(msg, Activation):
            raise wrong_role(self.stage, self.role, msg)
        if (msg := self.entries.admit(msg)) is None:
            return []
        return each_segment(admit_segments(self.expected, self.queue, msg, self.stage), self._take, self._fail)

    def _take(self, s, hidden: bytes) -> None:
        if s.start is not None:
            if s.generation > 0:  # a replay: the slot of the earlier life is overwritten
                self.queue.restart(s.request_id)
            now = self.clock()
            self.progress[s.request_id] = _Progress(s.start, list(s.start.replayed), [0.0] * self.shard.count,
                                                    stop_set(self.stop_ids, s.start.sampling),
                                                    now, [now] * len(s.start.replayed))
        prefill = self.progress[s.request_id].start.prefill_len
        self.queue.add(Unit(s.request_id, s.position, s.seq_len, s.position >= prefill, hidden=hidden,
                            stage_ms=s.stage_ms, start=s.start, sample=s.position + s.seq_len >= prefill,
                            generation=s.generation))

    def finish(self, step: Step, outcome) -> list:
        results, ms = outcome
        tokens, actions = [], []
        for unit, out in zip(step.units, results):
            prog = self.progress.get(unit.request_id)
            if prog is None or not self.is_live(unit.request_id, unit.generation):
                continue  # ended, or replayed, while this step computed
            if isinstance(out, WorkerError):
                actions += self._refused(unit, out)
                continue
            for i, t in enumerate((*unit.stage_ms, ms)):
                prog.stage_ms[i] += t
            prog.prompt_logprobs += out.prompt_logprobs
            if out.token_id is None:
                continue  # a prompt chunk before the last: nothing to sample yet
            token, done = self._sampled(unit, prog, out)
            tokens.append(token)
            if done:
                actions.append(self._finish(unit.request_id, prog))
        if tokens:
            actions.append(Send(self.feedback, NextTokens(tuple(tokens))))
        return actions

    def undeliverable(self, send: Send, error: str) -> list:
        """Tokens that cannot reach stage 0 end their requests; the asker hears it from here."""
        actions = []
        if isinstance(send.message, NextTokens):
            for t in send.message.tokens:
                prog = self.progress.get(t.request_id)
                if prog is not None:
                    end = failure(t.request_id, self.stage, f"could not deliver NextTokens to {send.dest}: {error}")
                    self._end_here(t.request_id)
                    actions.append(error_reply(prog.start.reply_to, end))
                elif t.done:  # answered, but stage 0 will not end it: free its slot here
                    self._end_here(t.request_id)
        elif isinstance(send.message, EndRequest) and send.message.request_id in self.failed_reply_to:
            actions.append(error_reply(self.failed_reply_to.pop(send.message.request_id), send.message))
        return actions

    # -- compute thread ----------------------------------------------------------------------
    def run(self, step: Step, worker: Worker):
        """Compute the step, then sample for each item whose rows end its prompt or are a decode row: per
        item, a _Sampled (its token, or None for a prompt chunk before the last, and the logprobs asked for)
        or the WorkerError that refused it. A request's progress is read here, on the compute thread: the
        event loop changes it only in `finish`, after the step that sampled its last token."""
        progress = [self.progress.get(u.request_id) for u in step.units]
        every_row = [p is not None and p.wants_prompt_logprobs and u.position < len(p.start.prompt_token_ids) - 1
                     for u, p in zip(step.units, progress)]
        results, ms = compute(step, worker, [StepItem(u.request_id, u.position, hidden=u.hidden, seq_len=u.rows,
                                                      sampling=u.start.sampling if u.start else GREEDY,
                                                      all_logits=all_rows, logits=u.sample,
                                                      from_cache=from_cache(u.start))
                                             for u, all_rows in zip(step.units, every_row)])
        return [r if isinstance(r, WorkerError) or p is None else self._pick(worker, u, p, r, all_rows)
                for u, p, r, all_rows in zip(step.units, progress, results, every_row)], ms

    def _pick(self, worker: Worker, unit: Unit, prog: _Progress, logits, all_rows: bool) -> _Sampled | WorkerError:
        """Compute thread: the prompt's logprobs of these rows where asked, then the token where one is due."""
        s, prompt_lps = prog.start, ()
        if all_rows:  # row i's logits predict the prompt token at position + i + 1
            ids = s.prompt_token_ids
            n = min(unit.rows, len(ids) - 1 - unit.position)
            prompt_lps = tuple(token_logprobs(logits[:n], ids[unit.position + 1:unit.position + 1 + n],
                                              s.sampling.prompt_logprobs))
            logits = logits[-1]
        if not unit.sample:
            return _Sampled(None, prompt_logprobs=prompt_lps)
        try:
            matcher = self._matcher(worker, prog)
            token = worker.sample(unit.request_id, logits, prompt_ids=s.prompt_token_ids,
                                  output_ids=tuple(prog.tokens), stop_ids=prog.stops,
                                  allowed=None if matcher is None else matcher.allowed())
            if matcher is not None:
                matcher.accept(token)
        except (WorkerError, GrammarError) as exc:  # logits that are not finite, say: this request fails alone
            return exc if isinstance(exc, WorkerError) else InvalidParam("response_format", str(exc))
        asked = s.sampling.logprobs
        logprob = None if asked is None else token_logprobs(logits[None], [token], asked)[0]
        return _Sampled(token, logprob, prompt_lps)

    # -- internals ---------------------------------------------------------------------------
    def _sampled(self, unit: Unit, prog: _Progress, out: _Sampled) -> tuple[Token, bool]:
        token_id = out.token_id
        prog.tokens.append(token_id)
        prog.sampled_at.append(self.clock())
        prompt_lps = ()
        if len(prog.tokens) == 1:
            prog.first_token_at = prog.sampled_at[0]
            prompt_lps, prog.prompt_logprobs = tuple(prog.prompt_logprobs), []
        position = unit.position + unit.rows
        done = generation_done(token_id, generated=len(prog.tokens), max_tokens=prog.start.max_tokens,
                               next_position=position, max_context=self.max_context, stop_ids=prog.stops)
        return Token(unit.request_id, token_id, position, done, unit.generation, out.logprob, prompt_lps), done

    @staticmethod
    def _matcher(worker: Worker, prog: _Progress) -> Matcher | None:
        """Compute thread: the request's grammar matcher, made at its first token (a replay's walks the
        tokens generated before it)."""
        if not prog.start.sampling.grammar:
            return None
        if prog.matcher is None:
            prog.matcher = worker.grammar_matcher(prog.start.sampling.grammar)
            for token in prog.tokens:
                prog.matcher.accept(token)
        return prog.matcher

    def _finish(self, request_id: str, prog: _Progress) -> Reply:
        text = self.detokenize([t for t in prog.tokens if t not in self.stop_ids])
        self._done_here(request_id)
        s = prog.start
        return Reply(s.reply_to, InferenceResponse(
            request_id, text, tuple(prog.tokens), s.prompt_token_ids, tuple(round(ms, 3) for ms in prog.stage_ms),
            prog.sampled_at[-1] - prog.first_token_at,
            tuple(round((t - prog.first_token_at) * 1000.0, 3) for t in prog.sampled_at), s.queued_ms / 1000.0))

    def _fail(self, request_id: str, error: str, param: str = "") -> list:
        """Computing the request failed: report it to stage 0, which ends it everywhere (never replaying it)
        and tells the asker. `param`: the request's own parameter that failed it (a 400 for the client)."""
        prog, held = self.progress.get(request_id), self.expected.get(request_id)
        self.failed_reply_to[request_id] = prog.start.reply_to if prog is not None else None
        generation = held.generation if held is not None else 0
        self._end_here(request_id)
        return [Send(self.feedback, failure(request_id, self.stage, error, generation, poison=True, param=param))]

    def _done_here(self, request_id: str) -> None:
        """Answered: nothing more is computed for it, but its slot waits for stage 0's EndRequest, which says
        whether every stage keeps its KV (the prefix cache)."""
        self.expected.pop(request_id, None)
        self.progress.pop(request_id, None)
        self._forget_missed(request_id)

    def _end_here(self, request_id: str, *, keep_as: str = "") -> None:
        if not self.queue.ended(request_id):
            self.queue.end(request_id, keep_as)
        self._forget_life(request_id)

    def _forget_life(self, request_id: str) -> None:
        self._forget_missed(request_id)
        self.expected.pop(request_id, None)
        self.entries.drop(request_id)
        self.progress.pop(request_id, None)

