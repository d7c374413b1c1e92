"""How nodes agree on the split at boot (node/planning.py, issue 37): the decisions are pure functions of the
gossip view; a cluster of real tinygrad nodes plans, loads and shows its split."""
import attrs
import pytest
import trio

from cluster import API_KEY, PATIENT_SWIM, _scoped, _shared_compute, client_http, stage_config, start_cluster
from node.membership.gossip import Member, Meta, State, Sync
from node.transport import wire
from node.planning import (describe, gossiped_costs, gossiped_plan, kept, measured_by, measurer, overlapping,
                           planned, stage_machines)
from runner.phases import split_line, stage_phases
from worker.plan import Calibration, ModelCost

MODEL = ModelCost(blocks=30, block_bytes=3_500_000, embed_bytes=28_000_000, head_bytes=28_000_000)


def cost(block_ms: float | None, head_ms: float | None = 8.0) -> Calibration:
    return Calibration(None if block_ms is None else block_ms / 1000, None if head_ms is None else head_ms / 1000,
                       8, None, MODEL)


def m(mid, stage, *, c=None, plan=(), state=State.ALIVE, inc=1, ready=False, observer=False):
    return Member(mid, f"http://{mid}:1", inc, state, Meta(stage=stage, cost=c, plan=plan, ready=ready,
                                                           observer=observer))


@pytest.mark.parametrize("members, want", [
    ([], None),
    ([m("a", 0, c=cost(1)), m("b", 1, c=cost(1))], [cost(1), cost(1)]),
    ([m("a", 0, c=cost(1))], None),  # stage 1 has not measured yet
    ([m("a", 0, c=cost(1)), m("b", 1)], None),  # its node is up but measuring
    ([m("a", 0, c=cost(1)), m("b", 1, c=cost(3), state=State.DEAD)], None),  # a dead node's figures don't count
    ([m("a", 0, c=cost(1)), m("b", 1, c=cost(3), inc=1), m("c", 1, c=cost(2), inc=5)], [cost(1), cost(2)]),
    ([m("a", 0, c=cost(1)), m("b", 1, c=cost(1)), m("x", 7, c=cost(9))], [cost(1), cost(1)]),  # no stage 7
    ([m("a", 0, c=cost(1)), m("r", None, c=cost(1), observer=True)], None),  # the runner holds no stage
])
def test_stage_0_plans_once_every_stage_s_live_node_has_gossiped_its_figures(members, want):
    assert gossiped_costs(members, 2) == want


@pytest.mark.parametrize("members, want", [
    ([m("me", 1)], None),
    ([m("me", 1), m("a", 0, plan=(18, 12))], (18, 12)),
    ([m("me", 1, plan=(1, 29)), m("a", 0)], None),  # its own gossiped split is no one else's decision
    ([m("me", 1), m("a", 0, plan=(18, 12), state=State.DEAD)], None),  # a dead node's is not the cluster's
    ([m("me", 1), m("a", 0, plan=(10, 10, 10))], None),  # a split of another stage count
    ([m("me", 0), m("b", 1, plan=(18, 12), state=State.SUSPECT)], (18, 12)),  # suspected, still the cluster's
    # issue 54: a split comes from stage 0; a member that holds no stage is never asked
    ([m("me", 1), m("0000", None, plan=(1, 29)), m("a", 0, plan=(18, 12))], (18, 12)),
    ([m("me", 1), m("0000", None, plan=(1, 29))], None),
    ([m("me", 1), m("a", 0), m("0000", None, plan=(1, 29))], None),  # stage 0 has not said yet: wait for it
])
def test_a_node_takes_the_split_stage_0_gossips(members, want):
    assert gossiped_plan(members, "me", 2) == want


@pytest.mark.parametrize("members, want", [
    ([m("me", 0), m("b", 1, plan=(10, 10, 10)), m("c", 2, plan=(10, 10, 10))], (10, 10, 10)),
    ([m("me", 0), m("b", 1, plan=(10, 10, 10)), m("c", 2, plan=(9, 11, 10))], None),  # they disagree: no split
    ([m("me", 0), m("b", 1, plan=(10, 10, 10)), m("x", None, plan=(1, 1, 28))], (10, 10, 10)),
], ids=["its live stages agree", "they disagree", "a stage-less member's split is not asked"])
def test_a_replacement_of_stage_0_takes_the_split_every_live_stage_loaded(members, want):
    assert gossiped_plan(members, "me", 3) == want


