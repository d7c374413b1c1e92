"""Stage 0, pp-entry: admits prompts, tokenizes, embeds and runs its blocks; for each token the last stage
feeds back, runs a decode step (docs/design.md, Roles). It also owns every request's life:

- Admission (roles/admission.py): at most `capacity` requests hold sequence slots at once (the smallest
  max_seqs of the chain); later ones wait in a FIFO of `max_queue`, and past that the entry answers 429
  with Retry-After.
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
- The prefix cache (roles/prefix.py decides, roles/prefix_cache.py keeps the books): a finished request's
  slot is kept on every stage, its KV an entry indexed by its tokens (EndRequest.keep_as). A new request
  whose tokens share whole blocks with an entry starts after them, taking or copying that entry's KV
  (RequestStart.cached); entries and requests share the slots, and an entry is evicted (RequestStart.drop)
  when a request needs its slot. A request holds the entry it copies from until its first token, by which
  time every stage has copied it. Replays and requests that ask for their prompt's logprobs compute every
  position; a stage that lacks an entry reports the request lost, and it is replayed so.
"""
from __future__ import annotations

import time
from typing import Callable

import attrs

from worker.contract import StepItem, Worker
from worker.errors import PrefixMissing, WorkerError
from worker.partition import Role, Shard

from .actions import (PROMPT_TOO_LONG, UNKNOWN_REQUEST, Progress, Refused, Send, compute, error_reply, failure,
                      from_cache, pass_on, step_failed, wrong_role)
from .admission import Admission, described
from .kv_budget import KvBook, Room
from .messages import (Activation, CancelRequest, EndReason, EndRequest, InferenceRequest, NextTokens, RequestStart,
                       Token)
from .prefix import DEFAULT_BLOCK_SIZE, Start
from .prefix_cache import PrefixCache
from .schedule import StageQueue, Step, Unit, decode_group, prompts_ride
from .topology import stage_name

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
    resuming: bool = False  # replayed, and no token of the new life has come back yet
    preempted: bool = False  # its KV freed everywhere for lack of room: it waits first in line (roles/kv_budget.py)

    @property
    def next_position(self) -> int:
        """Where the next fed-back token goes: after the prompt and every token fed back so far."""
        return len(self.prompt) + len(self.generated)


