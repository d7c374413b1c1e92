"""One member's SWIM state as one value, and the pure steps that move it.

SwimState is all the protocol remembers between messages: the view, the piggyback queue, the probe round, the
running suspicions and the last verdict on each member gone. Each step takes a state, and the trio clock's reading
where it may start a suspicion timer, and returns the next state; Swim (swim.py) applies them and does what they
ask of the world: wake waiters when `version` moves, step aside once `declared_dead`, log once when `full`.
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping

import attrs

from node.membership import rules
from node.membership.gossip import MAX_MEMBERS, TERMINAL, Heard, Member, State, SwimConfig
from node.membership.rules import Dissemination, ProbeRound, Suspicion


@attrs.frozen
class Tombstone:
    record: Member  # the last DEAD/LEFT record of a member
    deaths: int  # verdicts on it so far: wait_for_dead tells a new one from one it saw before


@attrs.frozen
class SwimState:
    """A member's protocol state. The mappings are never changed in place: each step builds new ones."""
    self_id: str
    config: SwimConfig
    # A stage declared dead has been (or is being) replaced: it must not refute and come back serving a slice
    # someone else now holds. With `yields` it is `declared_dead` instead, once an answer holds it dead
    # (rules.declares_dead), and its owner exits.
    yields: bool
    view: Mapping[str, Member]  # self included, in the order members were first seen (rules.holder)
    queue: Dissemination = Dissemination()
    round: ProbeRound = ProbeRound()
    suspicions: Mapping[str, Suspicion] = attrs.field(factory=dict)
    tombstones: Mapping[str, Tombstone] = attrs.field(factory=dict)  # least recent first
    version: int = 0  # bumped by each change a waiter may care about: the view's, and being declared dead
    declared_dead: bool = False
    full: bool = False  # the view has been full: logged once, or a token holder could fill the log as well

    @property
    def me(self) -> Member:
        return self.view[self.self_id]

    def alive(self) -> tuple[Member, ...]:
        """Non-observer ALIVE members, self included, by id."""
        return tuple(m for _, m in sorted(self.view.items()) if m.state is State.ALIVE and not m.meta.observer)

    def alone(self) -> bool:
        """Nobody in the view to probe: look for the cluster through the seeds."""
        return not any(rules.is_probe_target(m, self.self_id) for m in self.view.values())

    def next_deadline(self) -> float:
        """When the earliest suspicion runs out (trio clock), or inf with none running."""
        return min((s.deadline_s for s in self.suspicions.values()), default=math.inf)

    def deaths(self, member_id: str) -> int:
        stone = self.tombstones.get(member_id)
        return 0 if stone is None else stone.deaths

    def gone_since(self, member_id: str, deaths_before: int) -> Member | None:
        """The DEAD/LEFT record of `member_id` if it is gone now, or if it died since it had `deaths_before`
        deaths, even if a restart has already replaced it in the view."""
        record = self.view.get(member_id)
        if record is not None and record.state in TERMINAL:
            return record
        return self.tombstones[member_id].record if self.deaths(member_id) > deaths_before else None


def start(me: Member, config: SwimConfig, *, yields: bool = False) -> SwimState:
    if me.state is not State.ALIVE:
        raise ValueError(f"member {me.id!r} must start ALIVE, not {me.state.name}")
    return SwimState(me.id, config, yields, {me.id: me})


def absorb(state: SwimState, updates: Iterable[Member], heard: Heard, now_s: float) -> SwimState:
    """Merge updates, heard where `heard` says, into the view (rules.merge_all); with `yields`, note an answer
    that declares us dead (rules.declares_dead)."""
    updates = list(updates)
    if (state.yields and not state.declared_dead
            and any(rules.declares_dead(u, state.me, heard) for u in updates)):
        state = attrs.evolve(state, declared_dead=True, version=state.version + 1)
    view, changed = rules.merge_all(state.view, updates, state.self_id, heard=heard, yields=state.yields)
    if len(view) >= MAX_MEMBERS and not state.full:
        state = attrs.evolve(state, full=True)
    return commit(state, view, changed, now_s) if changed else state


