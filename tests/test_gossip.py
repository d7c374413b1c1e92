"""Pure membership rules: merge precedence, refutation, probe order, relays, suspicion math, dissemination."""
import itertools
import json
import random

import attrs
import cattrs
import pytest

from node.gossip import (Ack, Dissemination, Member, Meta, Nack, Ping, PingReq, ProbeRound, State, Suspicion,
                         SwimConfig, Sync, announce_meta, as_synced, choose_relays, expired_suspects, merge, merge_all,
                         next_target, pick_sync_peer, retransmit_limit, suspicion_timeout_s)

A, S, D, L = State.ALIVE, State.SUSPECT, State.DEAD, State.LEFT


def m(member_id: str, inc: int, state: State = A, **meta: object) -> Member:
    return Member(member_id, f"http://{member_id}:8000", inc, state, Meta(**meta))


@pytest.mark.parametrize("known,update,expected", [
    (None, m("x", 3), m("x", 3)),  # first sighting
    (None, m("x", 3, S), m("x", 3, S)),  # first sighting, whatever the state
    (m("x", 5), m("x", 4, S), None),  # old-incarnation suspect is ignored
    (m("x", 5), m("x", 5, S), m("x", 5, S)),
    (m("x", 5, S), m("x", 5, S), None),  # a repeated accusation is no news
    (m("x", 5, S), m("x", 5), None),  # alive needs a higher incarnation
    (m("x", 5, S), m("x", 6), m("x", 6)),  # alive at inc+1 clears suspect
    (m("x", 5, D), m("x", 5), None),  # alive at the same inc after dead stays dead (replay)
    (m("x", 5, D), m("x", 6), m("x", 6)),  # restarted with a higher incarnation
    (m("x", 5), m("x", 5, D), m("x", 5, D)),  # dead beats alive at the same incarnation
    (m("x", 5, S), m("x", 5, D), m("x", 5, D)),
    (m("x", 5, D), m("x", 5, S), None),
    (m("x", 5, D), m("x", 6, S), m("x", 6, S)),  # someone saw it alive at 6 since
    (m("x", 5), m("x", 5, L), m("x", 5, L)),
    (m("x", 5, D), m("x", 5, L), m("x", 5, L)),  # a graceful leave outranks a failure verdict
    (m("x", 5, L), m("x", 5, D), None),
    (m("x", 5), m("x", 5, ready=True), None),  # metadata changes need an incarnation bump
    (m("x", 5), m("x", 6, ready=True), m("x", 6, ready=True)),
])
def test_merge_follows_memberlist_precedence(known, update, expected):
    assert merge(known, update, self_id="me") == expected


@pytest.mark.parametrize("accusation,refuted_inc", [
    (m("me", 5, S), 6),
    (m("me", 5, D), 6),
    (m("me", 5, L), 6),  # we are still running, so we did not leave
    (m("me", 9, S), 10),  # inc = max(own, accused) + 1
    (m("me", 7), 8),  # a record of an earlier life of ours with a higher incarnation
    (m("me", 4, S), None),  # an accusation we already outbid
    (m("me", 5), None),  # our own alive record echoed back
])
def test_an_update_about_self_is_refuted_only_when_it_outbids_us(accusation, refuted_inc):
    own = m("me", 5, stage=2, names=("pp-stage-2",))
    refuted = merge(own, accusation, self_id="me")
    if refuted_inc is None:
        assert refuted is None
    else:
        assert refuted == attrs.evolve(own, incarnation=refuted_inc)  # alive, own address and meta kept


def test_accusations_about_self_queue_exactly_one_alive_above_the_highest():
    view = {"me": m("me", 5), "x": m("x", 1)}
    view, changed = merge_all(view, [m("me", 5, S), m("x", 2), m("me", 6, D)], "me")
    queue = Dissemination()
    for record in changed:
        queue = queue.enqueue(record)
    assert view["me"] == m("me", 7)
    assert queue.about("me") == (m("me", 7),)
    assert sorted(p.update.id for p in queue.pending) == ["me", "x"]


def test_merge_result_does_not_depend_on_arrival_order():
    updates = [m("x", 3), m("x", 3, S), m("x", 4), m("x", 4, D), m("x", 2, L), m("x", 4, S)]
    finals = {merge_all({"me": m("me", 1)}, order, "me")[0]["x"] for order in itertools.permutations(updates)}
    assert finals == {m("x", 4, D)}


