"""A member's state as one value and its pure steps: what each step does to the view, the queue, the suspicion
timers, the tombstones, and what it asks of the driver (version, declared_dead, full)."""
import math
import random

import attrs
import pytest

from node.membership import swim_state
from node.membership.gossip import MAX_MEMBERS, Heard, Member, Meta, State, SwimConfig
from node.membership.rules import Suspicion
from node.membership.swim_state import SwimState, Tombstone, absorb, announce, bury, expire, next_target, start

A, S, D, L = State.ALIVE, State.SUSPECT, State.DEAD, State.LEFT
OWN, ANSWER, REQUEST = Heard.OWN, Heard.ANSWER, Heard.REQUEST
CONFIG = SwimConfig()  # 1 s period, suspicion_mult 4: a suspicion among a few members lasts 4 s
NOW = 100.0


def m(member_id: str, inc: int, state: State = A, **meta: object) -> Member:
    return Member(member_id, f"http://{member_id}:8000", inc, state, Meta(**meta))


def state_of(*others: Member, me: Member = m("me", 5, stage=1), yields: bool = False, **fields: object) -> SwimState:
    return attrs.evolve(start(me, CONFIG, yields=yields), view={"me": me, **{o.id: o for o in others}}, **fields)


@pytest.mark.parametrize("me", [m("me", 5, S), m("me", 5, D), m("me", 5, L)])
def test_a_member_starts_alive_or_not_at_all(me):
    with pytest.raises(ValueError, match="must start ALIVE"):
        start(me, CONFIG)


@pytest.mark.parametrize("updates,heard,yields,declared_dead,my_inc", [
    # an answer holding us dead: a yielding stage steps aside instead of refuting
    ([m("me", 5, D, stage=1)], ANSWER, True, True, 5),
    ([m("me", 5, D, stage=1)], ANSWER, False, False, 6),  # a member that does not yield refutes
    ([m("me", 5, D, stage=1)], REQUEST, True, False, 6),  # a request's verdict speaks for nobody: refuted
    ([m("me", 4, D, stage=1)], ANSWER, True, True, 5),  # a stage's verdict is final, never stale
    ([m("me", 5, S, stage=1)], ANSWER, True, False, 6),  # an accusation short of death is refuted
    ([m("me", 5, D, stage=2)], ANSWER, True, False, 5),  # not about us as we are: ignored
])
def test_only_an_answer_declares_a_yielding_member_dead(updates, heard, yields, declared_dead, my_inc):
    after = absorb(state_of(yields=yields), updates, heard, NOW)
    assert (after.declared_dead, after.me.incarnation) == (declared_dead, my_inc)


@pytest.mark.parametrize("updates,version", [
    ([], 0),  # nothing heard
    ([m("x", 3)], 0),  # no news: the view holds x at 3 already
    ([m("x", 4)], 1),  # news about a known member
    ([m("y", 1), m("z", 1)], 1),  # one message is one change, however many members it brings
    ([m("me", 6, S, stage=1)], 1),  # a refutation changes our own record
])
def test_waiters_are_woken_once_per_message_that_changes_the_view_and_never_for_no_news(updates, version):
    assert absorb(state_of(m("x", 3)), updates, REQUEST, NOW).version == version


def test_being_declared_dead_wakes_waiters_even_when_the_view_does_not_change():
    after = absorb(state_of(yields=True), [m("me", 5, D, stage=1)], ANSWER, NOW)
    assert after.declared_dead and after.version == 1 and after.view == state_of().view


