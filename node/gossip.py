"""SWIM-lite membership state and rules. Pure: no trio, no I/O; randomness only through an injected Random.

Rules follow hashicorp/memberlist (state.go, util.go, suspicion.go, queue.go), cut down for 3-10 members.
"""
from __future__ import annotations

import enum
import math
import random
from collections.abc import Iterable, Mapping

import attrs


class State(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


TERMINAL = frozenset({State.DEAD, State.LEFT})

# At one incarnation a later state in this order wins; an ALIVE therefore needs a strictly higher incarnation.
# LEFT outranks DEAD so a graceful leave is not overwritten by a failure detector's verdict.
_RANK = {State.ALIVE: 0, State.SUSPECT: 1, State.DEAD: 2, State.LEFT: 3}


@attrs.frozen
class Meta:
    stage: int | None = None
    names: tuple[str, ...] = ()  # registry names, e.g. "pp-stage-0", "pp-entry"
    ready: bool = False
    # Nobody can open a connection to an observer (a runner behind NAT): it is never probed or suspected by
    # others and is left out of alive counts, but it probes others and learns the view from their answers.
    observer: bool = False
    progress: float | None = None  # weight download progress, 0..1
    max_seqs: int | None = None  # sequence slots of a ready stage: stage 0 admits no more than the chain's least


@attrs.frozen
class Member:
    id: str  # key members by id: vast.ai reuses IPs and hands out random host ports
    addr: str  # advertised base URL
    incarnation: int  # start at boot epoch-ms so it grows across restarts
    state: State = State.ALIVE
    meta: Meta = attrs.field(factory=Meta)


# Wire messages. Plain fields only, so one cattrs converter can (un)structure them at the HTTP edge.

@attrs.frozen
class Ping:
    sender: Member  # the sender's own record: a ping doubles as its alive announcement
    target_id: str
    seq: int
    updates: tuple[Member, ...] = ()


@attrs.frozen
class Ack:
    sender_id: str
    seq: int
    updates: tuple[Member, ...] = ()


@attrs.frozen
class PingReq:
    sender: Member
    target_id: str
    target_addr: str
    seq: int
    updates: tuple[Member, ...] = ()


@attrs.frozen
class Nack:
    """A relay's answer to a PingReq when the target did not ack within the relay's probe timeout."""
    sender_id: str
    seq: int
    updates: tuple[Member, ...] = ()


@attrs.frozen
class Sync:
    members: tuple[Member, ...]  # push/pull: the full view, answered with the full view


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"SwimConfig.{attribute.name}={value!r} must be > 0")