def test_merge_all_reports_each_changed_member_once_with_its_final_record():
    view = {"me": m("me", 1), "x": m("x", 1), "y": m("y", 1)}
    new, changed = merge_all(view, [m("x", 1, S), m("x", 1, D), m("y", 0, D), m("z", 1)], "me")
    assert changed == (m("x", 1, D), m("z", 1))
    assert new["y"] == m("y", 1) and view["x"] == m("x", 1)  # the input view is left alone


@pytest.mark.parametrize("record,taken_as", [
    (m("x", 4, D), m("x", 4, S)), (m("x", 4, L), m("x", 4, L)), (m("x", 4, S), m("x", 4, S)), (m("x", 4), m("x", 4)),
])
def test_a_dead_verdict_in_a_full_state_sync_counts_only_as_suspicion(record, taken_as):
    assert as_synced(record) == taken_as


def test_meta_announcement_bumps_incarnation_and_wins_in_other_views():
    own = m("me", 5)
    announced = announce_meta(own, names=("pp-entry",), ready=True)
    assert announced == m("me", 6, names=("pp-entry",), ready=True)
    assert merge(own, announced, self_id="other") == announced


# --- probe order and relays ---------------------------------------------------------------------------------

VIEW = {v.id: v for v in [m("me", 1), m("a", 1), m("b", 1), m("c", 1), m("s", 1, S), m("obs", 1, observer=True),
                          m("d", 1, D), m("l", 1, L)]}
ELIGIBLE = {"a", "b", "c", "s"}  # suspects are still probed; observers, dead and left never


def probe_sequence(view, count, rng, rnd=ProbeRound()):
    picks = []
    for _ in range(count):
        target, rnd = next_target(rnd, view, "me", rng)
        picks.append(target)
    return picks, rnd


def test_round_robin_probes_every_eligible_member_once_per_round():
    picks, _ = probe_sequence(VIEW, 4 * 6, random.Random(7))
    rounds = [tuple(picks[i:i + 4]) for i in range(0, len(picks), 4)]
    assert all(set(r) == ELIGIBLE for r in rounds)
    assert len(set(rounds)) > 1  # reshuffled between rounds


def test_member_dying_mid_round_is_skipped_and_a_newcomer_waits_for_the_next_round():
    rng = random.Random(3)
    first, rnd = probe_sequence(VIEW, 2, rng)
    rest = sorted(ELIGIBLE - set(first))
    view = {**VIEW, rest[0]: attrs.evolve(VIEW[rest[0]], state=D), "new": m("new", 1)}
    tail, rnd = probe_sequence(view, 1, rng, rnd)
    assert tail == [rest[1]]
    next_round, _ = probe_sequence(view, 4, rng, rnd)
    assert set(next_round) == ELIGIBLE - {rest[0]} | {"new"}


def test_no_probe_target_when_alone_or_among_observers():
    view = {"me": m("me", 1), "obs": m("obs", 1, observer=True), "d": m("d", 1, D)}
    assert next_target(ProbeRound(), view, "me", random.Random(0)) == (None, ProbeRound())


@pytest.mark.parametrize("others,checks,expected_k", [
    (4, 3, 3), (3, 3, 2), (2, 3, 1), (1, 3, 0), (4, 1, 1), (4, 0, 0),
])
def test_indirect_probes_use_min_of_checks_and_other_alive_members(others, checks, expected_k):
    view = {v.id: v for v in [m("me", 1)] + [m(f"p{i}", 1) for i in range(others)]}
    relays = choose_relays(view, "me", "p0", checks, random.Random(0))
    assert len(relays) == expected_k and len({r.id for r in relays}) == expected_k
    assert all(r.id not in ("me", "p0") for r in relays)


def test_relays_and_sync_peers_are_never_observers_suspects_or_dead():
    for seed in range(20):
        relays = choose_relays(VIEW, "me", "a", 3, random.Random(seed))
        assert {r.id for r in relays} == {"b", "c"}
        assert pick_sync_peer(VIEW, "me", random.Random(seed)).id in {"a", "b", "c"}
    assert pick_sync_peer({"me": m("me", 1), "obs": m("obs", 1, observer=True)}, "me", random.Random(0)) is None


# --- suspicion ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,expected_s", [(1, 4.0), (5, 4.0), (10, 4.0), (100, 8.0), (1000, 12.0)])
def test_suspicion_timeout_is_mult_times_log10_n_periods(n, expected_s):
    config = SwimConfig(protocol_period_s=1.0, probe_timeout_s=0.5, suspicion_mult=4)
    assert suspicion_timeout_s(n, config) == pytest.approx(expected_s)


