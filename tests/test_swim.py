"""The SWIM driver on an in-memory network, in virtual time: T = 100 ms, probe timeout 30 ms."""
import random

import attrs
import pytest
import trio
import trio.testing

from node.membership.gossip import MAX_ENTRIES, MAX_MEMBERS, Ack, Member, Meta, Nack, Ping, PingReq, State, Sync
from node.membership.rules import suspicion_timeout_s
from node.main import Replaced, step_aside_when_replaced
from node.membership.swim import Swim, WrongTargetError, wait_for_dead
from tests.swimnet import (T_S, TEST_CONFIG, CountedId, Node, SwimNet, Unplugged, addr_of, all_alive, kill, record_when,
                           start_cluster, start_node, state_of, wait_everywhere)

N = 5
IDS = [f"n{i}" for i in range(N)]
ROUND_S = (N - 1) * T_S  # each member probes every other once per round
# A joiner learns everyone before it from its seed's sync, and its first round pings each of them with its
# own record aboard, so all views hold all members one round after the last join (same for a restart).
CONVERGE_S = ROUND_S
# The announcer's pings carry its new record; members it already probed this round hear at the latest in the
# next one: (n-2) + (n-1) periods. Gossip usually gets there in O(log n) periods.
META_S = (2 * N - 3) * T_S
# Kill detection: up to a round before someone probes the victim, the failing period, the suspicion timeout,
# and 3 periods for the DEAD verdict to spread. (One prober may wait up to 2n-3 periods, since each round is
# reshuffled; with n-1 probers the first probe comes sooner.)
DETECTION_BOUND_S = (N - 1) * T_S + T_S + suspicion_timeout_s(N, TEST_CONFIG) + 3 * T_S


async def converged_cluster(nursery: trio.Nursery, net: SwimNet) -> list[Node]:
    nodes = await start_cluster(nursery, net, N)
    with trio.fail_after(CONVERGE_S):
        await wait_everywhere(nodes, all_alive(IDS))
    return nodes


async def test_five_members_converge_to_all_alive_in_every_view_within_a_round(nursery, autojump_clock):
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    assert [[m.id for m in node.swim.alive()] for node in nodes] == [IDS] * N


async def test_killed_member_is_dead_in_every_survivor_within_the_detection_bound(nursery, autojump_clock):
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    await trio.sleep(7.3 * T_S)  # an arbitrary phase within the probe rounds
    victim, survivors = nodes[3], nodes[:3] + nodes[4:]
    kill(net, victim)
    with trio.fail_after(DETECTION_BOUND_S):
        async with trio.open_nursery() as waiters:
            for node in survivors:
                waiters.start_soon(wait_for_dead, node.swim, "n3")
    assert [state_of("n3", node.swim) for node in survivors] == [State.DEAD] * 4
    assert all(len(node.swim.alive()) == N - 1 for node in survivors)


async def test_a_member_whose_connections_are_refused_is_dead_everywhere_without_a_suspicion_timeout(
        nursery, autojump_clock):
    """A refused connection is a probe's own proof that the process is gone: the first prober declares it dead
    at once, and every view that hears the accusation checks it with a probe of its own right away."""
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    await trio.sleep(7.3 * T_S)
    victim, survivors = nodes[3], nodes[:3] + nodes[4:]
    kill(net, victim, refused=True)
    with trio.fail_after((N - 1) * T_S + 3 * T_S):  # a round before the first probe, then the news; no timeout
        async with trio.open_nursery() as waiters:
            for node in survivors:
                waiters.start_soon(wait_for_dead, node.swim, "n3")
    assert [state_of("n3", node.swim) for node in survivors] == [State.DEAD] * 4


