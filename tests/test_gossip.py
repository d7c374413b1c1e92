"""Pure membership rules: merge precedence, refutation, what a message may claim, probe order, relays, names,
suspicion math, dissemination."""
import itertools
import json
import random

import attrs
import cattrs
import pytest

from node.membership.gossip import (MAX_ENTRIES, MAX_MEMBERS, Ack, Heard, Member, Meta, Nack, Ping, PingReq, State,
                                    SwimConfig, Sync)
from node.membership.rules import (Dissemination, ProbeRound, Suspicion, announce_meta, as_heard, choose_relays,
                                   declares_dead, expired_suspects, holder, is_final, is_origin, merge, merge_all,
                                   next_target, pick_sync_peer, relay_target, retransmit_limit, same_identity,
                                   suspicion_timeout_s)
from node.transport import wire
from tests.swimnet import CountedId

A, S, D, L = State.ALIVE, State.SUSPECT, State.DEAD, State.LEFT
OWN, ANSWER, REQUEST = Heard.OWN, Heard.ANSWER, Heard.REQUEST


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


ME = m("me", 5, stage=2, names=("pp-stage-2",))


def about_me(inc: int, state: State = A, **where: object) -> Member:
    """A record about ME as every view holds it (its address and meta), at another incarnation or state."""
    return attrs.evolve(ME, incarnation=inc, state=state, **where)


@pytest.mark.parametrize("accusation,refuted_inc", [
    (about_me(5, S), 6),
    (about_me(5, D), 6),
    (about_me(5, L), 6),  # we are still running, so we did not leave
    (about_me(9, S), 10),  # inc = max(own, accused) + 1
    (about_me(7), 8),  # a record of an earlier life of ours with a higher incarnation
    (about_me(4, S), None),  # an accusation we already outbid
    (about_me(5), None),  # our own alive record echoed back
    (about_me(9, S, addr="http://elsewhere:8000"), None),  # not about us as we are: nothing to refute
])
def test_an_update_about_self_is_refuted_only_when_it_outbids_us(accusation, refuted_inc):
    refuted = merge(ME, accusation, self_id="me")
    if refuted_inc is None:
        assert refuted is None
    else:
        assert refuted == attrs.evolve(ME, incarnation=refuted_inc)  # alive, own address and meta kept


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


# --- bounds: what a view may hold, what a message may carry --------------------------------------------------

def ids(view):
    return list(view)


@pytest.mark.parametrize("view,updates,heard,want_ids,want_changed", [
    # room left (the cap is the view's size plus one blank): a newcomer is appended
    ([m("me", 1), m("a", 1), None], [m("n", 1)], REQUEST, ["me", "a", "n"], ["n"]),
    # full of live members (suspects are live too): every newcomer is refused, whoever sends it
    ([m("me", 1), m("a", 1), m("b", 1, S)], [m("n", 1), m("o", 1)], REQUEST, ["me", "a", "b"], []),
    ([m("me", 1), m("a", 1), m("b", 1, S)], [m("n", 1, D)], ANSWER, ["me", "a", "b"], []),
    # full, but news about known members is taken as ever
    ([m("me", 1), m("a", 1), m("b", 1)], [m("n", 1), m("a", 2, S)], REQUEST, ["me", "a", "b"], ["a"]),
    # full with dead or gone records: newcomers take their places, oldest first, and no more than there are
    ([m("me", 1), m("d1", 1, D), m("a", 1), m("d2", 1, L)], [m("n", 1), m("o", 1), m("p", 1)], REQUEST,
     ["me", "a", "n", "o"], ["n", "o"]),
    # a record that changed in this very message does not give way, nor does one brought back to life
    ([m("me", 1), m("d1", 1, D), m("d2", 1, D)], [m("d1", 1, L), m("n", 1)], OWN, ["me", "d1", "n"], ["d1", "n"]),
    ([m("me", 1), m("r", 1, D), m("d", 1, D)], [m("r", 2), m("n", 1)], REQUEST, ["me", "r", "n"], ["r", "n"]),
])
def test_a_full_view_takes_newcomers_only_in_place_of_dead_members_never_of_live_ones(view, updates, heard,
                                                                                      want_ids, want_changed):
    known = {r.id: r for r in view if r is not None}
    new, changed = merge_all(known, updates, "me", heard=heard, max_members=len(view))
    assert ids(new) == want_ids and [r.id for r in changed] == want_changed
    assert all(new[i] == r for i, r in known.items() if i in new and i not in want_changed)  # the rest untouched


