"""ppsmoke's boot progress: each stage's phase from gossip, one line per change."""
import pytest

from node.membership.gossip import Member, Meta, State
from runner.phases import news, stage_phases


def m(mid, stage, ready=False, state=State.ALIVE):
    return Member(mid, f"http://{mid}:1", 1, state, Meta(stage=stage, ready=ready))


@pytest.mark.parametrize("members,phases", [
    ([], {}),
    ([m("a", 0), m("b", 1, ready=True)], {0: "listening", 1: "ready"}),
    ([m("runner", None)], {}),  # the runner holds no stage
    ([m("a", 1, ready=True, state=State.DEAD), m("b", 1)], {1: "listening"}),  # a dead holder: its replacement's
    ([m("a", 1, ready=True), m("b", 1)], {1: "ready"}),  # a held stage stays ready while another loads
    ([m("a", 7)], {}),  # no such stage in this cluster
])
def test_a_stage_s_phase_is_its_live_members_best(members, phases):
    assert stage_phases(members, 3) == phases


def test_only_changes_are_news():
    assert news({0: "listening"}, {0: "listening", 1: "listening"}) == [(1, "listening")]
    assert news({0: "listening", 1: "listening"}, {0: "ready", 1: "listening"}) == [(0, "ready")]
    assert news({0: "ready"}, {0: "ready"}) == []