async def test_a_member_accused_by_hearsay_is_probed_at_once_and_stays_alive_when_it_answers(nursery, autojump_clock):
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    accused = nodes[2].swim.members()["n2"]
    before = net.sent[(addr_of("n0"), addr_of("n2"), "ping")]
    nodes[0].swim.on_sync(Sync(members=(attrs.evolve(accused, state=State.DEAD),)))  # taken as suspect
    await trio.sleep(T_S / 2)
    assert net.sent[(addr_of("n0"), addr_of("n2"), "ping")] > before  # checked within half a period, not when its turn came
    with trio.fail_after(2 * T_S):
        await wait_everywhere(nodes, all_alive(IDS))


async def test_dropped_link_is_bridged_by_a_relay_and_never_suspected(nursery, autojump_clock):
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    a, b = nodes[0].addr, nodes[1].addr
    net.dropped.add((a, b))  # only requests a -> b vanish
    suspected = record_when(nursery, nodes, lambda s: state_of("n1", s) is not State.ALIVE)
    await trio.sleep(60 * T_S)
    assert suspected == []
    assert net.sent[(a, b, "ping")] > 0
    assert sum(net.answered[(a, relay.addr, "ping_req", "Ack")] for relay in nodes[2:]) > 0


async def test_slow_but_alive_member_is_never_suspected(nursery, autojump_clock):
    # Round trip 60 ms: past the 30 ms probe timeout, within the 100 ms period. Relays give up on it (their
    # own timeout is 30 ms too), but the direct ping keeps waiting until the period ends.
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    slow = nodes[2]
    for other in nodes:
        net.latency_s[(other.addr, slow.addr)] = net.latency_s[(slow.addr, other.addr)] = 0.03
    doubted = record_when(nursery, nodes, lambda s: state_of("n2", s) is not State.ALIVE)
    await trio.sleep(200 * T_S)
    assert doubted == []
    assert sum(net.answered[(node.addr, relay.addr, "ping_req", "Nack")] for node in nodes for relay in nodes) > 0


async def test_suspected_member_refutes_with_a_higher_incarnation(nursery, autojump_clock):
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    target = nodes[1]
    dead = record_when(nursery, nodes, lambda s: state_of("n1", s) is State.DEAD)
    net.dropped.update((other.addr, target.addr) for other in nodes)  # nobody reaches n1; n1 reaches all
    with trio.fail_after(2 * ROUND_S):
        suspect = await nodes[0].swim.wait_until(lambda s: state_of("n1", s) is State.SUSPECT
                                                 and s.members()["n1"])
    net.dropped.clear()
    with trio.fail_after(suspicion_timeout_s(N, TEST_CONFIG)):
        await wait_everywhere(nodes, lambda s: state_of("n1", s) is State.ALIVE
                              and s.members()["n1"].incarnation > suspect.incarnation)
    await trio.sleep(20 * T_S)
    assert dead == []
    assert target.swim.me.incarnation > suspect.incarnation


async def test_restarted_member_with_higher_incarnation_is_alive_everywhere_within_a_round(nursery,
                                                                                          autojump_clock):
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    kill(net, nodes[3])
    survivors = nodes[:3] + nodes[4:]
    with trio.fail_after(DETECTION_BOUND_S):
        await wait_everywhere(survivors, lambda s: state_of("n3", s) is State.DEAD)
    restarted = await start_node(nursery, net, "n3", seeds=[nodes[0].addr], incarnation=1000)
    with trio.fail_after(CONVERGE_S):
        await wait_everywhere(survivors + [restarted], all_alive(IDS))
    assert all(node.swim.members()["n3"].incarnation == 1000 for node in survivors)