def test_a_view_never_grows_past_max_members_however_many_newcomers_a_message_names():
    newcomers = [m(f"x{i}", 1) for i in range(MAX_MEMBERS + 10)]
    view, changed = merge_all({"me": m("me", 1)}, newcomers, "me", heard=REQUEST)
    assert len(view) == MAX_MEMBERS and len(changed) == MAX_MEMBERS - 1 and "me" in view


def many(n: int) -> tuple[Member, ...]:
    return tuple(m(f"x{i}", 1) for i in range(n))


@pytest.mark.parametrize("make", [
    lambda ms: Sync(ms),
    lambda ms: Ping(m("a", 1), "b", 1, ms),
    lambda ms: Ack("b", 1, ms),
    lambda ms: PingReq(m("a", 1), "b", "http://b:8000", 1, ms),
    lambda ms: Nack("b", 1, ms),
])
def test_a_message_carrying_more_than_max_entries_members_is_refused_naming_the_limit(make):
    assert make(many(MAX_ENTRIES))  # the cap itself is fine: a sync carries a whole (full) view
    with pytest.raises(ValueError, match=f"{MAX_ENTRIES + 1} members, over the limit of {MAX_ENTRIES}"):
        make(many(MAX_ENTRIES + 1))


def test_a_sync_body_past_the_cap_is_a_wire_error_naming_the_limit():
    body = json.dumps({"members": cattrs.Converter().unstructure(many(4 * MAX_ENTRIES))})
    with pytest.raises(wire.WireError, match=f"{4 * MAX_ENTRIES} members, over the limit of {MAX_ENTRIES}"):
        wire.decode(Sync, body)


def test_piggybacking_cannot_be_configured_past_what_a_message_may_carry():
    with pytest.raises(ValueError, match="max_piggyback"):
        SwimConfig(max_piggyback=MAX_ENTRIES)


def queue_work(pending: int, enqueued: int) -> int:
    queue = Dissemination().enqueue_all(m(CountedId(f"p{i}"), 1) for i in range(pending))
    CountedId.ops = 0
    queue.enqueue_all(m(CountedId(f"n{i}"), 1) for i in range(enqueued))
    return CountedId.ops


def test_enqueueing_a_message_s_changes_costs_work_in_proportion_to_queue_plus_changes():
    for pending, enqueued in [(0, 256), (256, 256), (256, 1), (1, 256)]:
        assert queue_work(pending, enqueued) <= 4 * (pending + enqueued)


def test_the_queue_keeps_the_newest_max_members_updates():
    queue = Dissemination().enqueue_all(m(f"x{i}", 1) for i in range(MAX_MEMBERS + 5))
    assert [p.update.id for p in queue.pending] == [f"x{i}" for i in range(5, MAX_MEMBERS + 5)]


# --- what a message may claim -------------------------------------------------------------------------------

@pytest.mark.parametrize("known,update,heard,taken_as", [
    (m("x", 4), m("x", 4, D), REQUEST, m("x", 4, S)),  # anyone holding the token can say so: an accusation
    (m("x", 4), m("x", 4, D), ANSWER, m("x", 4, S)),  # a member's view, not this one's
    (m("x", 4), m("x", 4, L), ANSWER, m("x", 4, S)),
    (m("x", 4), m("x", 4, D), OWN, m("x", 4, D)),  # this view's own detector
    (None, m("x", 4, D), ANSWER, m("x", 4, D)),  # a joiner learns from its seed who is already gone
    (None, m("x", 4, D), REQUEST, m("x", 4, S)),
    (m("x", 4), m("x", 5, S), REQUEST, m("x", 5, S)),
    (m("x", 4), m("x", 5), REQUEST, m("x", 5)),
])
def test_a_verdict_in_gossip_counts_only_as_suspicion_unless_this_view_reached_it(known, update, heard, taken_as):
    assert as_heard(known, update, heard) == taken_as


