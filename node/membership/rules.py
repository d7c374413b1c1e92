"""SWIM-lite membership rules: what a view makes of what it hears. Pure: no trio, no I/O; randomness only
through an injected Random.

Rules follow hashicorp/memberlist (state.go, util.go, suspicion.go, queue.go), cut down for 3-10 members, plus
one thing memberlist leaves out: what a message may claim.

Who may say what
----------------
Gossip is authenticated by one secret that the nodes and their runner share, the cluster token, and by nothing
else: a message proves that its sender holds the token, never who it is, and a record names its subject, not
its author. memberlist trusts its members to say only what is true; here a claim goes only as far as where it
was heard lets it (Heard):

- an *answer* (ack, nack, sync reply) comes from an address this node chose to dial: a member's, as its own
  view holds it, or a seed it was configured with;
- a *request* (ping, ping-req, sync push) may come from anyone holding the token: it speaks for nobody.

1. Addresses. A member's address is a bare http(s) origin (is_origin); with its stage and observer flag it is
   fixed when a view first sees the member, and a record changing them is dropped (same_identity). A relay
   pings a ping-req's target at the address its own view holds, and nobody for a member it would not probe
   itself (relay_target): no message makes a node dial a URL of the sender's choosing, token attached.

2. Death. Only a view's own failure detector declares a member dead (expired_suspects). A verdict in gossip is
   an accusation: a known member said to be dead or gone is taken as suspect at that incarnation and has its
   suspicion period to refute (as_heard; memberlist's mergeState does this for push/pull only). A member never
   seen before may arrive dead, but only in an answer: a joiner learns from its seed who is already gone.

   A stage steps aside (Swim's yield_when_dead) only when an answer holds it dead (declares_dead): it was
   frozen or cut off past the timeout and has been replaced. A request saying so is refuted like any accusation
   (about_self). If it is true, that does not bring the stage back: a stage's holder declared dead stays dead
   under its id in that view (is_final), and the next answer tells it so. A restarted node is a new member,
   with a new id; a member without a stage (the runner) comes back at a higher incarnation, as in SWIM.

3. Names. A registry name (pp-stage-1, pp-entry) is held by the member registered under it that this view saw
   first, until this view declares that member dead; then by the next (holder). A later claimant never takes a
   name from a live holder, whatever its incarnation, and a holder never steps aside because another claims its
   stage: a stage changes hands only by its holder's death. The runner replaces only a stage whose holder is
   gone (runner/keeper.py).

Bounds
------
Whatever a token holder sends, a member's work and memory stay bounded. A message carries at most MAX_ENTRIES
records and is refused whole past it, before any record is looked at (the wire types' validator, in gossip.py: a
sync pushes a whole view, so the cap is the view's). A view holds at most MAX_MEMBERS records (merge_all): a
member never seen before takes the place of the oldest dead or gone record, or, with none, is refused; a live
member is never pushed out. Merging a message costs O(view + records) and choosing what to piggyback O(queue log
k), and the queue keeps at most MAX_MEMBERS updates (Dissemination). Within the caps a token holder can still
fill a view with live members of its own: newcomers are refused until some are declared dead, and each probe
round (one probe per member per period) and suspicion timeout (log10 n) grows with them.

What a token holder can still do, since nothing tells members apart but what they claim: register members of
its own, at origins of its choosing, which are dialled like any member, and as such a member answer falsely
(tell a stage that probes it that it is dead, and that stage steps aside); queue a member behind a stage's
holder, to take the stage in every view that saw it before the runner's replacement; give a view that has not
yet seen a member a false address for it; forge a live member's own record (a higher incarnation, other
metadata) until that member refutes; and accuse a live member over and over, which it survives as long as each
refutation outruns the suspicion timeout. Closing these takes credentials of each member's own (records signed
by their subject, replacements by the runner), not one shared secret.
"""
from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Iterator, Mapping
from urllib.parse import urlsplit

import attrs

from node.membership.gossip import MAX_MEMBERS, TERMINAL, Heard, Member, State, SwimConfig

# At one incarnation a later state in this order wins; an ALIVE therefore needs a strictly higher incarnation.
# LEFT outranks DEAD so a graceful leave is not overwritten by a failure detector's verdict.
_RANK = {State.ALIVE: 0, State.SUSPECT: 1, State.DEAD: 2, State.LEFT: 3}


# --- identity ---------------------------------------------------------------------------------------------