async def test_a_member_that_yields_when_declared_dead_does_not_refute_after_a_freeze(nursery, autojump_clock):
    # A stage frozen past the dead timeout has been replaced: when it wakes it must learn the verdict and
    # step aside (its owner exits), not come back alive serving a slice another member now holds.
    net = SwimNet(nursery)
    nodes = await start_cluster(nursery, net, N - 1)
    frozen = await start_node(nursery, net, "n4", seeds=[nodes[0].addr], yield_when_dead=True)
    with trio.fail_after(CONVERGE_S):
        await wait_everywhere(nodes + [frozen], all_alive(IDS))
    split = {(frozen.addr, o.addr) for o in nodes} | {(o.addr, frozen.addr) for o in nodes}
    net.dropped.update(split)
    with trio.fail_after(2 * DETECTION_BOUND_S):
        await wait_everywhere(nodes, lambda s: state_of("n4", s) is State.DEAD)
    assert not frozen.swim.declared_dead.is_set()
    net.dropped.difference_update(split)
    with trio.fail_after(2 * ROUND_S):
        await frozen.swim.declared_dead.wait()
    await trio.sleep(20 * T_S)
    assert [state_of("n4", node.swim) for node in nodes] == [State.DEAD] * (N - 1)


async def test_metadata_update_reaches_everyone_and_resolve_finds_it(nursery, autojump_clock):
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    assert all(node.swim.resolve("pp-stage-1") is None for node in nodes)
    announced = nodes[2].swim.update_meta(names=("pp-stage-1",), ready=True)
    with trio.fail_after(META_S):
        await wait_everywhere(nodes, lambda s: s.resolve("pp-stage-1"))
    assert [node.swim.resolve("pp-stage-1") for node in nodes] == [announced] * N
    assert announced.meta == Meta(names=("pp-stage-1",), ready=True) and announced.incarnation == 2


async def test_a_metadata_update_is_pushed_to_every_member_before_a_probe_period_passes(nursery, autojump_clock):
    # piggybacked on probes alone, the news reaches one member a period: pushed, it reaches them all in one go
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    await trio.sleep(T_S / 2)  # mid-period: no probe of this period is left to carry it
    announced = nodes[2].swim.update_meta(names=("pp-stage-1",), ready=True)
    with trio.fail_after(T_S * 0.9):
        await wait_everywhere(nodes, lambda s: s.resolve("pp-stage-1"))
    assert [node.swim.resolve("pp-stage-1") for node in nodes] == [announced] * N


async def test_member_cut_off_until_all_views_split_rejoins_once_the_network_heals(nursery, autojump_clock):
    # While n4 is cut off, it and the others declare each other dead. Afterwards nobody probes anybody
    # across the split; n4, alone, syncs with its seed every period, and dead verdicts in a sync count only
    # as suspicion, so the accused refute instead of dying.
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    cut, rest = nodes[4], nodes[:4]
    split = {(cut.addr, o.addr) for o in rest} | {(o.addr, cut.addr) for o in rest}
    net.dropped.update(split)
    with trio.fail_after(2 * DETECTION_BOUND_S):
        await wait_everywhere(rest, lambda s: state_of("n4", s) is State.DEAD)
        await cut.swim.wait_until(lambda s: all(state_of(i, s) is State.DEAD for i in IDS[:4]))
    net.dropped.difference_update(split)
    # Generous: a period until n4 syncs, a suspicion window for refutations, and two rounds for the
    # refutations to reach members that had, meanwhile, taken n4's stale verdicts about each other.
    with trio.fail_after(T_S + suspicion_timeout_s(N, TEST_CONFIG) + 2 * ROUND_S):
        await wait_everywhere(nodes, all_alive(IDS))
    assert net.sent[(cut.addr, nodes[0].addr, "sync")] > 0


async def test_observer_learns_the_view_and_is_never_probed_or_suspected(nursery, autojump_clock):
    net = SwimNet(nursery)
    nodes = await converged_cluster(nursery, net)
    runner = await start_node(nursery, net, "runner", seeds=[nodes[0].addr], meta=Meta(observer=True),
                              reachable=False)
    doubted = record_when(nursery, nodes, lambda s: state_of("runner", s) not in (None, State.ALIVE))
    await trio.sleep(50 * T_S)
    assert doubted == []
    assert all(state_of("runner", node.swim) is State.ALIVE for node in nodes)
    assert all(state_of(i, runner.swim) is State.ALIVE for i in IDS)
    assert [m.id for m in runner.swim.alive()] == IDS  # observers are never counted, themselves included
    assert all(len(node.swim.alive()) == N for node in nodes)
    assert sum(count for (src, dst, kind), count in net.sent.items() if dst == runner.addr) == 0
    assert sum(net.sent[(runner.addr, node.addr, "ping")] for node in nodes) >= 40