@pytest.mark.parametrize("addr,ok", [
    ("http://10.0.0.5:8000", True),
    ("https://node.example:443", True),
    ("http://[::1]:8000", True),
    ("http://node.example", True),
    ("http://127.0.0.1:19999/any/path?q=", False),  # issue 23's SSRF
    ("http://user:secret@10.0.0.5:8000", False),
    ("http://@10.0.0.5:8000", False),
    ("http://10.0.0.5:8000/swim", False),
    ("http://10.0.0.5:8000/", False),
    ("http://10.0.0.5:8000?q=1", False),
    ("http://10.0.0.5:8000?", False),
    ("http://10.0.0.5:8000#frag", False),
    ("ftp://10.0.0.5:8000", False),
    ("file:///etc/passwd", False),
    ("http://10.0.0.5:99999", False),
    ("http://10.0.0.5:port", False),
    ("http://:8000", False),
    ("http://10.0.0.5:8000\n", False),
    ("", False),
])
def test_a_member_address_is_a_bare_http_origin(addr, ok):
    assert is_origin(addr) is ok
    assert (merge(None, Member("x", addr, 1), self_id="me") is not None) is ok  # a first sighting elsewhere is dropped


KNOWN = m("x", 5, stage=1, names=("pp-stage-1",))


@pytest.mark.parametrize("update", [
    attrs.evolve(KNOWN, incarnation=9, addr="http://elsewhere:8000"),
    attrs.evolve(KNOWN, incarnation=9, state=D, addr="http://elsewhere:8000"),
    m("x", 9, stage=2, names=("pp-stage-2",)),
    m("x", 9, names=("pp-stage-1",)),  # no stage
    m("x", 9, stage=1, names=("pp-stage-1",), observer=True),
])
def test_a_record_moving_a_known_member_or_changing_its_stage_is_dropped(update):
    assert not same_identity(update, KNOWN)
    assert merge(KNOWN, update, self_id="me", heard=REQUEST) is None
    assert merge(KNOWN, update, self_id="me", heard=ANSWER) is None


def test_a_new_member_at_a_known_member_s_address_is_taken():
    # vast.ai reuses addresses: a replacement is a new id, wherever it listens
    replacement = attrs.evolve(KNOWN, id="y", incarnation=1)
    view, changed = merge_all({"me": m("me", 1), "x": KNOWN}, [replacement], "me", heard=REQUEST)
    assert changed == (replacement,) and list(view) == ["me", "x", "y"]


def test_news_of_a_known_member_where_it_always_was_is_taken():
    news = m("x", 6, stage=1, names=("pp-stage-1",), ready=True)
    assert same_identity(news, KNOWN) and merge(KNOWN, news, self_id="me", heard=REQUEST) == news


@pytest.mark.parametrize("own,update,heard,dead", [
    (ME, about_me(5, D), ANSWER, True),
    (ME, about_me(5, L), ANSWER, True),
    (ME, about_me(4, D), ANSWER, True),  # a stage's verdict is final: none is stale
    (ME, about_me(5, D), REQUEST, False),  # anyone holding the token can say so
    (ME, about_me(5, D), OWN, False),
    (ME, about_me(5, S), ANSWER, False),  # an accusation to refute, not a verdict
    (ME, about_me(5, D, addr="http://elsewhere:8000"), ANSWER, False),  # not about us as we are
    (ME, attrs.evolve(about_me(5, D), id="other"), ANSWER, False),
    (m("me", 5), m("me", 5, D), ANSWER, True),
    (m("me", 5), m("me", 4, D), ANSWER, False),  # a member without a stage: stale, from before a refutation
])
def test_a_member_is_declared_dead_for_itself_only_in_an_answer(own, update, heard, dead):
    assert declares_dead(update, own, heard) is dead