# memberlist's TestMemberList_ProbeNode_Suspect_Dogpile (interval 100 ms, SuspicionMult 5, MaxTimeoutMult 2);
# n counts the suspecting member too.
@pytest.mark.parametrize("n,confirmations,expected_s", [
    (2, 0, 0.5), (3, 0, 0.5), (4, 0, 0.5), (5, 0, 1.0), (6, 0, 1.0),
    (6, 1, 0.75), (6, 2, 0.604), (6, 3, 0.5), (6, 4, 0.5),
])
def test_dogpile_suspicion_shrinks_with_confirmations_as_memberlist(n, confirmations, expected_s):
    config = SwimConfig(protocol_period_s=0.1, probe_timeout_s=0.05, suspicion_mult=5,
                        suspicion_max_timeout_mult=2)
    assert suspicion_timeout_s(n, config, confirmations) == pytest.approx(expected_s, abs=1e-3)


@pytest.mark.parametrize("record,suspicion,expected", [
    (m("x", 5, S), Suspicion(5, 10.0), [m("x", 5, D)]),
    (m("x", 5, S), Suspicion(5, 10.5), []),  # not yet
    (m("x", 6), Suspicion(5, 10.0), []),  # refuted in time
    (m("x", 6, S), Suspicion(5, 10.0), []),  # suspected again at a newer incarnation: a newer timer rules
    (m("x", 5, D), Suspicion(5, 10.0), []),  # someone else's verdict arrived first
])
def test_expired_suspicion_becomes_dead_only_if_still_suspect_at_that_incarnation(record, suspicion, expected):
    assert expired_suspects({"x": record}, {"x": suspicion}, now_s=10.0) == expected


# --- dissemination -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,mult,expected", [(1, 4, 4), (5, 4, 4), (9, 4, 4), (10, 4, 8), (99, 4, 8),
                                             (100, 4, 12), (3, 2, 2)])
def test_retransmit_limit_is_mult_times_ceil_log10_n_plus_1(n, mult, expected):
    assert retransmit_limit(n, mult) == expected


def sent_batches(queue, times, max_count=16, limit=3):
    batches = []
    for _ in range(times):
        batch, queue = queue.take(max_count, limit)
        batches.append(batch)
    return batches, queue


def test_an_update_is_piggybacked_exactly_limit_times_then_dropped():
    batches, queue = sent_batches(Dissemination().enqueue(m("x", 1)), 5, limit=3)
    assert batches == [(m("x", 1),)] * 3 + [()] * 2
    assert queue.pending == ()


def test_a_newer_update_about_a_member_replaces_the_older_and_restarts_its_count():
    queue = Dissemination().enqueue(m("x", 1))
    _, queue = sent_batches(queue, 2, limit=3)
    batches, _ = sent_batches(queue.enqueue(m("x", 2, S)), 4, limit=3)
    assert batches == [(m("x", 2, S),)] * 3 + [()]


def test_least_sent_updates_go_first_and_newest_among_equals():
    queue = Dissemination().enqueue(m("a", 1)).enqueue(m("b", 1)).enqueue(m("c", 1))
    batches, _ = sent_batches(queue, 3, max_count=2, limit=10)
    assert [[u.id for u in batch] for batch in batches] == [["c", "b"], ["a", "c"], ["b", "a"]]


# --- config and wire ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes,match", [
    (dict(probe_timeout_s=1.0), "probe_timeout_s=1.0 must be shorter than protocol_period_s=1.0"),
    (dict(protocol_period_s=0), "protocol_period_s=0 must be > 0"),
    (dict(indirect_checks=-1), "indirect_checks=-1"),
])
def test_config_refuses_impossible_timing(changes, match):
    with pytest.raises(ValueError, match=match):
        SwimConfig(**changes)


@pytest.mark.parametrize("msg", [
    Ping(m("a", 3, stage=1, names=("pp-stage-1",), ready=True, progress=0.5), "b", 7, (m("c", 2, S),)),
    Ack("b", 7, (m("d", 1, D, observer=True),)),
    PingReq(m("a", 3), "b", "http://b:8000", 8, ()),
    Nack("c", 8, (m("a", 4, L),)),
    Sync((m("a", 3), m("b", 1, S, stage=0))),
])
def test_wire_messages_survive_a_json_round_trip_through_one_converter(msg):
    converter = cattrs.Converter()
    assert converter.structure(json.loads(json.dumps(converter.unstructure(msg))), type(msg)) == msg