async def test_join_retries_until_a_seed_answers_and_reports_started_after(nursery, autojump_clock):
    net = SwimNet(nursery)
    up = trio.Event()

    async def bring_up_n1() -> None:
        await start_node(nursery, net, "n1", seeds=[addr_of("n0")])
        up.set()
    nursery.start_soon(bring_up_n1)
    await trio.sleep(2.0)
    assert not up.is_set()
    n0 = await start_node(nursery, net, "n0", seeds=[])
    with trio.fail_after(TEST_CONFIG.join_backoff_max_s + TEST_CONFIG.sync_timeout_s):
        await up.wait()
    assert state_of("n1", n0.swim) is State.ALIVE
    assert net.sent[(addr_of("n1"), addr_of("n0"), "sync")] >= 5  # it kept trying, with backoff


async def test_member_whose_seeds_are_down_starts_once_someone_joins_through_it(nursery, autojump_clock):
    net = SwimNet(nursery)
    n0_up = trio.Event()

    async def bring_up_n0() -> None:
        await start_node(nursery, net, "n0", seeds=[addr_of("never-rented")])
        n0_up.set()
    nursery.start_soon(bring_up_n0)
    await trio.sleep(1.0)
    assert not n0_up.is_set()
    with trio.fail_after(TEST_CONFIG.join_backoff_max_s + TEST_CONFIG.sync_timeout_s):
        n1 = await start_node(nursery, net, "n1", seeds=[addr_of("n0")])
        await n0_up.wait()
    assert len(n1.swim.alive()) == 2


def lone_swim(member_id: str = "a") -> Swim:
    """A member that is not running: the tests below call its inbound handlers only."""
    return Swim(Member(member_id, addr_of(member_id), 1), TEST_CONFIG, Unplugged(), random.Random(0), seeds=[])


async def test_wait_until_wakes_on_each_view_change_without_polling(nursery, mock_clock):
    swim = lone_swim()
    calls, results = [], []

    def entry(s: Swim) -> Member | None:
        calls.append(trio.current_time())
        return s.resolve("pp-entry")

    async def waiter() -> None:
        results.append(await swim.wait_until(entry))
    nursery.start_soon(waiter)
    await trio.testing.wait_all_tasks_blocked()
    assert len(calls) == 1 and results == []
    b = Member("b", addr_of("b"), 5)
    swim.on_sync(Sync((b,)))
    await trio.testing.wait_all_tasks_blocked()
    assert len(calls) == 2 and results == []
    swim.on_sync(Sync((b,)))  # no news: no wake-up
    await trio.testing.wait_all_tasks_blocked()
    assert len(calls) == 2
    me = swim.update_meta(names=("pp-entry",))
    await trio.testing.wait_all_tasks_blocked()
    assert results == [me] and len(calls) == 3
    assert calls == [0.0, 0.0, 0.0]  # the frozen clock never moved: nothing slept


async def test_a_ping_introduces_its_sender(nursery):
    swim = lone_swim("a")
    b = Member("b", addr_of("b"), 3, meta=Meta(stage=0, names=("pp-entry",)))
    ack = await swim.on_ping(Ping(sender=b, target_id="a", seq=41))
    assert ack.sender_id == "a" and ack.seq == 41
    assert swim.members()["b"] == b and swim.resolve("pp-entry") == b


class Seed:
    """A transport whose only peer is a seed answering every sync with `members`."""

    def __init__(self, *members: Member):
        self.members = members

    async def sync(self, addr: str, msg: Sync) -> Sync:
        return Sync(self.members)


