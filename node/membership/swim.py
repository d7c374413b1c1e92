"""SWIM-lite driver: probe loop, suspicion timers, push/pull sync and inbound handlers, over a Transport.

Decisions live in node.membership.rules, and so do the rules on what a message may claim (its opening comment);
the member's state is one value, swim_state.SwimState, moved by the pure steps beside it. This file applies them:
it owns time (trio's clock only, so tests run under MockClock) and I/O, and says where each update was heard: in a
request to this member, in an answer from an address it dialled, or from its own failure detector.
"""
from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol, TypeVar

import trio

from node.membership import rules, swim_state
from node.membership.gossip import Ack, Heard, Member, Nack, Ping, PingReq, State, SwimConfig, Sync
from node.membership.swim_state import SwimState

log = logging.getLogger(__name__)
PUSH_FANOUT = 8  # members a change of own metadata is pushed to at once (the rest hear it by gossip)
T = TypeVar("T")


class TransportError(Exception):
    """A request to a member failed: connection error, timeout or non-2xx answer."""

    def __init__(self, addr: str, problem: str, *, refused: bool = False):
        super().__init__(f"{addr}: {problem}")
        self.addr, self.problem = addr, problem
        self.refused = refused  # the connection was refused: nothing listens at addr any more


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
        self.config = config
        self._id = self_member.id
        self._state: SwimState = swim_state.start(self_member, config, yields=yield_when_dead)
        self._transport, self._rng = transport, rng
        self._seeds = tuple(addr for addr in seeds if addr != self_member.addr)
        self._seq = itertools.count(1)
        self._changed = trio.Event()  # set and replaced on every view change
        self._news = trio.Event()  # own metadata changed: the sync loop pushes it at once
        self._suspects: list[str] = []  # members newly suspect: probed at once (_suspicion_loop)
        # Set, with yield_when_dead, once an answer holds this member dead (SwimState.yields): its owner exits.
        self.declared_dead = trio.Event()

    # --- queries ------------------------------------------------------------------------------------------

    @property
    def me(self) -> Member:
        return self._state.me

    def members(self) -> dict[str, Member]:
        """A snapshot of the view, self included, keyed by id."""
        return dict(self._state.view)

    def alive(self) -> tuple[Member, ...]:
        """Non-observer ALIVE members, self included, by id."""
        return self._state.alive()

    def resolve(self, name: str) -> Member | None:
        """The member holding `name` (rules.holder): of the reachable members registered under it (ALIVE or
        SUSPECT, non-observer), the one this view saw first. A suspect may be just slow, so messages still go
        to it until this view declares it dead; then the name passes to the next, a replacement."""
        return rules.holder(self._state.view, name)

    async def wait_until(self, predicate: Callable[[Swim], T]) -> T:
        """Evaluate predicate(self) now and after every view change; return its first truthy result."""
        while True:
            changed = self._changed
            result = predicate(self)
            if result:
                return result
            await changed.wait()

    # --- own metadata -------------------------------------------------------------------------------------

    def update_meta(self, **changes: object) -> Member:
        """Change own metadata (names, ready, progress...) and gossip it, pushed at once to up to PUSH_FANOUT
        alive members (the sync loop's next round) rather than left to piggyback on the next probes: a stage
        that says it is ready is seen ready in one round trip (issue 36). Each call bumps the incarnation, so
        throttle progress reports to a few per minute."""
        self._step(swim_state.announce, **changes)
        self._news.set()
        return self.me

    def confirm_dead(self, member_id: str) -> None:
        """Declare a member dead that is known gone without a probe (the runner saw its process exit), and
        push the news at once: every view passes its names to a replacement now, not after a suspicion
        timeout (issue 36: 1-4 s of a failover)."""
        self._step(swim_state.confirm_dead, member_id)
        self._news.set()

    # --- inbound, called by the HTTP layer ----------------------------------------------------------------

    async def on_ping(self, msg: Ping) -> Ack:
        if msg.target_id != self._id:
            raise WrongTargetError(f"ping for member {msg.target_id!r} reached member {self._id!r} "
                                   f"at {self.me.addr}")
        self._step(swim_state.absorb, (msg.sender, *msg.updates), Heard.REQUEST)
        return Ack(sender_id=self._id, seq=msg.seq, updates=self._updates_for(msg.sender.id))

    async def on_ping_req(self, msg: PingReq) -> Ack | Nack:
        """Ping the target on the sender's behalf, at the address our view holds for it (never the one the
        request names); Nack if it does not ack within our probe timeout, or at once if it is no member we
        would probe ourselves."""
        self._step(swim_state.absorb, (msg.sender, *msg.updates), Heard.REQUEST)
        target, acked = rules.relay_target(self._state.view, self._id, msg.target_id), False
        if target is not None:
            with trio.move_on_after(self.config.probe_timeout_s):
                acked = await self._ping(target.id, target.addr)
        reply = Ack if acked else Nack
        return reply(sender_id=self._id, seq=msg.seq, updates=self._updates_for(msg.sender.id))

    def on_sync(self, msg: Sync) -> Sync:
        self._step(swim_state.absorb, msg.members, Heard.REQUEST)
        return Sync(members=tuple(self._state.view.values()))

    # --- the protocol -------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join through the seeds, then run the protocol until cancelled.

        Reports started only after the join, i.e. once a seed answered (or at once with no seeds, or when a
        member already joined through us): an owner that awaits nursery.start(swim.run) then sees the
        cluster's view rather than a view of one, and a member that reaches no seed never claims to be up.
        """
        delay = self.config.join_backoff_s
        while self._seeds and self._state.alone() and not await _any(self.join, self._seeds):
            log.info("%s: no seed of %s answered; retrying in %.1f s", self._id, self._seeds, delay)
            await trio.sleep(delay)
            delay = min(2 * delay, self.config.join_backoff_max_s)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._suspicion_loop)
            nursery.start_soon(self._sync_loop)
            nursery.start_soon(self._probe_loop)
            task_status.started()

    async def _probe_loop(self) -> None:
        while True:
            period_end = trio.current_time() + self.config.protocol_period_s
            self._state, target = swim_state.next_target(self._state, self._rng)
            if target is None:
                await _any(self.join, self._seeds)  # alone: look for the cluster again
            elif not await self._probe(target, period_end):
                self._step(swim_state.probe_failed, target.id)
            await trio.sleep_until(period_end)

    async def _probe(self, target: Member, period_end: float) -> bool:
        """Direct ping; if no ack within the probe timeout, ping-req through k relays while the direct ping
        keeps waiting (memberlist's fallback), all until the period ends. True if anything acked."""
        acked, direct_done = trio.Event(), trio.Event()

        async def direct() -> None:
            if await self._ping(target.id, target.addr):
                acked.set()
            direct_done.set()

        async def via(relay: Member) -> None:
            msg = PingReq(sender=self.me, target_id=target.id, target_addr=target.addr, seq=next(self._seq),
                          updates=self._updates_for(relay.id))
            try:
                reply = await self._transport.ping_req(relay.addr, msg)
            except TransportError as exc:
                log.debug("%s: ping-req via %s failed: %s", self._id, relay.id, exc)
                return
            self._step(swim_state.absorb, reply.updates, Heard.ANSWER)
            if isinstance(reply, Ack) and reply.seq == msg.seq:
                acked.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(direct)
            with trio.move_on_after(self.config.probe_timeout_s):
                await direct_done.wait()
            if not acked.is_set():
                for relay in rules.choose_relays(self._state.view, self._id, target.id, self.config.indirect_checks,
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
            if exc.refused:  # nothing listens there: the member's process is gone, no suspicion to wait out
                self._step(swim_state.confirm_dead, target_id)
            return False
        self._step(swim_state.absorb, ack.updates, Heard.ANSWER)
        return ack.seq == seq

    async def _suspicion_loop(self) -> None:
        """Run out suspicion timers; and probe each member that turns suspect at once, rather than when its turn
        comes round: an accusation heard from another member (the runner's, whose child exited) is checked in
        one round trip, and a refused connection ends it (issue 36: the chain waited 4 s for a timer)."""
        async def check(member: Member) -> None:
            with trio.move_on_after(self.config.probe_timeout_s):
                await self._ping(member.id, member.addr)

        async with trio.open_nursery() as checks:
            while True:
                changed = self._changed
                with trio.move_on_at(self._state.next_deadline()):
                    await changed.wait()
                self._step(swim_state.expire)
                suspects, self._suspects = self._suspects, []
                for member_id in suspects:
                    if (member := self._state.view.get(member_id)) is not None and member.state is State.SUSPECT:
                        checks.start_soon(check, member)

    async def _sync_loop(self) -> None:
        """A full sync with one member every sync_interval_s; own news (update_meta) goes to several at once."""
        while True:
            with trio.move_on_after(self.config.sync_interval_s):
                await self._news.wait()
            if self._news.is_set():
                self._news = trio.Event()
                others = sorted(m.addr for m in self._state.view.values()  # the runner, an observer, too
                                if m.state is State.ALIVE and m.id != self._id)
                await _any(self.join, self._rng.sample(others, min(PUSH_FANOUT, len(others))))
                continue
            peer = rules.pick_sync_peer(self._state.view, self._id, self._rng)
            if peer is not None:
                await self.join(peer.addr)

    async def join(self, addr: str) -> bool:
        """Push/pull with `addr` now; True if it answered in time. Besides the join through the seeds and the
        periodic sync, a runner that nobody can dial (behind NAT) introduces the members to each other this way:
        each sync hands the next member the view so far."""
        with trio.move_on_after(self.config.sync_timeout_s):
            try:
                reply = await self._transport.sync(addr, Sync(members=tuple(self._state.view.values())))
            except TransportError as exc:  # a certificate of another cluster's is worth saying out loud
                log.log(logging.WARNING if "PP_CLUSTER_TOKEN" in str(exc) else logging.DEBUG,
                        "%s: sync with %s failed: %s", self._id, addr, exc)
                return False
            self._step(swim_state.absorb, reply.members, Heard.ANSWER)
            return True
        log.debug("%s: sync with %s timed out", self._id, addr)
        return False

    # --- state --------------------------------------------------------------------------------------------

    def _updates_for(self, recipient_id: str) -> tuple[Member, ...]:
        """What to piggyback on a message to `recipient_id` (swim_state.updates_for)."""
        self._state, updates = swim_state.updates_for(self._state, recipient_id)
        return updates

    def _step(self, step: Callable[..., SwimState], *args: object, **kwargs: object) -> None:
        """Apply a pure step of swim_state at the trio clock's now, then do what the new state asks of the world:
        wake waiters on a change, step aside once declared dead, log once when the view is full."""
        old = self._state
        self._state = new = step(old, *args, now_s=trio.current_time(), **kwargs)
        if new.declared_dead and not old.declared_dead:
            self.declared_dead.set()
        if new.full and not old.full:  # once: a token holder could otherwise fill the log as well
            log.warning("%s: the member view is full (%d records); members never seen before are refused while "
                        "no dead one can give way", self._id, len(new.view))
        if new.version != old.version:
            self._suspects += rules.new_suspects(old.view, new.view)
            self._changed.set()
            self._changed = trio.Event()


async def wait_for_dead(swim: Swim, member_id: str) -> Member:
    """The DEAD/LEFT record of `member_id` once it is (or already is) declared gone in `swim`'s view. A death
    after the call is reported even if a restart has already replaced it in the view."""
    deaths_before = swim._state.deaths(member_id)
    return await swim.wait_until(lambda s: s._state.gone_since(member_id, deaths_before))


async def _any(ask: Callable[[str], Awaitable[bool]], addrs: Iterable[str]) -> bool:
    """Ask every address at once; True if any of them answered."""
    answered: list[str] = []

    async def one(addr: str) -> None:
        if await ask(addr):
            answered.append(addr)

    async with trio.open_nursery() as nursery:
        for addr in addrs:
            nursery.start_soon(one, addr)
    return bool(answered)