def commit(state: SwimState, view: Mapping[str, Member], changed: tuple[Member, ...], now_s: float) -> SwimState:
    """Take a new view whose `changed` records are news: queue them for gossip, start a suspicion timer for each
    new suspect and stop any other, and bury the dead."""
    suspicions = dict(state.suspicions)
    timeout = None
    for record in changed:
        suspicions.pop(record.id, None)
        if record.state is State.SUSPECT and record.id != state.self_id:
            if timeout is None:  # once per commit: a message's changes cost O(view + changes)
                timeout = rules.suspicion_timeout_s(rules.live_count(view), state.config)
            suspicions[record.id] = Suspicion(record.incarnation, now_s + timeout)
    gone = [record for record in changed if record.state in TERMINAL]
    return attrs.evolve(state, view=view, queue=state.queue.enqueue_all(changed), suspicions=suspicions,
                        tombstones=bury(state.tombstones, gone) if gone else state.tombstones,
                        version=state.version + 1)


def bury(tombstones: Mapping[str, Tombstone], records: Iterable[Member]) -> dict[str, Tombstone]:
    """Keep the last verdict on each member for wait_for_dead. Members can churn through a full view without end
    (rules.merge_all), so only the latest MAX_MEMBERS of them are remembered."""
    kept = dict(tombstones)
    for record in records:
        before = kept.pop(record.id, None)
        kept[record.id] = Tombstone(record, 1 if before is None else before.deaths + 1)
        if len(kept) > MAX_MEMBERS:
            del kept[next(iter(kept))]
    return kept


def announce(state: SwimState, now_s: float, **changes: object) -> SwimState:
    """Own metadata changed (rules.announce_meta), with the incarnation bump that makes every view take it."""
    me = rules.announce_meta(state.me, **changes)
    return commit(state, {**state.view, state.self_id: me}, (me,), now_s)


def probe_failed(state: SwimState, target_id: str, now_s: float) -> SwimState:
    """Nothing acked a probe of `target_id` within its period: this view's own failure detector suspects it. A
    probe lasts a period, and the member may have left the view meanwhile (a full view evicts the dead, a
    verdict came in): then there is no one to suspect and the state is left."""
    known = state.view.get(target_id)
    if known is None or known.state not in (State.ALIVE, State.SUSPECT):
        return state
    return absorb(state, (attrs.evolve(known, state=State.SUSPECT),), Heard.OWN, now_s)


def confirm_dead(state: SwimState, member_id: str, now_s: float) -> SwimState:
    """The member is known gone without a probe (its process exited, its instance ended): dead, by this
    view's own verdict, with no suspicion to wait out; a member not in the view, or gone already, is left."""
    known = state.view.get(member_id)
    if known is None or known.state not in (State.ALIVE, State.SUSPECT) or member_id == state.self_id:
        return state
    return absorb(state, (attrs.evolve(known, state=State.DEAD),), Heard.OWN, now_s)


def expire(state: SwimState, now_s: float) -> SwimState:
    """Suspicions whose timers have run out end; a member still suspect at that incarnation is dead, by this
    view's own verdict (rules.expired_suspects)."""
    verdicts = rules.expired_suspects(state.view, state.suspicions, now_s)
    running = {i: s for i, s in state.suspicions.items() if s.deadline_s > now_s}
    return absorb(attrs.evolve(state, suspicions=running), verdicts, Heard.OWN, now_s)


def next_target(state: SwimState, rng: random.Random) -> tuple[SwimState, Member | None]:
    """The member to probe this period (rules.next_target), or None when there is none."""
    target_id, rnd = rules.next_target(state.round, state.view, state.self_id, rng)
    return attrs.evolve(state, round=rnd), None if target_id is None else state.view[target_id]


def updates_for(state: SwimState, recipient_id: str) -> tuple[SwimState, tuple[Member, ...]]:
    """Least-sent queued updates, each counting a send; plus, if we hold the recipient suspect or dead, that
    record, so it can refute at once (memberlist's buddy system, used on acks as well as pings)."""
    limit = rules.retransmit_limit(len(state.view), state.config.retransmit_mult)
    updates, queue = state.queue.take(state.config.max_piggyback, limit)
    about = state.view.get(recipient_id)
    if about is not None and about.state is not State.ALIVE and about not in updates:
        updates = (about, *updates)
    return attrs.evolve(state, queue=queue), updates