async def test_ack_tells_a_pinger_we_hold_dead_about_its_death_after_gossip_about_it_ran_out(nursery):
    swim = Swim(Member("a", addr_of("a"), 1), TEST_CONFIG, Seed(Member("x", addr_of("x"), 4, State.DEAD)),
                random.Random(0), seeds=[])
    assert await swim.join(addr_of("seed"))  # an answer: a joiner takes its seed's verdicts on members it never saw
    y = Member("y", addr_of("y"), 1)
    for seq in range(1, 20):  # drains the dissemination queue
        await swim.on_ping(Ping(sender=y, target_id="a", seq=seq))
    assert (await swim.on_ping(Ping(sender=y, target_id="a", seq=99))).updates == ()
    ack = await swim.on_ping(Ping(sender=Member("x", addr_of("x"), 4), target_id="a", seq=100))
    assert ack.updates == (Member("x", addr_of("x"), 4, State.DEAD),)  # so x refutes at once
    assert swim.members()["x"].state is State.DEAD


async def test_ping_for_another_member_is_refused_naming_both(nursery, autojump_clock):
    swim = lone_swim("a")
    with pytest.raises(WrongTargetError, match="'zz'.*'a'"):
        await swim.on_ping(Ping(sender=Member("b", addr_of("b"), 1), target_id="zz", seq=1))
    assert "b" not in swim.members()


# --- issue 23: what a token holder's messages can no longer make a member do --------------------------------

EVIL_URL = "http://127.0.0.1:19999/any/path?q="  # the audit's: stage 0 POSTed there, bearer token attached
ATTACKER = Member("attacker", addr_of("attacker"), 1)  # a token holder; nobody listens at its address


class Dialled:
    """A transport that acks every ping and records where each one went."""

    def __init__(self):
        self.pings: list[tuple[str, str]] = []  # (address, target id)

    async def ping(self, addr: str, msg: Ping) -> Ack:
        self.pings.append((addr, msg.target_id))
        return Ack(sender_id=msg.target_id, seq=msg.seq)


async def test_a_ping_req_makes_the_relay_dial_only_the_target_s_own_address_or_nobody(nursery):
    dialled = Dialled()
    swim = Swim(Member("a", addr_of("a"), 1), TEST_CONFIG, dialled, random.Random(0), seeds=[])
    await swim.on_ping(Ping(sender=Member("b", addr_of("b"), 1), target_id="a", seq=1))
    assert isinstance(await swim.on_ping_req(PingReq(ATTACKER, "b", EVIL_URL, seq=2)), Ack)
    assert isinstance(await swim.on_ping_req(PingReq(ATTACKER, "nobody", EVIL_URL, seq=3)), Nack)
    assert dialled.pings == [(addr_of("b"), "b")]


async def stage_among_members(nursery: trio.Nursery, net: SwimNet, stage: int) -> tuple[Node, list[Node]]:
    """n0..n3 and, as n4, a stage that steps aside when declared dead (as node/main.py runs one)."""
    nodes = await start_cluster(nursery, net, N - 1)
    holder = await start_node(nursery, net, "n4", seeds=[nodes[0].addr], yield_when_dead=True,
                              meta=Meta(stage=stage, names=(f"pp-stage-{stage}",), ready=True))
    with trio.fail_after(CONVERGE_S):
        await wait_everywhere(nodes + [holder], all_alive(IDS))
    return holder, nodes + [holder]


async def test_requests_saying_a_live_stage_is_dead_make_it_suspect_at_most_and_it_refutes(nursery, autojump_clock):
    net = SwimNet(nursery)
    stage, everyone = await stage_among_members(nursery, net, 2)
    dead = record_when(nursery, everyone, lambda s: state_of("n4", s) in (State.DEAD, State.LEFT))
    verdict = attrs.evolve(stage.swim.me, incarnation=stage.swim.me.incarnation + 1, state=State.DEAD)
    for node in everyone:  # the stage itself included
        await node.swim.on_ping(Ping(ATTACKER, node.swim.me.id, seq=1, updates=(verdict,)))
        node.swim.on_sync(Sync((verdict,)))
    await trio.sleep(2 * DETECTION_BOUND_S)
    assert dead == [] and not stage.swim.declared_dead.is_set()
    assert {state_of("n4", node.swim) for node in everyone} == {State.ALIVE}
    assert all(node.swim.members()["n4"].incarnation > verdict.incarnation for node in everyone)  # refuted