class FirstActor:
    role = Role.FIRST

    def __init__(self, shard: Shard, *, tokenize: Callable[[str, bool], list[int]], max_context: int,
                 max_rows: int, capacity: int, max_queue: int, clock: Callable[[], float] = time.monotonic,
                 entry: str = "", check_tokens: Callable[[list[int]], None] = lambda ids: None,
                 prompt_rows: int | None = None, prefix_cache: bool = True, block_size: int = DEFAULT_BLOCK_SIZE):
        self.shard = shard
        self.next = stage_name(shard.index + 1)
        self.capacity, self.entry = capacity, entry
        self.admission = Admission(shard.index, tokenize=tokenize, max_context=max_context, max_queue=max_queue,
                                   clock=clock, check_tokens=check_tokens)
        self.queue = StageQueue(max_rows, prompt_rows)
        self.live: dict[str, _Live] = {}
        self.chain: tuple[str, ...] = ()  # the members holding stages 1.. when the chain was last whole
        self.paused = False  # a stage is missing: compute nothing, start nothing
        self._standing = True  # every stage of the chain is alive: a lost request is replayed at once
        self.cache = PrefixCache(prefix_cache, block_size)
        self.kv = KvBook(self.cache)  # its budget is set once the chain is ready (node/entry.py)
        self.held: set[str] = set()  # requests whose asker reads no further: their rows wait (node/follow.py)

    # -- event loop --------------------------------------------------------------------------
    def admit(self, msg) -> list:
        if isinstance(msg, InferenceRequest):
            return self._admit_request(msg)
        if isinstance(msg, NextTokens):
            return self._admit_tokens(msg)
        if isinstance(msg, CancelRequest) and msg.request_id in self.live:
            return self.end(EndRequest(msg.request_id, EndReason.CANCELLED))
        if isinstance(msg, CancelRequest):  # waiting, else already over: cancelling is idempotent
            return self.admission.cancel(msg.request_id)
        if isinstance(msg, EndRequest) and msg.reason is EndReason.LOST:
            return self._lost(msg.request_id, msg.generation)
        if isinstance(msg, EndRequest):  # a stage failed it
            live = self.live.get(msg.request_id)
            return self.end(msg) if live is not None and (msg.generation >= live.generation or msg.poison) else []
        raise wrong_role(self.shard.index, self.role, msg)

    def plan(self) -> Step | None:
        if self.paused:
            return None
        ready = [u for u in self.queue.waiting if u.request_id not in self.held]
        waiting = {u.request_id for u in self.queue.waiting}
        running = [rid for rid in _running(self.live) if rid not in self.held]
        elsewhere = any(self.live[rid].generated and not self.live[rid].lost and rid not in waiting for rid in running)
        replaying = frozenset(rid for rid in waiting if rid in self.live and self.live[rid].generated)
        ride = prompts_ride(elsewhere, ready, replaying)
        return self.queue.next_step(decode_group(len(running), self.shard.count), prompts=not ride, held=self.held)

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
            self.cache.forget(self.cache.index.names())
        actions = []
        for rid, live in list(self.live.items()):
            if (replaced or (live.lost and standing)) and not live.preempted:  # a preempted one holds no KV
                actions += self._replay(rid)
        return actions + self.admission.start_waiting(self._plan, self._start)

    def is_live(self, request_id: str, generation: int) -> bool:
        """Whether this life of the request is live here (it started, has not ended, no replay since)."""
        live = self.live.get(request_id)
        return live is not None and live.generation == generation

    def end(self, end: EndRequest) -> list:
        """End a live request everywhere, a finished one's KV kept as an entry of the prefix cache; start
        waiting ones in the slots that frees."""
        live = self.live[end.request_id]
        keep = ""  # every position whose KV each stage has computed, kept; may raise: nothing changed yet
        if end.reason is EndReason.FINISHED:
            keep = self.cache.keep(self.entry, (*live.prompt, *live.generated), live.request.cache_salt)
        del self.live[end.request_id]
        self.admission.waiting.pop(end.request_id, None)  # a preempted request, cancelled or failed while it waits
        self.cache.ended(end.request_id)
        self.queue.end(end.request_id, keep)
        actions = [Progress(end.request_id, end=end),
                   Send(self.next, EndRequest(end.request_id, end.reason, keep_as=keep))]
        if end.reason is EndReason.FAILED:
            actions.append(error_reply(live.request.reply_to, end))
        return actions + self.admission.start_waiting(self._plan, self._start)

    def health(self) -> dict:
        running = _running(self.live)
        return {"slots": {"capacity": self.capacity, "active": len(self.live),
                          "preempted": len(self.live) - len(running)},
                "kv": self.kv.health(running),
                "queue": {"waiting": len(self.admission.waiting), "max": self.admission.max_queue},
                "admitting": not self.paused, "replays": sum(live.replays for live in self.live.values()),
                "prefix_cache": self.cache.health()}

    # -- compute thread ----------------------------------------------------------------------
    def run(self, step: Step, worker: Worker):
        return compute(step, worker, [StepItem(u.request_id, u.position, tokens=u.tokens,
                                               from_cache=from_cache(u.start)) for u in step.units])

    # -- internals ---------------------------------------------------------------------------
    def _admit_request(self, req: InferenceRequest) -> list:
        rid = req.request_id
        if rid in self.live or rid in self.admission.waiting:
            raise Refused(409, f"request {rid!r} is already in flight")
        ids = self.admission.prompt_ids(req)
        if self.kv.budget is not None and len(ids) >= self.kv.budget:  # the budget is one context or more: rare
            raise Refused(400, f"prompt: {len(ids)} tokens leave no room in the KV budget of {self.kv.budget} "
                               f"positions", code=PROMPT_TOO_LONG)
        try:
            plan = None if self.admission.waiting else self._plan(req, ids)
        except Exception as exc:  # noqa: BLE001 - nothing changed yet: refused alone, as a fault here
            raise Refused(500, f"stage {self.shard.index}: could not start the request: {described(exc)}") from None
        if plan is not None:
            self._start(req, ids, 0.0, plan)
        else:
            self.admission.wait(req, ids, self.capacity)
        return []

    def _plan(self, req: InferenceRequest, ids: list[int]) -> Start | None:
        """How the request would start now (roles/prefix.py), the entries its KV evicts in `drop`; or None:
        paused, or no slot or KV room for it yet. A preempted request (still live) needs room for all it had."""
        if self.paused:
            return None
        if (held := self.live.get(req.request_id)) is not None:
            room = self.kv.room(_running(self.live), held.next_position)
            return None if room is None else Start(drop=room.evict)
        plan = self.cache.plan(req, ids, free=self.capacity - len(self.live))
        if plan is None:
            return None
        entry, running = plan.match.entry, _running(self.live)
        need = len(ids) - (self.cache.positions(entry) if plan.take else 0)
        room = self.kv.room(running, need, drop=plan.drop, keep=(entry,) if entry else ())
        if room is None and entry is not None and not plan.take:
            # the entry it would copy from takes the room its copy needs: start afresh, the entry evictable,
            # or a request alone with it would wait for ever
            plan = Start(drop=plan.drop)
            room = self.kv.room(running, len(ids), drop=plan.drop)
        return None if room is None else attrs.evolve(plan, drop=plan.drop + room.evict)

    def _start(self, req: InferenceRequest, ids: list[int], queued_ms: float, plan: Start) -> None:
        if (held := self.live.get(req.request_id)) is not None:  # preempted: its next life, prefilled as a replay's
            self.cache.forget(plan.drop)
            held.preempted, held.resuming = False, True
            self.queue.add(_prefill(held, Start(), self.entry, self.cache.drops()))
            return
        live = _Live(req, tuple(ids), round(queued_ms, 3))
        self.cache.start(req, len(ids), plan)
        self.queue.add(_prefill(live, plan, self.entry, self.cache.drops()))
        self.live[req.request_id] = live  # last: a start that raised leaves no live request

    def _replay(self, rid: str) -> list:
        """Start the request's next life: its prompt and generated tokens through the chain again."""
        live = self.live[rid]
        if live.replays >= MAX_REPLAYS:
            return self.end(failure(rid, self.shard.index, f"its rows were lost {live.replays} times; giving up"))
        live.generation, live.replays, live.lost, live.resuming = live.generation + 1, live.replays + 1, False, True
        self.cache.replayed(rid)
        self.queue.restart(rid)
        self.queue.add(_prefill(live, Start(), self.entry, self.cache.drops()))
        return []

    def _lost(self, rid: str, generation: int) -> list:
        """A stage could not pass this life's rows on: replay now if the chain stands, else when it does."""
        if not self.is_live(rid, generation):
            return []  # ended, or already replayed
        self.live[rid].lost = True
        if self.paused or not self._standing:
            return []
        return self._replay(rid)

    def _admit_tokens(self, msg: NextTokens) -> list:
        _check_fed_back(msg.tokens, self.live, self.queue.ended)  # taken whole or refused whole
        actions = []
        for t in msg.tokens:
            live = self.live.get(t.request_id)
            if live is None or t.generation != live.generation:
                continue  # ended here, or replayed, while the token was on its way
            live.resuming = False
            try:  # each token on its own: one request's fault here fails it, not the others of the message
                actions.append(Progress(t.request_id, t.token_id, t.done, logprob=t.logprob,
                                        prompt_logprobs=t.prompt_logprobs))
                if self.cache.release(t.request_id):  # every stage has computed its first rows: copied the entry's
                    actions += self.admission.start_waiting(self._plan, self._start)
                if t.done:
                    actions += self.end(EndRequest(t.request_id, EndReason.FINISHED))
                    continue
                live.generated.append(t.token_id)  # t.position was next_position: it moves on by one
                actions += self._reclaim(self.kv.room(_running(self.live), 0, grower=t.request_id))
                if not live.preempted:
                    self.queue.add(Unit(t.request_id, t.position, 1, decode=True, tokens=(t.token_id,),
                                        generation=live.generation))
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this request's; what it did stands
                actions += self._fail(t.request_id, described(exc)) if t.request_id in self.live else []
        return actions

    def _reclaim(self, room: Room | None) -> list:
        """Stage 0's KV decision (roles/kv_budget.py) carried out: entries evicted, and every entry forgotten
        since the last start dropped on every stage now; requests preempted: their life ends on every stage
        and they wait first in line. None: nothing frees enough (entries held): the budget is overrun a while."""
        self.cache.forget(room.evict if room is not None else ())
        actions: list = []
        for name in self.cache.drops():
            self.queue.forget(name)
            actions.append(Send(self.next, EndRequest(name, EndReason.DROPPED)))
        for rid in room.preempt if room is not None else ():
            live = self.live[rid]
            actions.append(Send(self.next, EndRequest(rid, EndReason.PREEMPTED, generation=live.generation)))
            live.generation, live.preempted, live.lost, live.resuming = live.generation + 1, True, False, False
            self.kv.preemptions += 1
            self.cache.ended(rid)
            self.queue.free(rid)
            self.admission.wait_first(live.request, list(live.prompt))
        return actions

    def _refused(self, unit: Unit, error: WorkerError) -> list:
        """The worker refused a request's rows: a prefix-cache entry it lacks means a replay from the first
        token; anything else fails the request."""
        if isinstance(error, PrefixMissing):
            self.live[unit.request_id].lost = True
            return self._replay(unit.request_id)
        return self._fail(unit.request_id, str(error))

    def _fail(self, request_id: str, error: str) -> list:
        """Computing the request failed here: it ends, never replayed."""
        return self.end(failure(request_id, self.shard.index, error, poison=True))


