"""Stage 0, pp-entry: admits prompts, tokenizes, embeds and runs its blocks; for each token the last stage
feeds back, runs a decode step (docs/design.md, Roles). It also owns every request's life:

- Admission: at most `capacity` requests hold sequence slots at once (the smallest max_seqs of the chain);
  later ones wait in a FIFO of `max_queue`, and past that the entry answers 429 with Retry-After.
- Ending: a request ends here — finished (the last stage's done token), cancelled (the asker), or failed
  (any stage reports it, or stage 0 cannot pass it on). Stage 0 then frees its slot, sends an EndRequest
  down the chain so every stage frees its own, replies the error to the asker for a failure, and starts
  the oldest waiting request. The EndRequest travels the same ordered links as the activations, so each
  stage frees a slot before the rows of the request that takes it next arrive.
- Replay: stage 0 keeps every live request's prompt ids and the tokens generated so far. The node tells it
  which members hold the rest of the chain (`set_chain`): while a stage is missing, nothing is computed
  and new requests wait; when the chain is whole again with a stage replaced, every live request starts
  its next life — prompt and generated tokens prefilled through the new chain, decoding going on where it
  stopped. A request whose rows a stage reports lost is replayed the same way, at once if the chain
  stands (every stage alive), else once it does.
- The prefix cache (roles/prefix.py): a finished request's slot is kept on every stage, its KV an entry
  indexed by its tokens (EndRequest.keep_as). A new request whose tokens share whole blocks with an entry
  starts after them, taking or copying that entry's KV (RequestStart.cached); entries and requests share
  the slots, and an entry is evicted (RequestStart.drop) when a request needs its slot. A request holds
  the entry it copies from until its first token, by which time every stage has copied it. Replays and
  requests that ask for their prompt's logprobs compute every position; a stage that lacks an entry
  reports the request lost, and it is replayed so.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

import attrs

from worker.contract import StepItem, Worker
from worker.errors import PrefixMissing, WorkerError
from worker.partition import Role

from .actions import (PROMPT_INVALID, PROMPT_TOO_LONG, Progress, Refused, Send, compute, error_reply, failure,
                      from_cache, pass_on, step_failed, wrong_role)
from .messages import Activation, CancelRequest, EndReason, EndRequest, InferenceRequest, NextTokens, RequestStart
from .prefix import DEFAULT_BLOCK_SIZE, PrefixIndex, Start, plan_start
from .schedule import StageQueue, Step, Unit, decode_group, prompts_ride
from .topology import stage_name

RETRY_AFTER_S = 1
MAX_REPLAYS = 16  # a request lost more often than this fails: something other than a lost stage is wrong


@attrs.define
class _Live:
    request: InferenceRequest
    prompt: tuple[int, ...]
    queued_ms: float = 0.0
    generated: list[int] = attrs.Factory(list)  # fed back so far: what a replay prefills after the prompt
    generation: int = 0
    replays: int = 0
    lost: bool = False  # a stage lost its rows: replay once the chain stands
    started_from: str = ""  # the prefix-cache entry this life started from
    held: str = ""  # the entry it copies from, held until its first token

    @property
    def next_position(self) -> int:
        """Where the next fed-back token goes: after the prompt and every token fed back so far."""
        return len(self.prompt) + len(self.generated)


class FirstActor:
    role = Role.FIRST

    def __init__(self, stage: int, num_stages: int, *, tokenize: Callable[[str, bool], list[int]], max_context: int,
                 max_rows: int, capacity: int, max_queue: int, clock: Callable[[], float] = time.monotonic,
                 entry: str = "", check_tokens: Callable[[list[int]], None] = lambda ids: None,
                 prompt_rows: int | None = None, prefix_cache: bool = True, block_size: int = DEFAULT_BLOCK_SIZE):
        self.stage, self.num_stages = stage, num_stages
        self.next = stage_name(stage + 1)
        self._tokenize, self.max_context, self.clock = tokenize, max_context, clock
        self._check_tokens = check_tokens  # the worker's: raises WorkerError for ids out of its vocabulary
        self.capacity, self.max_queue, self.entry = capacity, max_queue, entry
        self.queue = StageQueue(max_rows, prompt_rows)
        self.live: dict[str, _Live] = {}
        self.chain: tuple[str, ...] = ()  # the members holding stages 1.. when the chain was last whole
        self.paused = False  # a stage is missing: compute nothing, start nothing
        self._standing = True  # every stage of the chain is alive: a lost request is replayed at once
        self.waiting: collections.OrderedDict[str, tuple[InferenceRequest, list[int], float]] = \
            collections.OrderedDict()
        self.caching, self.prefix = prefix_cache, PrefixIndex(block_size)  # off: no entry is ever kept
        self.cache_queries = self.cache_hits = 0  # prompt tokens looked up, and found cached (vLLM's counters)
        self._dropped: list[str] = []  # entries forgotten here that stages may hold: dropped by the next start
        self._entries_made = 0

    # -- event loop --------------------------------------------------------------------------
    def admit(self, msg) -> list:
        if isinstance(msg, InferenceRequest):
            return self._admit_request(msg)
        if isinstance(msg, NextTokens):
            return self._admit_tokens(msg)
        if isinstance(msg, CancelRequest):
            return self._cancel(msg.request_id)
        if isinstance(msg, EndRequest) and msg.reason is EndReason.LOST:
            return self._lost(msg.request_id, msg.generation)
        if isinstance(msg, EndRequest):  # a stage failed it
            live = self.live.get(msg.request_id)
            return self.end(msg) if live is not None and (msg.generation >= live.generation or msg.poison) else []
        raise wrong_role(self.stage, self.role, msg)

    def plan(self) -> Step | None:
        if self.paused:
            return None
        waiting = {u.request_id for u in self.queue.waiting}
        elsewhere = any(live.generated and not live.lost and rid not in waiting for rid, live in self.live.items())
        replaying = frozenset(rid for rid in waiting if rid in self.live and self.live[rid].generated)
        ride = prompts_ride(elsewhere, self.queue.waiting, replaying)
        return self.queue.next_step(decode_group(len(self.live), self.num_stages), prompts=not ride)

    def finish(self, step: Step, outcome) -> list:
        return pass_on(step, outcome, dest=self.next, live=self.is_live, refused=self._refused)

    def step_failed(self, step: Step, error: str) -> list:
        """The step's compute raised: its requests fail (roles.actions.step_failed)."""
        return step_failed(step, self.queue, error, live=self.is_live, fail=self._fail)

    def undeliverable(self, send: Send, error: str) -> list:
        if not isinstance(send.message, Activation):
            return []  # an EndRequest lost with its stage: nothing left there to free
        actions = []
        for s in send.message.meta.segments:
            actions += self._lost(s.request_id, s.generation)
        return actions

    def set_chain(self, chain: tuple[str, ...] | None, *, standing: bool) -> list:
        """What the node sees of stages 1..: the ids of the members holding them, or None while one is
        missing; `standing`: every one of them is alive (none suspected). Pauses, resumes and replays."""
        self._standing = chain is not None and standing
        if chain is None:
            self.paused = True
            return []
        replaced, self.paused = self.chain not in ((), chain), False
        self.chain = chain
        if replaced:  # the new stage holds no entry
            self._forget_entries(self.prefix.names())
        actions = []
        for rid, live in list(self.live.items()):
            if replaced or (live.lost and standing):
                actions += self._replay(rid)
        return actions + self._start_waiting()

    def prompt_tokens(self, request_id: str) -> int | None:
        """How many prompt tokens an admitted request has (running or waiting); None if unknown here."""
        if (live := self.live.get(request_id)) is not None:
            return len(live.prompt)
        waiting = self.waiting.get(request_id)
        return None if waiting is None else len(waiting[1])

    def is_live(self, request_id: str, generation: int) -> bool:
        """Whether this life of the request is live here (it started, has not ended, no replay since)."""
        live = self.live.get(request_id)
        return live is not None and live.generation == generation

    def end(self, end: EndRequest) -> list:
        """End a live request everywhere, a finished one's KV kept as an entry of the prefix cache; start
        waiting ones in the slots that frees."""
        live = self.live[end.request_id]
        keep = self._keep(live) if end.reason is EndReason.FINISHED else ""  # may raise: nothing changed yet
        del self.live[end.request_id]
        self._release_entry(live)
        self.queue.end(end.request_id, keep)
        actions = [Progress(end.request_id, end=end),
                   Send(self.next, EndRequest(end.request_id, end.reason, keep_as=keep))]
        if end.reason is EndReason.FAILED:
            actions.append(error_reply(live.request.reply_to, end))
        return actions + self._start_waiting()

    def health(self) -> dict:
        return {"slots": {"capacity": self.capacity, "active": len(self.live)},
                "queue": {"waiting": len(self.waiting), "max": self.max_queue},
                "admitting": not self.paused, "replays": sum(live.replays for live in self.live.values()),
                "prefix_cache": {"enabled": self.caching, "block_size": self.prefix.block_size,
                                 "entries": len(self.prefix), "blocks": self.prefix.blocks,
                                 "queries": self.cache_queries, "hits": self.cache_hits}}

    # -- compute thread ----------------------------------------------------------------------
    def run(self, step: Step, worker: Worker):
        return compute(step, worker, [StepItem(u.request_id, u.position, tokens=u.tokens,
                                               from_cache=from_cache(u.start)) for u in step.units])

    # -- internals ---------------------------------------------------------------------------
    def _admit_request(self, req: InferenceRequest) -> list:
        rid = req.request_id
        if rid in self.live or rid in self.waiting:
            raise Refused(409, f"request {rid!r} is already in flight")
        try:
            ids = list(req.prompt_token_ids) or self._tokenize(req.prompt, req.chat)
            if len(ids) >= self.max_context:
                raise Refused(400, f"prompt: {len(ids)} tokens leave no room in the context of {self.max_context}",
                              code=PROMPT_TOO_LONG)
            if req.prompt_token_ids:
                self._check_tokens(ids)  # the worker's check, at admission rather than in a step
        except WorkerError as exc:
            raise Refused(400, f"prompt: {exc}", code=PROMPT_INVALID) from None
        try:
            plan = None if self.waiting or self.paused else self._plan(req, ids)
        except Exception as exc:  # noqa: BLE001 - nothing changed yet: refused alone, as a fault here
            raise Refused(500, f"stage {self.stage}: could not start the request: {_described(exc)}") from None
        if plan is not None:
            self._start(req, ids, 0.0, plan)
        elif len(self.waiting) < self.max_queue:
            self.waiting[rid] = (req, ids, self.clock())
        else:
            raise Refused(429, f"all {self.capacity} sequence slots are busy and {self.max_queue} requests are "
                               f"waiting; retry later", retry_after_s=RETRY_AFTER_S)
        return []

    def _plan(self, req: InferenceRequest, ids: list[int]) -> Start | None:
        """How the request would start now (roles/prefix.py), or None: no slot for it yet."""
        if len(self.live) >= self.capacity:
            return None
        return plan_start(self.prefix, ids, free_slots=self.capacity - len(self.live) - len(self.prefix),
                          use_cache=self._cacheable(req), salt=req.cache_salt)

    def _cacheable(self, req: InferenceRequest) -> bool:
        return self.caching and req.sampling.prompt_logprobs is None  # those need every prompt row's logits

    def _start(self, req: InferenceRequest, ids: list[int], queued_ms: float, plan: Start) -> None:
        live = self.live[req.request_id] = _Live(req, tuple(ids), round(queued_ms, 3))
        entry = plan.match.entry
        self._forget_entries(plan.drop)
        if entry is not None:
            live.started_from = entry
            if plan.take:
                self.prefix.remove(entry)
            else:
                self.prefix.hold(entry)
                live.held = entry
        if self._cacheable(req):
            self.cache_queries, self.cache_hits = self.cache_queries + len(ids), self.cache_hits + plan.match.tokens
        self._send_prefill(req.request_id, live, plan)

    def _send_prefill(self, rid: str, live: _Live, plan: Start = Start()) -> None:
        req, cached = live.request, plan.match.tokens
        drop, self._dropped = tuple(self._dropped), []
        start = RequestStart(req.max_tokens, req.sampling, live.prompt, req.reply_to, live.queued_ms,
                             tuple(live.generated), self.entry, cached, plan.match.entry or "", plan.take, drop)
        ids = (*live.prompt, *live.generated)
        self.queue.add(Unit(rid, cached, len(ids) - cached, decode=False, tokens=ids[cached:], start=start,
                            generation=live.generation))

    def _keep(self, live: _Live) -> str:
        """The name every stage keeps a finished request's KV under, indexed here by its tokens ("": not kept,
        the cache being off or the request short of a whole block)."""
        tokens = (*live.prompt, *live.generated)  # every position whose KV each stage has computed
        if not self.caching or len(tokens) < self.prefix.block_size:
            return ""
        self._entries_made += 1
        name = f"{self.entry}#{self._entries_made}"
        self.prefix.add(name, tokens, live.request.cache_salt)
        return name

    def _release_entry(self, live: _Live) -> None:
        if live.held:
            self.prefix.release(live.held)
            live.held = ""

    def _forget_entries(self, names) -> None:
        """Evict entries here; every stage forgets them with the next request that starts."""
        for name in list(names):
            self.prefix.remove(name)
            self._dropped.append(name)

    def _replay(self, rid: str) -> list:
        """Start the request's next life: its prompt and generated tokens through the chain again."""
        live = self.live[rid]
        if live.replays >= MAX_REPLAYS:
            return self.end(failure(rid, self.stage, f"its rows were lost {live.replays} times; giving up"))
        live.generation, live.replays, live.lost = live.generation + 1, live.replays + 1, False
        self._release_entry(live)
        if live.started_from in self.prefix:  # a stage may have lacked it: no request starts from it again
            self._forget_entries([live.started_from])
        live.started_from = ""
        self.queue.restart(rid)
        self._send_prefill(rid, live)
        return []

    def _lost(self, rid: str, generation: int) -> list:
        """A stage could not pass this life's rows on: replay now if the chain stands, else when it does."""
        if not self.is_live(rid, generation):
            return []  # ended, or already replayed
        self.live[rid].lost = True
        if self.paused or not self._standing:
            return []
        return self._replay(rid)

    def _start_waiting(self) -> list:
        """Start waiting requests, oldest first, while slots can be had. One that cannot start (its planning
        or start raises) fails alone, answered, and the next one is tried: it must not stay first in line and
        raise again at every request's end (which would end none of them)."""
        actions = []
        while self.waiting and not self.paused:
            req, ids, since = next(iter(self.waiting.values()))
            try:
                if (plan := self._plan(req, ids)) is None:
                    break
                del self.waiting[req.request_id]
                self._start(req, ids, (self.clock() - since) * 1000.0, plan)
            except Exception as exc:  # noqa: BLE001 - this request's own fault, whatever it is
                actions += self._failed_to_start(req, _described(exc))
        return actions

    def _failed_to_start(self, req: InferenceRequest, error: str) -> list:
        """A waiting request that could not start: no stage holds anything of it, so it ends here alone."""
        self.waiting.pop(req.request_id, None)
        self.live.pop(req.request_id, None)  # if _start raised half-way; its queue entry came last, never added
        end = failure(req.request_id, self.stage, f"could not start the request: {error}")
        return [Progress(req.request_id, end=end), error_reply(req.reply_to, end)]

    def _admit_tokens(self, msg: NextTokens) -> list:
        for t in msg.tokens:  # taken whole or refused whole
            live = self.live.get(t.request_id)
            if live is None and not self.queue.ended(t.request_id):
                raise Refused(404, f"unknown request {t.request_id!r} at stage 0 (never started, or ended)")
            if live is not None and t.generation != live.generation:
                continue  # sampled in a life a replay has replaced: checked and dropped below
            if live is not None and t.position != live.next_position:
                raise Refused(409, f"request {t.request_id!r}: token for position {t.position}, "
                                   f"expected {live.next_position}")
        actions = []
        for t in msg.tokens:
            live = self.live.get(t.request_id)
            if live is None or t.generation != live.generation:
                continue  # ended here, or replayed, while the token was on its way
            try:  # each token on its own: one request's fault here fails it, not the others of the message
                self._take_token(t, live, actions)
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this request's
                actions += self._fail(t.request_id, _described(exc)) if t.request_id in self.live else []
        return actions

    def _take_token(self, t, live: _Live, actions: list) -> None:
        """Apply one fed-back token, appending what follows to `actions` (kept if a later part raises)."""
        actions.append(Progress(t.request_id, t.token_id, t.done, logprob=t.logprob,
                                prompt_logprobs=t.prompt_logprobs))
        if live.held:  # every stage has computed its first rows, so copied the entry's
            self._release_entry(live)
            actions += self._start_waiting()
        if t.done:
            actions += self.end(EndRequest(t.request_id, EndReason.FINISHED))
        else:
            live.generated.append(t.token_id)  # t.position was next_position: it moves on by one
            self.queue.add(Unit(t.request_id, t.position, 1, decode=True, tokens=(t.token_id,),
                                generation=live.generation))

    def _refused(self, unit: Unit, error: WorkerError) -> list:
        """The worker refused a request's rows: a prefix-cache entry it lacks means a replay from the first
        token; anything else fails the request."""
        if isinstance(error, PrefixMissing):
            self.live[unit.request_id].lost = True
            return self._replay(unit.request_id)
        return self._fail(unit.request_id, str(error))

    def _fail(self, request_id: str, error: str) -> list:
        """Computing the request failed here: it ends, never replayed."""
        return self.end(failure(request_id, self.stage, error, poison=True))

    def _cancel(self, request_id: str) -> list:
        if self.waiting.pop(request_id, None) is not None:  # never started: nothing holds a slot for it
            return [Progress(request_id, end=EndRequest(request_id, EndReason.CANCELLED))]
        if request_id in self.live:
            return self.end(EndRequest(request_id, EndReason.CANCELLED))
        return []  # already over: cancelling is idempotent


def _described(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"