@pytest.mark.parametrize("before,update,heard,timer", [
    (None, m("x", 3, S), OWN, Suspicion(3, NOW + 4.0)),  # a new suspect gets its suspicion period
    (None, m("x", 3, D), REQUEST, Suspicion(3, NOW + 4.0)),  # a verdict in gossip is taken as an accusation
    (Suspicion(3, NOW - 1.0), m("x", 4), REQUEST, None),  # a refutation stops the timer
    (Suspicion(3, NOW - 1.0), m("x", 4, S), REQUEST, Suspicion(4, NOW + 4.0)),  # a new accusation restarts it
    (Suspicion(3, NOW - 1.0), m("x", 3, D), OWN, None),  # this view's own verdict ends it
    (Suspicion(3, NOW - 1.0), m("x", 2), REQUEST, Suspicion(3, NOW - 1.0)),  # stale news leaves it running
])
def test_a_suspicion_timer_runs_while_a_member_is_suspect_at_one_incarnation(before, update, heard, timer):
    known = m("x", 3, A if before is None else S)
    suspicions = {} if before is None else {"x": before}
    after = absorb(state_of(known, suspicions=suspicions), [update], heard, NOW)
    assert after.suspicions.get("x") == timer


def test_an_accusation_of_ourselves_starts_no_timer_we_refute_it():
    after = absorb(state_of(), [m("me", 5, S, stage=1)], REQUEST, NOW)
    assert after.suspicions == {} and after.me.state is A


def test_news_is_queued_for_gossip_as_the_view_now_holds_it():
    after = absorb(state_of(m("x", 3)), [m("x", 3, D), m("y", 1)], REQUEST, NOW)
    assert after.queue.about("x") == (m("x", 3, S),) and after.queue.about("y") == (m("y", 1),)


@pytest.mark.parametrize("records,deaths", [
    ([m("x", 3, D)], {"x": 1}),
    ([m("x", 3, D), m("x", 4, L)], {"x": 2}),  # died, came back, left: two deaths, the last record kept
    ([m("x", 3, D), m("y", 1, L)], {"x": 1, "y": 1}),
])
def test_each_verdict_on_a_member_is_counted_and_its_last_record_kept(records, deaths):
    kept = bury({}, records)
    assert {i: t.deaths for i, t in kept.items()} == deaths
    assert kept[records[-1].id].record == records[-1]


def test_only_the_latest_max_members_verdicts_are_remembered():
    kept = bury({}, [m(f"x{i}", 1, D) for i in range(MAX_MEMBERS + 3)])
    assert len(kept) == MAX_MEMBERS and next(iter(kept)) == "x3"
    again = bury(kept, [m("x3", 2, D)])  # a member dying again moves to the most recent end
    assert list(again)[-1] == "x3" and again["x3"].deaths == 2


@pytest.mark.parametrize("view_record,tombstone,deaths_before,gone", [
    (m("x", 3, D), None, 0, m("x", 3, D)),  # dead in the view now
    (m("x", 4), Tombstone(m("x", 3, D), 1), 0, m("x", 3, D)),  # died since, already back: still reported
    (m("x", 4), Tombstone(m("x", 3, D), 1), 1, None),  # its only death came before the call
    (m("x", 4), None, 0, None),  # alive and never dead
    (None, None, 0, None),  # never seen
])
def test_a_death_since_the_call_is_reported_even_after_a_restart(view_record, tombstone, deaths_before, gone):
    others = () if view_record is None else (view_record,)
    state = state_of(*others, tombstones={} if tombstone is None else {"x": tombstone})
    assert state.gone_since("x", deaths_before) == gone


@pytest.mark.parametrize("record,suspicion,want_state,timer_left", [
    (m("x", 3, S), Suspicion(3, NOW), D, False),  # ran out while suspect at that incarnation: dead
    (m("x", 3, S), Suspicion(3, NOW + 0.5), S, True),  # not yet due
    (m("x", 4, S), Suspicion(3, NOW), S, False),  # accused anew since: this timer ends without a verdict
])
def test_a_suspicion_that_runs_out_is_this_view_s_own_death_verdict(record, suspicion, want_state, timer_left):
    after = expire(state_of(record, suspicions={"x": suspicion}), NOW)
    assert after.view["x"].state is want_state and ("x" in after.suspicions) == timer_left


def test_a_dead_verdict_of_our_own_is_buried_and_gossiped():
    after = expire(state_of(m("x", 3, S), suspicions={"x": Suspicion(3, NOW)}), NOW)
    assert after.tombstones["x"] == Tombstone(m("x", 3, D), 1) and after.queue.about("x") == (m("x", 3, D),)