def prompt_tokens(actor: FirstActor, request_id: str) -> int | None:
    """How many prompt tokens an admitted request has (running or waiting); None if unknown here."""
    if (live := actor.live.get(request_id)) is not None:
        return len(live.prompt)
    return actor.admission.prompt_tokens(request_id)


def _running(live: dict[str, _Live]) -> dict[str, int]:
    """The requests holding KV, oldest first, and the positions each holds on every stage (or will, once
    what is queued for it is computed): its prompt and every token fed back (roles/kv_budget.py)."""
    return {rid: life.next_position for rid, life in live.items() if not life.preempted}


def settled_chain(actor: FirstActor) -> tuple[str, ...]:
    """Pure: the actor's chain, once no request waits to be replayed through it (lost, or replayed with no
    token back yet); () while one does, or while a stage is missing. A runner starts a new warm spare only
    then (runner/standby.py): its boot would slow the replays down."""
    if actor.paused or any(live.lost or live.resuming for live in actor.live.values()):
        return ()
    return actor.chain


def _prefill(live: _Live, plan: Start, entry: str, drop: tuple[str, ...]) -> Unit:
    """The unit that starts the request's life: its prompt and generated tokens from where `plan` finds
    them cached on, with what every stage needs to start it (RequestStart)."""
    req, cached = live.request, plan.match.tokens
    start = RequestStart(req.max_tokens, req.sampling, live.prompt, req.reply_to, live.queued_ms,
                         tuple(live.generated), entry, cached, plan.match.entry or "", plan.take, drop)
    ids = (*live.prompt, *live.generated)
    return Unit(req.request_id, cached, len(ids) - cached, decode=False, tokens=ids[cached:], start=start,
                generation=live.generation)


def _check_fed_back(tokens: tuple[Token, ...], live: dict[str, _Live], ended: Callable[[str], bool]) -> None:
    """Refuse fed-back tokens for a request never started here, or at a position other than the next one.
    A token of a life a replay has replaced is no fault: it is dropped."""
    for t in tokens:
        life = live.get(t.request_id)
        if life is None and not ended(t.request_id):
            raise Refused(UNKNOWN_REQUEST, f"unknown request {t.request_id!r} at stage 0 (never started, or ended)")
        if life is not None and t.generation == life.generation and t.position != life.next_position:
            raise Refused(409, f"request {t.request_id!r}: token for position {t.position}, "
                               f"expected {life.next_position}")