@pytest.mark.parametrize("members, stage, why", [
    ([m("a", 0, plan=(10, 10, 10)), m("c", 2, plan=(10, 10, 10))], 1, None),
    ([m("a", 0, plan=(10, 10, 10)), m("c", 2, plan=(5, 5, 20))], 1, "its live neighbour, stage 2, did not leave it"),
    ([m("a", 0, plan=(10, 10, 10)), m("c", 2)], 1, None),  # a neighbour that has not loaded yet says nothing
    ([m("a", 0, plan=(10, 10, 10)), m("d", 3, plan=(1, 1, 28))], 1, None),  # only neighbours count
], ids=["neighbours agree", "a neighbour loaded another split", "a neighbour still loading", "not a neighbour"])
def test_a_replacement_refuses_a_range_that_overlaps_what_a_live_neighbour_loaded(members, stage, why):
    got = overlapping((10, 10, 10), [m("me", stage), *members], "me", stage)
    assert (got is None) if why is None else why in got


def test_the_plan_weighs_the_head_and_says_why():
    # 18/12 and 17/13 tie on the slowest stage (54 ms) and on the sum: the one nearer the spec's split wins
    split = planned([cost(3.0, 15.0), cost(3.0, 15.0)])
    assert split.counts == (17, 13) and split.how == "auto"
    assert "stage 0: 17 blocks at 3.00 ms/block = 51.0 ms" in split.reason
    assert "stage 1: 13 blocks at 3.00 ms/block + head 15.00 ms = 54.0 ms" in split.reason


def test_unmeasured_nodes_get_the_spec_s_split_less_the_head_s_bytes():
    assert planned([cost(None, None)] * 2).counts == (19, 11)  # the head weighs 8 blocks by bytes
    assert describe([cost(None, None)] * 2, (19, 11)) == "stage 0: 19 blocks at unmeasured; stage 1: 11 blocks at unmeasured"


def test_a_replacement_keeps_the_running_split_and_says_why():
    split = kept((18, 12), 1)
    assert split.counts == (18, 12) and split.how == "kept"
    assert "a new plan would reload the 1 stages that live and drop the KV of every request they hold" in split.reason


@pytest.mark.parametrize("members, phases", [
    ([m("a", 0), m("b", 1, c=cost(1))], {0: "listening", 1: "measured"}),
    ([m("a", 0, c=cost(1), ready=True), m("b", 1, c=cost(1))], {0: "ready", 1: "measured"}),
    ([m("a", 1, c=cost(1)), m("b", 1)], {1: "measured"}),  # a stage's phase is its most advanced live node's
])
def test_the_runner_shows_a_stage_that_measured_itself(members, phases):
    assert stage_phases(members, 2) == phases


def test_the_runner_says_how_the_converged_cluster_split_the_blocks():
    members = [m("a", 0, c=cost(3.0), plan=(18, 12), ready=True), m("b", 1, c=cost(3.1), plan=(18, 12), ready=True)]
    assert split_line(members, 2) == "blocks per stage: 18 at 3.00 ms / 12 at 3.10 ms"
    assert split_line([m("a", 0, plan=(15, 15), ready=True)], 2) == "blocks per stage: 15 / 15"
    assert split_line([m("a", 0, ready=True)], 2) is None


async def test_a_cluster_of_real_nodes_plans_its_split_and_the_pipeline_view_shows_it(nursery, tmp_path):
    # the tiny model: 8 blocks; every node measures itself, stage 0 plans, each loads its range
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, model="tiny", swim_config=PATIENT_SWIM,
                                     layer_partition="auto")
    async with client_http(timeout=30) as client:
        view = (await client.get(urls[0] + "/v1/pipeline", headers={"Authorization": f"Bearer {API_KEY}"})).json()
    split = view["split"]
    assert split["how"] == "auto" and sum(split["counts"]) == 8 and min(split["counts"]) >= 1
    assert "planned for throughput from each stage's measured step" in split["reason"]
    stages = view["stages"]
    assert [s["blocks"] for s in stages] == [[0, split["counts"][0]], [split["counts"][0], 8]]
    assert all(s["block_ms"] > 0 and s["memory_bytes"] > 0 for s in stages)
    assert stages[0]["head_ms"] is None and stages[1]["head_ms"] >= 0
    nursery.cancel_scope.cancel()


async def test_a_replacement_keeps_the_running_split_without_measuring_itself(nursery, tmp_path):
    # the stub: its nodes gossip figures with no times (it computes nothing), so one that measured is told apart
    orch, urls, scopes = await start_cluster(nursery, 2, tmp_path, swim_config=PATIENT_SWIM, layer_partition="auto")
    plan = next(m.meta.plan for m in orch.swim.alive() if m.meta.stage == 0)
    new = await replace_stage_1(nursery, tmp_path, orch, urls, scopes)
    assert new.meta.plan == plan and new.meta.cost is None  # stage 0's split, and no figures: it measured nothing
    nursery.cancel_scope.cancel()