def test_a_failed_probe_makes_its_target_a_suspect_of_our_own():
    after = swim_state.probe_failed(state_of(m("x", 3)), "x", NOW)
    assert after.view["x"] == m("x", 3, S) and after.suspicions["x"] == Suspicion(3, NOW + 4.0)


@pytest.mark.parametrize("view", [(), (m("x", 3, D),), (m("x", 3, L),)])
def test_a_failed_probe_of_a_member_evicted_or_judged_meanwhile_changes_nothing(view):
    # a probe lasts a period; a full view may evict its target, or a verdict arrive, before it fails
    state = state_of(*view)
    assert swim_state.probe_failed(state, "x", NOW) is state


@pytest.mark.parametrize("deadlines,earliest", [([], math.inf), ([NOW + 3, NOW + 1], NOW + 1)])
def test_the_suspicion_loop_wakes_at_the_earliest_deadline(deadlines, earliest):
    suspicions = {f"x{i}": Suspicion(1, d) for i, d in enumerate(deadlines)}
    assert state_of(suspicions=suspicions).next_deadline() == earliest


def test_a_meta_announcement_bumps_our_incarnation_queues_it_and_wakes_waiters():
    after = announce(state_of(), NOW, ready=True, names=("pp-stage-1",))
    assert after.me == m("me", 6, ready=True, names=("pp-stage-1",), stage=1)
    assert after.queue.about("me") == (after.me,) and after.version == 1


@pytest.mark.parametrize("recipient,buddy", [
    (m("x", 3), False),  # alive: nothing to refute
    (m("x", 3, S), True),  # suspect: gets the accusation at once, to refute it
    (m("x", 3, D), True),
])
def test_a_member_we_hold_suspect_or_dead_hears_so_on_the_next_message_to_it(recipient, buddy):
    state = state_of(recipient, m("y", 1))
    state = attrs.evolve(state, queue=state.queue.enqueue(m("y", 1)))
    after, updates = swim_state.updates_for(state, "x")
    assert updates == ((recipient,) if buddy else ()) + (m("y", 1),)
    assert after.queue.pending[0].sends == 1  # the queued update counted a send; the buddy record is extra


def test_the_view_reaching_max_members_is_flagged_once_for_the_driver_to_log():
    full = absorb(state_of(), [m(f"x{i}", 1) for i in range(MAX_MEMBERS)], REQUEST, NOW)
    assert full.full and len(full.view) == MAX_MEMBERS
    assert absorb(full, [m("late", 1)], REQUEST, NOW).full  # stays set; the newcomer is refused
    assert not absorb(state_of(), [m("x", 1)], REQUEST, NOW).full


def test_probing_walks_a_round_over_every_eligible_member_once():
    state, rng, seen = state_of(m("a", 1), m("b", 1), m("c", 1, D), m("o", 1, observer=True)), random.Random(7), []
    for _ in range(4):
        state, target = next_target(state, rng)
        seen.append(target.id)
    assert sorted(seen[:2]) == ["a", "b"] and sorted(seen[2:]) == ["a", "b"]
    assert next_target(state_of(m("c", 1, D)), rng)[1] is None  # nobody to probe


@pytest.mark.parametrize("other,after", [
    (m("x", 3), State.DEAD), (m("x", 3, S), State.DEAD),  # known gone: dead at once, no timer
    (m("x", 3, L), State.LEFT),  # already gone: left as it is
])
def test_a_member_known_gone_is_declared_dead_by_this_view_at_once(other, after):
    state = swim_state.confirm_dead(state_of(other), "x", now_s=1.0)
    assert state.view["x"].state is after and "x" not in state.suspicions


def test_confirming_an_unknown_member_or_ourselves_dead_changes_nothing():
    state = state_of(m("x", 3))
    assert swim_state.confirm_dead(state, "nobody", now_s=1.0) is state
    assert swim_state.confirm_dead(state, "me", now_s=1.0) is state