@attrs.frozen
class SwimConfig:
    """Timing and fan-out knobs.

    Defaults are memberlist's LAN profile, not its WAN one (5 s period, 3 s timeout, mult 6), although the
    boxes talk over the internet: a runner must notice a dead stage within seconds, and with n <= 10 the
    worst case here is about (n-1)+1+4+3 = 17 s against a minute on WAN settings. A 0.5 s probe timeout
    covers an intercontinental round trip on a kept-alive HTTP connection (the transport must reuse
    connections: a cold TLS handshake alone can take that long). A slow box is not declared dead by one
    missed probe: the direct ping keeps running until the period ends while k relays try too, and then it
    has suspicion_mult periods to refute.
    """
    protocol_period_s: float = attrs.field(default=1.0, validator=_positive)
    probe_timeout_s: float = attrs.field(default=0.5, validator=_positive)
    indirect_checks: int = 3
    suspicion_mult: int = attrs.field(default=4, validator=_positive)
    # Lifeguard's dogpile stretches a lone accusation to this multiple and shrinks it with confirmations.
    # Off (1) by default: updates carry no accuser, so the driver cannot count distinct confirmations.
    suspicion_max_timeout_mult: int = attrs.field(default=1, validator=_positive)
    retransmit_mult: int = attrs.field(default=4, validator=_positive)
    sync_interval_s: float = attrs.field(default=30.0, validator=_positive)
    sync_timeout_s: float = attrs.field(default=2.0, validator=_positive)
    max_piggyback: int = attrs.field(default=16, validator=_positive)  # HTTP bodies have no UDP size limit
    join_backoff_s: float = attrs.field(default=0.5, validator=_positive)
    join_backoff_max_s: float = attrs.field(default=8.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.probe_timeout_s >= self.protocol_period_s:
            raise ValueError(f"SwimConfig: probe_timeout_s={self.probe_timeout_s} must be shorter than "
                             f"protocol_period_s={self.protocol_period_s}, or indirect probes get no time")
        if self.indirect_checks < 0:
            raise ValueError(f"SwimConfig.indirect_checks={self.indirect_checks} must be >= 0")


# --- merging updates --------------------------------------------------------------------------------------

def supersedes(update: Member, known: Member) -> bool:
    """memberlist's precedence: ignore inc < known; alive needs inc > known; suspect/dead apply at inc >= known
    over a weaker state, so dead/left beat alive at the same incarnation and a repeated suspect is no news."""
    return (update.incarnation, _RANK[update.state]) > (known.incarnation, _RANK[known.state])


def refute(own: Member, update: Member) -> Member | None:
    """Our answer to an update about ourselves, or None if it needs none.

    An accusation (any non-alive state) at an incarnation >= ours, or a record from an earlier life of ours
    with a higher incarnation, is outbid: incarnation = max(own, accused) + 1, state ALIVE."""
    accused = update.state is not State.ALIVE and update.incarnation >= own.incarnation
    if not (accused or update.incarnation > own.incarnation):
        return None
    return attrs.evolve(own, incarnation=max(own.incarnation, update.incarnation) + 1, state=State.ALIVE)


def declares_dead(update: Member, own: Member) -> bool:
    """Whether an update is the cluster's DEAD verdict on us (not a stale one from an earlier life)."""
    return update.id == own.id and update.state is State.DEAD and update.incarnation >= own.incarnation


def merge(known: Member | None, update: Member, *, self_id: str) -> Member | None:
    """The record to store (and gossip on) after `update`, or None when the update is ignored."""
    if update.id == self_id:
        if known is None:
            raise ValueError(f"the view of {self_id!r} lacks its own record")
        return refute(known, update)
    if known is None or supersedes(update, known):  # a first sighting is taken whatever its state
        return update
    return None


def merge_all(view: Mapping[str, Member], updates: Iterable[Member], self_id: str
              ) -> tuple[dict[str, Member], tuple[Member, ...]]:
    """Apply updates in order. Returns the new view and the final record of every member that changed."""
    new = dict(view)
    changed: dict[str, Member] = {}
    for update in updates:
        record = merge(new.get(update.id), update, self_id=self_id)
        if record is not None:
            new[update.id] = changed[update.id] = record
    return new, tuple(changed.values())


def as_synced(record: Member) -> Member:
    """A DEAD verdict in a pushed/pulled full state counts as SUSPECT (memberlist's mergeState): a member
    coming back from a partition with stale verdicts must not kill healthy members outright, and the
    accused gets a suspicion period to refute."""
    return attrs.evolve(record, state=State.SUSPECT) if record.state is State.DEAD else record


def announce_meta(own: Member, **changes: object) -> Member:
    """Own record with new metadata; the incarnation bump makes every view take it."""
    return attrs.evolve(own, incarnation=own.incarnation + 1, meta=attrs.evolve(own.meta, **changes))


# --- whom to talk to --------------------------------------------------------------------------------------

def is_probe_target(member: Member | None, self_id: str) -> bool:
    return (member is not None and member.id != self_id and not member.meta.observer
            and member.state in (State.ALIVE, State.SUSPECT))


def live_count(view: Mapping[str, Member]) -> int:
    """Members the failure detector cares about: non-observers not yet dead or left."""
    return sum(1 for m in view.values() if not m.meta.observer and m.state not in TERMINAL)


@attrs.frozen
class ProbeRound:
    remaining: tuple[str, ...] = ()  # ids still to probe this round, in shuffled order


def next_target(rnd: ProbeRound, view: Mapping[str, Member], self_id: str, rng: random.Random
                ) -> tuple[str | None, ProbeRound]:
    """Round-robin over a shuffled list, reshuffled each round, so every eligible member is probed once per
    round. Members that died mid-round are skipped; members that joined mid-round wait for the next round."""
    order, fresh = rnd.remaining, False
    while True:
        for i, member_id in enumerate(order):
            if is_probe_target(view.get(member_id), self_id):
                return member_id, ProbeRound(order[i + 1:])
        if fresh:
            return None, ProbeRound()
        shuffled = sorted(m.id for m in view.values() if is_probe_target(m, self_id))  # sorted: seed decides
        rng.shuffle(shuffled)
        order, fresh = tuple(shuffled), True


def relay_candidates(view: Mapping[str, Member], self_id: str, target_id: str) -> list[Member]:
    """Members that can forward a ping: reachable (not observers) and not themselves under suspicion."""
    return sorted((m for m in view.values() if m.id not in (self_id, target_id) and not m.meta.observer
                   and m.state is State.ALIVE), key=lambda m: m.id)


def choose_relays(view: Mapping[str, Member], self_id: str, target_id: str, indirect_checks: int,
                  rng: random.Random) -> list[Member]:
    """k = min(indirect_checks, other reachable alive members) random relays for a ping-req."""
    candidates = relay_candidates(view, self_id, target_id)
    return rng.sample(candidates, min(indirect_checks, len(candidates)))


def pick_sync_peer(view: Mapping[str, Member], self_id: str, rng: random.Random) -> Member | None:
    peers = [m for _, m in sorted(view.items())
             if m.id != self_id and m.state is State.ALIVE and not m.meta.observer]
    return rng.choice(peers) if peers else None


# --- suspicion --------------------------------------------------------------------------------------------

def suspicion_timeout_s(n: int, config: SwimConfig, confirmations: int = 0) -> float:
    """memberlist: min = SuspicionMult * max(1, log10 n) * ProbeInterval; with Lifeguard's dogpile the timer
    starts at max = SuspicionMaxTimeoutMult * min and shrinks towards min as distinct members confirm."""
    node_scale = max(1.0, math.log10(max(1, n)))
    low = config.suspicion_mult * node_scale * config.protocol_period_s
    high = config.suspicion_max_timeout_mult * low
    k = config.suspicion_mult - 2  # confirmations that bring the timer down to min
    if n - 2 < k or k < 1:  # too few members to ever collect k confirmations
        return low
    frac = math.log(confirmations + 1) / math.log(k + 1)
    return max(low, high - frac * (high - low))


@attrs.frozen
class Suspicion:
    incarnation: int
    deadline_s: float  # trio clock


def expired_suspects(view: Mapping[str, Member], suspicions: Mapping[str, Suspicion], now_s: float
                     ) -> list[Member]:
    """DEAD verdicts for suspicions whose timer ran out while the member stayed suspect at that incarnation."""
    verdicts = []
    for member_id, suspicion in sorted(suspicions.items()):
        record = view.get(member_id)
        if (suspicion.deadline_s <= now_s and record is not None and record.state is State.SUSPECT
                and record.incarnation == suspicion.incarnation):
            verdicts.append(attrs.evolve(record, state=State.DEAD))
    return verdicts


# --- dissemination ----------------------------------------------------------------------------------------

def retransmit_limit(n: int, retransmit_mult: int) -> int:
    """Sends per update before it is dropped: RetransmitMult * ceil(log10(n + 1))."""
    return retransmit_mult * math.ceil(math.log10(n + 1))


@attrs.frozen
class Pending:
    update: Member
    sends: int
    order: int  # enqueue order; among equally-sent updates the newest goes first


@attrs.frozen
class Dissemination:
    """Updates waiting to be piggybacked, at most one per member."""
    pending: tuple[Pending, ...] = ()
    next_order: int = 0

    def enqueue(self, update: Member) -> Dissemination:
        """A newer update about a member replaces the older one and starts with zero sends."""
        kept = tuple(p for p in self.pending if p.update.id != update.id)
        return Dissemination(kept + (Pending(update, 0, self.next_order),), self.next_order + 1)

    def take(self, max_count: int, limit: int) -> tuple[tuple[Member, ...], Dissemination]:
        """The least-sent updates (newest first among equals); each counts a send and is dropped at `limit`."""
        chosen = sorted(self.pending, key=lambda p: (p.sends, -p.order))[:max_count]
        ids = {p.update.id for p in chosen}
        counted = (attrs.evolve(p, sends=p.sends + 1) if p.update.id in ids else p for p in self.pending)
        kept = tuple(p for p in counted if p.sends < limit)
        return tuple(p.update for p in chosen), attrs.evolve(self, pending=kept)

    def about(self, member_id: str) -> tuple[Member, ...]:
        return tuple(p.update for p in self.pending if p.update.id == member_id)
