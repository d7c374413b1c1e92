"""SWIM-lite driver: probe loop, suspicion timers, push/pull sync and inbound handlers, over a Transport.

Decisions live in node.membership.gossip, and so do the rules on what a message may claim (its opening comment); this
file owns time (trio's clock only, so tests run under MockClock) and I/O, and says where each update was heard: in a
request to this member, in an answer from an address it dialled, or from its own failure detector.
"""
from __future__ import annotations

import itertools
import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import attrs
import trio

from node.membership import gossip
from node.membership.gossip import Ack, Heard, Member, Nack, Ping, PingReq, State, SwimConfig, Sync

log = logging.getLogger(__name__)
T = TypeVar("T")


class TransportError(Exception):
    """A request to a member failed: connection error, timeout or non-2xx answer."""

    def __init__(self, addr: str, problem: str):
        super().__init__(f"{addr}: {problem}")
        self.addr, self.problem = addr, problem


class WrongTargetError(ValueError):
    """A ping named another member: the address now belongs to someone else (vast.ai reuses IPs and ports)."""


class Transport(Protocol):
    async def ping(self, addr: str, msg: Ping) -> Ack: ...
    async def ping_req(self, addr: str, msg: PingReq) -> Ack | Nack: ...
    async def sync(self, addr: str, msg: Sync) -> Sync: ...