async def test_a_member_announced_for_a_held_stage_neither_takes_it_nor_makes_its_holder_step_aside(
        nursery, autojump_clock):
    net = SwimNet(nursery)
    real, everyone = await stage_among_members(nursery, net, 1)
    stepped_aside = []

    async def holder_steps_aside_when_replaced() -> None:  # what node/main.py runs beside a stage's Swim
        with pytest.raises(Replaced) as raised:
            await step_aside_when_replaced(real.swim, 1)
        stepped_aside.append(raised.value)
    nursery.start_soon(holder_steps_aside_when_replaced)
    taken = record_when(nursery, everyone, lambda s: (h := s.resolve("pp-stage-1")) is not None and h.id != "n4")
    # a token holder's own member, answering probes, at a higher incarnation than the holder's
    fake = await start_node(nursery, net, "fake", seeds=[everyone[0].addr], incarnation=real.swim.me.incarnation + 1,
                            meta=Meta(stage=1, names=("pp-stage-1",), ready=True))
    for node in everyone:
        node.swim.on_sync(Sync((fake.swim.me,)))
    await trio.sleep(2 * DETECTION_BOUND_S)
    assert all(state_of("fake", node.swim) is State.ALIVE for node in everyone)  # a member like any other...
    assert taken == [] and [node.swim.resolve("pp-stage-1").id for node in everyone] == ["n4"] * N  # ...but queued
    assert stepped_aside == [] and not real.swim.declared_dead.is_set()


# --- issue 33: a token holder's members cannot flood a view, nor make one message cost the square of its size ----

def strangers(first: int, n: int, make_id=str) -> tuple[Member, ...]:
    """Members nobody runs, at addresses nobody listens at: what a token holder can name by the thousand."""
    return tuple(Member(make_id(f"s{i}"), addr_of(f"s{i}"), 1) for i in range(first, first + n))


async def test_syncs_naming_ever_more_members_leave_every_view_capped_and_every_member_alive(nursery, autojump_clock):
    net = SwimNet(nursery)
    stage, everyone = await stage_among_members(nursery, net, 0)
    gone = record_when(nursery, everyone, lambda s: any(state_of(i, s) is not State.ALIVE for i in IDS))
    largest = 0
    for batch in range(4):  # 4 * MAX_ENTRIES strangers in all, each sync within the entry cap
        for node in everyone:
            node.swim.on_sync(Sync(strangers(batch * MAX_ENTRIES, MAX_ENTRIES)))
            largest = max(largest, len(node.swim.members()))
        await trio.sleep(T_S)
    await trio.sleep(2 * DETECTION_BOUND_S)  # the strangers are probed, suspected, declared dead
    assert largest <= MAX_MEMBERS and all(len(node.swim.members()) <= MAX_MEMBERS for node in everyone)
    assert gone == [] and not stage.swim.declared_dead.is_set()
    assert [node.swim.resolve("pp-stage-0").id for node in everyone] == ["n4"] * N


async def test_a_sync_costs_work_in_proportion_to_its_members_not_their_square():
    work = []
    for n in (MAX_ENTRIES // 4, MAX_ENTRIES):
        swim = lone_swim()
        msg = Sync(strangers(0, n, CountedId))
        CountedId.ops = 0
        swim.on_sync(msg)
        work.append(CountedId.ops)
    assert work[1] <= 5 * work[0]  # four times the members, four times the work (quadratic: sixteen)