async def test_a_replacement_booted_cold_takes_stage_0_s_split_not_a_forged_member_s(nursery, tmp_path):
    """Issue 54, finding 4: a cluster-token holder gossips a stage-less member, its id sorted first, with a split
    of its own (its address answers pings: here the runner's). The replacement of stage 1 loads stage 0's split."""
    orch, urls, scopes = await start_cluster(nursery, 2, tmp_path, swim_config=PATIENT_SWIM, layer_partition="auto")
    plan = next(m.meta.plan for m in orch.swim.alive() if m.meta.stage == 0)
    forged = (1, sum(plan) - 1)
    assert forged != plan
    orch.swim.on_sync(Sync(members=(Member("0000", orch.url, 2 ** 40, State.ALIVE, Meta(plan=forged)),)))
    new = await replace_stage_1(nursery, tmp_path, orch, urls, scopes)
    assert new.meta.plan == plan
    nursery.cancel_scope.cancel()


async def replace_stage_1(nursery, tmp_path, orch, urls, scopes) -> Member:
    """Stop stage 1, confirm it dead as the runner does once it sees the process end, and boot a replacement
    cold (no split of its own): its record once it is ready."""
    scopes[1].cancel()
    orch.swim.confirm_dead("stage1")
    config = attrs.evolve(stage_config(1, 2, model="stub", seed=orch.url, peer=urls[0], tmp=tmp_path,
                                       layer_partition="auto"), node_id="stage1-again")
    await nursery.start(_scoped, trio.CancelScope(), config, await nursery.start(_shared_compute), PATIENT_SWIM)
    with trio.fail_after(120):
        return await orch.swim.wait_until(lambda s: next((m for m in s.alive() if m.id == "stage1-again"
                                                          and m.meta.ready), None))


def on(mid, stage, machine, *, c=None, state=State.ALIVE):
    return Member(mid, f"http://{mid}:1", 1, state, Meta(stage=stage, machine=machine, cost=c))


@pytest.mark.parametrize("members, want", [
    ([on("a", 0, "m1")], None),  # stage 1 has not joined yet
    ([on("a", 0, "m1"), on("b", 1, None)], ["m1", None]),
    ([on("a", 0, "m1"), on("b", 1, "m2", state=State.DEAD)], None),  # a dead holder's machine is no stage's
    ([on("a", 0, "m1"), on("b", 1, "m2"), on("x", 5, "m3")], ["m1", "m2"]),
])
def test_a_node_knows_every_stage_s_machine_once_every_stage_has_a_live_holder(members, want):
    assert stage_machines(members, 2) == want


@pytest.mark.parametrize("machines, stage, want", [
    (["m1", "m1", "m1"], 1, None),  # one machine: its stages are one speed, and none is timed
    (["m1", "m2", "m3"], 1, 1),  # each times itself
    (["m1", "m2", "m1", "m2"], 2, 0),  # the lowest stage on a machine times it for the others
    (["m1", "m2", "m1", "m2"], 3, 1),
    (["m1", "m2", "m1", "m2"], 1, 1),
    ([None, None], 1, 1),  # unknown machines: each times itself, as before machines were gossiped
    (["m1", None, "m1"], 2, 0),
])
def test_the_lowest_stage_on_a_machine_times_it_and_no_stage_is_timed_where_all_share_one(machines, stage, want):
    assert measurer(machines, stage) == want


def test_a_stage_takes_the_figures_its_machine_s_timer_gossips():
    members = [on("a", 0, "m1", c=cost(3.0)), on("b", 1, "m2"), on("c", 2, "m1")]
    assert measured_by(members, 0, 3) == cost(3.0)
    assert measured_by(members, 1, 3) is None  # still timing itself


def test_one_machine_s_stages_get_the_even_split_less_the_head_and_say_why():
    split = planned([cost(None, None)] * 2, one_machine=True)
    assert split.counts == (19, 11)  # the head weighs 8 blocks by bytes
    assert split.reason.startswith("every stage shares one machine's cores, so they count as one speed")


@pytest.mark.parametrize("meta, message", [
    ({"stage": 1, "machine": "my box"}, "Meta.machine='my box'"),
    ({"stage": 1, "machine": "m" * 65}, "expected 1-64 letters"),
    ({"stage": 1, "plan": [18, 0]}, "Meta.plan=(18, 0)"),
    ({"stage": 1, "cost": {"block_s": -1.0, "head_s": 0.0, "rows": 8, "memory_bytes": None,
                           "model": {"blocks": 30, "block_bytes": 1}}}, "block_s=-1.0: expected finite seconds"),
])
def test_a_member_record_with_a_bad_machine_split_or_figure_is_refused_at_the_edge(meta, message):
    raw = {"id": "b", "addr": "http://b:1", "incarnation": 1, "state": "alive", "meta": meta}
    with pytest.raises(Exception) as caught:
        wire.converter.structure(raw, Member)
    assert message in repr(caught.value) + "".join(repr(e) for e in getattr(caught.value, "exceptions", ()))


def test_a_member_record_carries_its_machine_over_the_wire():
    member = on("b", 1, "rack2.box-7", c=cost(3.0))
    assert wire.converter.structure(wire.converter.unstructure(member), Member) == member