def is_origin(addr: str) -> bool:
    """Whether `addr` is a bare http(s) origin, http://host:port: no credentials, path, query or fragment, so that
    a node dialling it reaches the endpoint it means (`addr + "/swim/ping"`) and nothing else."""
    try:
        parts = urlsplit(addr)
        parts.port  # noqa: B018 -- urlsplit checks the port only when asked
    except ValueError:
        return False
    return (parts.scheme in ("http", "https") and bool(parts.hostname) and "@" not in parts.netloc
            and not (parts.path or parts.query or parts.fragment) and addr == f"{parts.scheme}://{parts.netloc}")


def same_identity(update: Member, known: Member) -> bool:
    """A member's address, stage and observer flag are fixed when it is first seen: a record that changes any of
    them is not about that member (an address is taken over only by a new member, with a new id)."""
    return (update.addr, update.meta.stage, update.meta.observer) == (known.addr, known.meta.stage,
                                                                       known.meta.observer)


def is_final(record: Member) -> bool:
    """A stage's holder declared dead or gone: it has been replaced, or is being, and never comes back under its
    id. A member without a stage (the runner) comes back with a higher incarnation, as in SWIM."""
    return record.state in TERMINAL and record.meta.stage is not None


# --- merging updates --------------------------------------------------------------------------------------

def supersedes(update: Member, known: Member) -> bool:
    """memberlist's precedence: ignore inc < known; alive needs inc > known; suspect/dead apply at inc >= known
    over a weaker state, so dead/left beat alive at the same incarnation and a repeated suspect is no news.
    Nothing supersedes a final verdict."""
    if is_final(known):
        return False
    return (update.incarnation, _RANK[update.state]) > (known.incarnation, _RANK[known.state])


def as_heard(known: Member | None, update: Member, heard: Heard) -> Member:
    """An update about another member as this view takes it: a verdict (dead, left) from gossip is an accusation,
    taken as suspect, unless it is this view's own, or it is about a member never seen and comes in an answer."""
    if update.state not in TERMINAL or heard is Heard.OWN or (known is None and heard is Heard.ANSWER):
        return update
    return attrs.evolve(update, state=State.SUSPECT)


def refute(own: Member, update: Member) -> Member | None:
    """Our answer to an update about ourselves, or None if it needs none.

    An accusation (any non-alive state) at an incarnation >= ours, or a record from an earlier life of ours
    with a higher incarnation, is outbid: incarnation = max(own, accused) + 1, state ALIVE."""
    accused = update.state is not State.ALIVE and update.incarnation >= own.incarnation
    if not (accused or update.incarnation > own.incarnation):
        return None
    return attrs.evolve(own, incarnation=max(own.incarnation, update.incarnation) + 1, state=State.ALIVE)


def declares_dead(update: Member, own: Member, heard: Heard) -> bool:
    """Whether an update is a member's verdict that we are dead: heard in an answer, about us as we are, and not a
    stale one from before our last refutation (a stage's verdict is final, so none is stale)."""
    return (heard is Heard.ANSWER and update.id == own.id and same_identity(update, own)
            and update.state in TERMINAL and (update.incarnation >= own.incarnation or is_final(update)))


def about_self(own: Member, update: Member, heard: Heard, *, yields: bool) -> Member | None:
    """Our own record after an update about us (a refutation), or None if it needs none. With `yields` (we step
    aside when declared dead) a verdict that declares us dead is not refuted; any other accusation is, a
    request's verdict included: it speaks for nobody."""
    if not same_identity(update, own) or (yields and declares_dead(update, own, heard)):
        return None
    return refute(own, update)


def merge(known: Member | None, update: Member, *, self_id: str, heard: Heard = Heard.OWN, yields: bool = False
          ) -> Member | None:
    """The record to store (and gossip on) after `update`, heard where `heard` says, or None when the update is
    ignored; `yields`: we step aside when declared dead (about_self)."""
    if update.id == self_id:
        if known is None:
            raise ValueError(f"the view of {self_id!r} lacks its own record")
        return about_self(known, update, heard, yields=yields)
    update = as_heard(known, update, heard)
    if known is None:  # a first sighting is taken whatever its state, at a well-formed address
        return update if is_origin(update.addr) else None
    return update if same_identity(update, known) and supersedes(update, known) else None