@pytest.mark.parametrize("update,heard,yields,after", [
    (about_me(5, D), REQUEST, True, about_me(6)),  # neither obeyed nor let stand: refuted
    (about_me(5, L), REQUEST, True, about_me(6)),
    (about_me(5, D), ANSWER, True, ME),  # a verdict: the owner steps aside, and we do not refute
    (about_me(5, D), ANSWER, False, about_me(6)),  # a member that does not yield refutes even that
    (about_me(5, S), ANSWER, True, about_me(6)),
    (about_me(9, S, addr="http://elsewhere:8000"), REQUEST, True, ME),  # not about us as we are
])
def test_a_request_s_verdict_about_self_is_never_obeyed(update, heard, yields, after):
    view, _ = merge_all({"me": ME}, [update], "me", heard=heard, yields=yields)
    assert view["me"] == after and view["me"].state is A


@pytest.mark.parametrize("known,update,expected", [
    (m("x", 5, D, stage=1), m("x", 9, stage=1), None),  # a stage's holder declared dead stays dead
    (m("x", 5, L, stage=1), m("x", 9, stage=1), None),
    (m("x", 5, D, stage=0), m("x", 9, S, stage=0), None),  # stage 0 too
    (m("x", 5, D, stage=1), m("x", 9, L, stage=1), None),
    (m("x", 5, S, stage=1), m("x", 9, stage=1), m("x", 9, stage=1)),  # a suspect refutes
    (m("x", 5, D), m("x", 9), m("x", 9)),  # a member without a stage (the runner) comes back
])
def test_a_stage_holder_s_death_is_final_and_a_stageless_member_can_come_back(known, update, expected):
    assert is_final(known) is (expected is None)
    assert merge(known, update, self_id="me", heard=REQUEST) == expected


def test_the_stage_and_observer_flag_cannot_be_announced_anew():
    own = m("me", 5, stage=1)
    with pytest.raises(ValueError, match="stage is fixed"):
        announce_meta(own, stage=2)
    with pytest.raises(ValueError, match="observer is fixed"):
        announce_meta(own, observer=True)
    assert announce_meta(own, stage=1, ready=True) == m("me", 6, stage=1, ready=True)


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


@pytest.mark.parametrize("target_id,expected", [
    ("a", "a"), ("s", "s"),  # at the address this view holds, whatever the request names
    ("zz", None),  # unknown: nack without dialling anyone
    ("me", None), ("obs", None), ("d", None), ("l", None),
])
def test_a_relay_pings_only_a_member_it_would_probe_itself(target_id, expected):
    target = relay_target(VIEW, "me", target_id)
    assert target == (VIEW[expected] if expected else None)


# --- names -------------------------------------------------------------------------------------------------

REAL = m("real", 5, stage=1, names=("pp-stage-1",), ready=True)
CLAIMANT = m("claimant", 99, stage=1, names=("pp-stage-1",), ready=True)


@pytest.mark.parametrize("members,expected", [
    ([REAL, CLAIMANT], "real"),  # the first registered keeps the name against a higher incarnation
    ([attrs.evolve(REAL, state=S), CLAIMANT], "real"),  # a suspect may be just slow
    ([attrs.evolve(REAL, state=D), CLAIMANT], "claimant"),  # declared dead: the name passes on
    ([attrs.evolve(REAL, state=L), CLAIMANT], "claimant"),
    ([m("real", 5, stage=1, ready=True), CLAIMANT], "claimant"),  # first seen, but not registered under it
    ([m("real", 5, stage=1, names=("pp-stage-1",), observer=True), CLAIMANT], "claimant"),
    ([attrs.evolve(REAL, state=D)], None),
    ([], None),
])
def test_a_name_is_held_by_its_first_registered_live_member(members, expected):
    found = holder({m.id: m for m in members}, "pp-stage-1")
    assert (found.id if found else None) == expected


def test_a_later_claimant_takes_a_name_only_once_this_view_declares_its_holder_dead():
    view = {"me": m("me", 1), "real": REAL}
    for heard in (REQUEST, ANSWER):
        view, _ = merge_all(view, [CLAIMANT, attrs.evolve(REAL, state=D)], "me", heard=heard)
        assert holder(view, "pp-stage-1").id == "real"
    view, _ = merge_all(view, [attrs.evolve(view["real"], state=D)], "me", heard=OWN)
    assert holder(view, "pp-stage-1") == CLAIMANT


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