class Swim:
    """One member's membership protocol.

    Serve on_ping / on_ping_req / on_sync from the HTTP server *before* starting run(), so that members
    joining through us, and we through them, can sync while everyone is still starting.
    """

    def __init__(self, self_member: Member, config: SwimConfig, transport: Transport, rng: random.Random,
                 seeds: Iterable[str], *, yield_when_dead: bool = False):
        if self_member.state is not State.ALIVE:
            raise ValueError(f"member {self_member.id!r} must start ALIVE, not {self_member.state.name}")
        self.config = config
        self._id = self_member.id
        self._view: dict[str, Member] = {self_member.id: self_member}
        self._transport, self._rng = transport, rng
        self._seeds = tuple(addr for addr in seeds if addr != self_member.addr)
        self._queue = gossip.Dissemination()
        self._round = gossip.ProbeRound()
        self._suspicions: dict[str, gossip.Suspicion] = {}
        self._deaths: Counter[str] = Counter()
        self._tombstones: dict[str, Member] = {}  # last DEAD/LEFT record of each member, least recent first
        self._full_logged = False
        self._seq = itertools.count(1)
        self._changed = trio.Event()  # set and replaced on every view change
        # A stage declared dead has been (or is being) replaced: it must not refute and come back serving a
        # slice someone else now holds. With yield_when_dead it sets `declared_dead` instead, once an answer
        # holds it dead (gossip.declares_dead); its owner exits.
        self._yield_when_dead = yield_when_dead
        self.declared_dead = trio.Event()

    # --- queries ------------------------------------------------------------------------------------------

    @property
    def me(self) -> Member:
        return self._view[self._id]

    def members(self) -> dict[str, Member]:
        """A snapshot of the view, self included, keyed by id."""
        return dict(self._view)

    def alive(self) -> tuple[Member, ...]:
        """Non-observer ALIVE members, self included, by id."""
        return tuple(m for _, m in sorted(self._view.items()) if m.state is State.ALIVE and not m.meta.observer)

    def resolve(self, name: str) -> Member | None:
        """The member holding `name` (gossip.holder): of the reachable members registered under it (ALIVE or
        SUSPECT, non-observer), the one this view saw first. A suspect may be just slow, so messages still go
        to it until this view declares it dead; then the name passes to the next, a replacement."""
        return gossip.holder(self._view, name)

    async def wait_until(self, predicate: Callable[[Swim], T]) -> T:
        """Evaluate predicate(self) now and after every view change; return its first truthy result."""
        while True:
            changed = self._changed
            result = predicate(self)
            if result:
                return result
            await changed.wait()

    async def wait_for_dead(self, member_id: str) -> Member:
        """Return the DEAD/LEFT record of `member_id` once it is (or already is) declared gone. A death
        after the call is reported even if a restart has already replaced it in the view."""
        deaths_before = self._deaths[member_id]

        def gone(swim: Swim) -> Member | None:
            record = swim._view.get(member_id)
            if record is not None and record.state in gossip.TERMINAL:
                return record
            return swim._tombstones[member_id] if swim._deaths[member_id] > deaths_before else None
        return await self.wait_until(gone)

    # --- own metadata -------------------------------------------------------------------------------------

    def update_meta(self, **changes: object) -> Member:
        """Change own metadata (names, ready, progress...) and gossip it; each call bumps the incarnation, so
        throttle progress reports to a few per minute."""
        me = gossip.announce_meta(self.me, **changes)
        self._commit({**self._view, self._id: me}, (me,))
        return me

    # --- inbound, called by the HTTP layer ----------------------------------------------------------------

    async def on_ping(self, msg: Ping) -> Ack:
        if msg.target_id != self._id:
            raise WrongTargetError(f"ping for member {msg.target_id!r} reached member {self._id!r} "
                                   f"at {self.me.addr}")
        self._absorb((msg.sender, *msg.updates), Heard.REQUEST)
        return Ack(sender_id=self._id, seq=msg.seq, updates=self._updates_for(msg.sender.id))

    async def on_ping_req(self, msg: PingReq) -> Ack | Nack:
        """Ping the target on the sender's behalf, at the address our view holds for it (never the one the
        request names); Nack if it does not ack within our probe timeout, or at once if it is no member we
        would probe ourselves."""
        self._absorb((msg.sender, *msg.updates), Heard.REQUEST)
        target, acked = gossip.relay_target(self._view, self._id, msg.target_id), False
        if target is not None:
            with trio.move_on_after(self.config.probe_timeout_s):
                acked = await self._ping(target.id, target.addr)
        reply = Ack if acked else Nack
        return reply(sender_id=self._id, seq=msg.seq, updates=self._updates_for(msg.sender.id))

    def on_sync(self, msg: Sync) -> Sync:
        self._absorb(msg.members, Heard.REQUEST)
        return Sync(members=tuple(self._view.values()))

    # --- the protocol -------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join through the seeds, then run the protocol until cancelled.

        Reports started only after the join, i.e. once a seed answered (or at once with no seeds, or when a
        member already joined through us): an owner that awaits nursery.start(swim.run) then sees the
        cluster's view rather than a view of one, and a member that reaches no seed never claims to be up.
        """
        await self._join()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._suspicion_loop)
            nursery.start_soon(self._sync_loop)
            nursery.start_soon(self._probe_loop)
            task_status.started()

    async def _join(self) -> None:
        delay = self.config.join_backoff_s
        while self._seeds and self._alone() and not await self._sync_any(self._seeds):
            log.info("%s: no seed of %s answered; retrying in %.1f s", self._id, self._seeds, delay)
            await trio.sleep(delay)
            delay = min(2 * delay, self.config.join_backoff_max_s)

    def _alone(self) -> bool:
        return not any(gossip.is_probe_target(m, self._id) for m in self._view.values())

    async def _probe_loop(self) -> None:
        while True:
            period_end = trio.current_time() + self.config.protocol_period_s
            target = self._next_target()
            if target is None:
                await self._sync_any(self._seeds)  # alone: look for the cluster again
            elif not await self._probe(target, period_end):
                self._absorb((attrs.evolve(self._view[target.id], state=State.SUSPECT),), Heard.OWN)
            await trio.sleep_until(period_end)

    def _next_target(self) -> Member | None:
        target_id, self._round = gossip.next_target(self._round, self._view, self._id, self._rng)
        return None if target_id is None else self._view[target_id]

    async def _probe(self, target: Member, period_end: float) -> bool:
        """Direct ping; if no ack within the probe timeout, ping-req through k relays while the direct ping
        keeps waiting (memberlist's fallback), all until the period ends. True if anything acked."""
        acked, direct_done = trio.Event(), trio.Event()

        async def direct() -> None:
            if await self._ping(target.id, target.addr):
                acked.set()
            direct_done.set()

        async def via(relay: Member) -> None:
            if await self._ping_req(relay, target):
                acked.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(direct)
            with trio.move_on_after(self.config.probe_timeout_s):
                await direct_done.wait()
            if not acked.is_set():
                for relay in gossip.choose_relays(self._view, self._id, target.id, self.config.indirect_checks,
                                                  self._rng):
                    nursery.start_soon(via, relay)
                with trio.move_on_at(period_end):
                    await acked.wait()
            nursery.cancel_scope.cancel()
        return acked.is_set()

    async def _ping(self, target_id: str, addr: str) -> bool:
        seq = next(self._seq)
        msg = Ping(sender=self.me, target_id=target_id, seq=seq, updates=self._updates_for(target_id))
        try:
            ack = await self._transport.ping(addr, msg)
        except TransportError as exc:  # a failed probe is an event for the protocol, not an error
            log.debug("%s: ping %s failed: %s", self._id, target_id, exc)
            return False
        self._absorb(ack.updates, Heard.ANSWER)
        return ack.seq == seq

    async def _ping_req(self, relay: Member, target: Member) -> bool:
        msg = PingReq(sender=self.me, target_id=target.id, target_addr=target.addr, seq=next(self._seq),
                      updates=self._updates_for(relay.id))
        try:
            reply = await self._transport.ping_req(relay.addr, msg)
        except TransportError as exc:
            log.debug("%s: ping-req via %s failed: %s", self._id, relay.id, exc)
            return False
        self._absorb(reply.updates, Heard.ANSWER)
        return isinstance(reply, Ack) and reply.seq == msg.seq

    async def _suspicion_loop(self) -> None:
        while True:
            changed = self._changed
            deadline = min((s.deadline_s for s in self._suspicions.values()), default=math.inf)
            with trio.move_on_at(deadline):
                await changed.wait()
            now = trio.current_time()
            verdicts = gossip.expired_suspects(self._view, self._suspicions, now)
            self._suspicions = {i: s for i, s in self._suspicions.items() if s.deadline_s > now}
            self._absorb(verdicts, Heard.OWN)

    async def _sync_loop(self) -> None:
        while True:
            await trio.sleep(self.config.sync_interval_s)
            peer = gossip.pick_sync_peer(self._view, self._id, self._rng)
            if peer is not None:
                await self._sync(peer.addr)

    async def join(self, addr: str) -> bool:
        """Push/pull with `addr` now. A runner that nobody can dial (behind NAT) introduces the members to
        each other this way: each sync hands the next member the view so far."""
        return await self._sync(addr)

    async def _sync_any(self, addrs: Iterable[str]) -> bool:
        answered: list[str] = []

        async def one(addr: str) -> None:
            if await self._sync(addr):
                answered.append(addr)

        async with trio.open_nursery() as nursery:
            for addr in addrs:
                nursery.start_soon(one, addr)
        return bool(answered)

    async def _sync(self, addr: str) -> bool:
        with trio.move_on_after(self.config.sync_timeout_s):
            try:
                reply = await self._transport.sync(addr, Sync(members=tuple(self._view.values())))
            except TransportError as exc:
                log.debug("%s: sync with %s failed: %s", self._id, addr, exc)
                return False
            self._absorb(reply.members, Heard.ANSWER)
            return True
        log.debug("%s: sync with %s timed out", self._id, addr)
        return False

    # --- state --------------------------------------------------------------------------------------------

    def _updates_for(self, recipient_id: str) -> tuple[Member, ...]:
        """Least-sent queued updates; plus, if we hold the recipient suspect or dead, that record, so it can
        refute at once (memberlist's buddy system, used on acks as well as pings)."""
        limit = gossip.retransmit_limit(len(self._view), self.config.retransmit_mult)
        updates, self._queue = self._queue.take(self.config.max_piggyback, limit)
        about = self._view.get(recipient_id)
        if about is not None and about.state is not State.ALIVE and about not in updates:
            updates = (about, *updates)
        return updates

    def _absorb(self, updates: Iterable[Member], heard: Heard) -> None:
        """Merge updates, heard where `heard` says, into the view."""
        updates = list(updates)
        if (self._yield_when_dead and not self.declared_dead.is_set()
                and any(gossip.declares_dead(u, self.me, heard) for u in updates)):
            self.declared_dead.set()
            self._changed.set()  # wakes wait_until, as a view change does
            self._changed = trio.Event()
        view, changed = gossip.merge_all(self._view, updates, self._id, heard=heard, yields=self._yield_when_dead)
        if len(view) >= gossip.MAX_MEMBERS and not self._full_logged:
            self._full_logged = True  # once: a token holder could otherwise fill the log as well
            log.warning("%s: the member view is full (%d records); members never seen before are refused while "
                        "no dead one can give way", self._id, len(view))
        if changed:
            self._commit(view, changed)

    def _commit(self, view: dict[str, Member], changed: tuple[Member, ...]) -> None:
        self._view = view
        self._queue = self._queue.enqueue_all(changed)
        timeout = None
        for record in changed:
            self._suspicions.pop(record.id, None)
            if record.state is State.SUSPECT and record.id != self._id:
                if timeout is None:  # once per commit: a message's changes cost O(view + changes)
                    timeout = gossip.suspicion_timeout_s(gossip.live_count(view), self.config)
                self._suspicions[record.id] = gossip.Suspicion(record.incarnation, trio.current_time() + timeout)
            elif record.state in gossip.TERMINAL:
                self._bury(record)
        self._changed.set()
        self._changed = trio.Event()

    def _bury(self, record: Member) -> None:
        """Keep the last verdict on a member for wait_for_dead. Members can churn through a full view without
        end (gossip.merge_all), so only the latest MAX_MEMBERS of them are remembered."""
        self._deaths[record.id] += 1
        self._tombstones.pop(record.id, None)
        self._tombstones[record.id] = record
        if len(self._tombstones) > gossip.MAX_MEMBERS:
            oldest = next(iter(self._tombstones))
            del self._tombstones[oldest], self._deaths[oldest]