def merge_all(view: Mapping[str, Member], updates: Iterable[Member], self_id: str, *, heard: Heard = Heard.OWN,
              yields: bool = False, max_members: int = MAX_MEMBERS) -> tuple[dict[str, Member], tuple[Member, ...]]:
    """Apply updates in order (see merge), in one pass: O(view + updates). Returns the new view (first sightings
    appended: a view keeps the order members were first seen in, which `holder` relies on) and the final record
    of every member that changed.

    A view holds at most `max_members` records. A first sighting past the cap takes the place of the oldest
    record of a member that is dead or gone (and did not change here); with none, it is refused: nothing a
    message says pushes a live member out of the view."""
    new = dict(view)
    changed: dict[str, Member] = {}
    spare: Iterator[str] | None = None  # ids of records that may give way, oldest first; listed once, if needed
    for update in updates:
        known = new.get(update.id)
        record = merge(known, update, self_id=self_id, heard=heard, yields=yields)
        if record is None:
            continue
        if known is None and len(new) >= max_members:
            spare = spare if spare is not None else iter([i for i, m in new.items() if m.state in TERMINAL])
            gone = next((i for i in spare if i in new and new[i].state in TERMINAL and i not in changed
                         and i != self_id), None)
            if gone is None:
                continue  # the view is full of live members: refused
            del new[gone]
        new[update.id] = changed[update.id] = record
    return new, tuple(changed.values())


def announce_meta(own: Member, **changes: object) -> Member:
    """Own record with new metadata; the incarnation bump makes every view take it. The stage and observer flag
    are part of a member's identity (same_identity): other views would drop a record changing them."""
    fixed = {k: v for k, v in changes.items() if k in ("stage", "observer") and getattr(own.meta, k) != v}
    if fixed:
        raise ValueError(f"member {own.id!r}: {', '.join(sorted(fixed))} is fixed when it is first seen; "
                         f"a member of another stage is a new member, with a new id")
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


def relay_target(view: Mapping[str, Member], self_id: str, target_id: str) -> Member | None:
    """Whom a relay pings for a ping-req naming `target_id`: that member, at the address this view holds for it,
    if it is one this member would probe itself; else nobody (the relay answers nack)."""
    target = view.get(target_id)
    return target if is_probe_target(target, self_id) else None


def holder(view: Mapping[str, Member], name: str) -> Member | None:
    """The member that holds a registry name: of the reachable (alive or suspect: a suspect may be just slow)
    non-observer members registered under it, the first this view saw. When it is declared dead the name passes
    to the next; a later claimant never takes it from a live holder, whatever its incarnation."""
    return next((m for m in view.values() if name in m.meta.names and not m.meta.observer
                 and m.state in (State.ALIVE, State.SUSPECT)), None)


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

def new_suspects(old: Mapping[str, Member], new: Mapping[str, Member]) -> list[str]:
    """The members suspect in `new` that were not in `old`: each is probed at once (Swim's suspicion loop)."""
    return [i for i, m in new.items() if m.state is State.SUSPECT and (i not in old or old[i].state is not State.SUSPECT)]


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
    """Updates waiting to be piggybacked, at most one per member, in the order they were enqueued."""
    pending: tuple[Pending, ...] = ()
    next_order: int = 0

    def enqueue(self, update: Member) -> Dissemination:
        return self.enqueue_all((update,))

    def enqueue_all(self, updates: Iterable[Member]) -> Dissemination:
        """A newer update about a member replaces the older one and starts with zero sends. One pass over the
        queue for the whole batch, not one per update: a message's changes cost O(queue + changes). The queue
        keeps the newest MAX_MEMBERS: members that churn through a full view leave no trail of updates behind
        them (the periodic sync repairs anything dropped)."""
        latest: dict[str, Member] = {}
        for update in updates:  # a later update about the same member wins, and counts as enqueued later
            latest.pop(update.id, None)
            latest[update.id] = update
        kept = tuple(p for p in self.pending if p.update.id not in latest)
        added = tuple(Pending(u, 0, self.next_order + i) for i, u in enumerate(latest.values()))
        return Dissemination((kept + added)[-MAX_MEMBERS:], self.next_order + len(added))

    def take(self, max_count: int, limit: int) -> tuple[tuple[Member, ...], Dissemination]:
        """The least-sent updates (newest first among equals); each counts a send and is dropped at `limit`.
        O(queue log max_count): a partial selection, not a sort of the whole queue."""
        chosen = heapq.nsmallest(max_count, self.pending, key=lambda p: (p.sends, -p.order))
        ids = {p.update.id for p in chosen}
        counted = (attrs.evolve(p, sends=p.sends + 1) if p.update.id in ids else p for p in self.pending)
        kept = tuple(p for p in counted if p.sends < limit)
        return tuple(p.update for p in chosen), attrs.evolve(self, pending=kept)

    def about(self, member_id: str) -> tuple[Member, ...]:
        return tuple(p.update for p in self.pending if p.update.id == member_id)
