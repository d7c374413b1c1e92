"""The planner (worker/plan.py, issue 37): each stage's contiguous blocks from what the nodes measured."""
import re

import pytest

from worker.partition import layer_range
from worker.plan import ModelCost, NodeCost, Objective, PlanError, plan

SMOL = ModelCost(blocks=30, block_bytes=3_500_000, embed_bytes=28_000_000, head_bytes=28_000_000)
PLAIN = ModelCost(blocks=30, block_bytes=1)  # no embedding or head to weigh
EQUAL = NodeCost(block_s=0.010, head_s=0.0)


def counts(ranges) -> list[int]:
    return [len(r) for r in ranges]


@pytest.mark.parametrize("nodes, model, objective, want", [
    # equal nodes and nothing else to weigh: the spec's split, whichever objective
    ([EQUAL] * 2, PLAIN, Objective.THROUGHPUT, [15, 15]),
    ([EQUAL] * 4, PLAIN, Objective.THROUGHPUT, [8, 8, 7, 7]),
    ([EQUAL] * 4, PLAIN, Objective.LATENCY, [8, 8, 7, 7]),
    ([EQUAL] * 8, PLAIN, Objective.THROUGHPUT, [4, 4, 4, 4, 4, 4, 3, 3]),
    # one slow node (3x a block): it gets about a third of the fast one's share
    ([NodeCost(0.010, 0.0), NodeCost(0.030, 0.0)], PLAIN, Objective.THROUGHPUT, [23, 7]),
    ([EQUAL, NodeCost(0.030, 0.0), EQUAL], PLAIN, Objective.THROUGHPUT, [13, 4, 13]),
    ([NodeCost(0.030, 0.0), EQUAL, NodeCost(0.030, 0.0)], PLAIN, Objective.THROUGHPUT, [6, 18, 6]),
    # for one stream alone every block goes where it is cheapest, one each elsewhere
    ([NodeCost(0.010, 0.0), NodeCost(0.030, 0.0)], PLAIN, Objective.LATENCY, [29, 1]),
    # a head heavier than a block, measured: the last stage takes fewer blocks
    ([NodeCost(0.010, 0.080)] * 2, SMOL, Objective.THROUGHPUT, [19, 11]),
    ([NodeCost(0.010, 0.080)] * 5, SMOL, Objective.THROUGHPUT, [7, 7, 7, 8, 1]),
    # missing figures: equal nodes, the head weighed by its bytes (8 blocks' worth here)
    ([NodeCost(), EQUAL], SMOL, Objective.THROUGHPUT, [19, 11]),
    ([NodeCost()] * 3, PLAIN, Objective.THROUGHPUT, [10, 10, 10]),
])
def test_the_plan_balances_what_the_nodes_measured(nodes, model, objective, want):
    ranges = plan(nodes, model, objective)
    assert counts(ranges) == want
    assert ranges[0].start == 0 and ranges[-1].stop == model.blocks
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))  # contiguous


@pytest.mark.parametrize("n", [2, 3, 5, 7, 8])
def test_equal_nodes_without_a_head_get_exactly_the_spec_s_split(n):
    assert plan([EQUAL] * n, PLAIN) == tuple(layer_range(30, i, n) for i in range(n))


def test_no_stage_gets_more_than_its_memory_holds():
    # node 0 holds its embedding and 5 blocks at most; the other takes the rest, though it is slower
    tight = NodeCost(0.010, 0.0, memory_bytes=SMOL.embed_bytes + 5 * SMOL.block_bytes)
    roomy = NodeCost(0.020, 0.0)
    assert counts(plan([tight, roomy], SMOL)) == [5, 25]


@pytest.mark.parametrize("nodes, model, says", [
    ([EQUAL] * 31, PLAIN, "30 blocks cannot be split over 31 stages"),
    ([NodeCost(0.01, 0.0, memory_bytes=10)] * 2, PLAIN, "do not fit the 2 nodes' memory"),
    ([NodeCost(0.01, 0.0, memory_bytes=SMOL.embed_bytes)] * 2, SMOL, "at most [0, 0] blocks each"),
])
def test_a_plan_that_cannot_be_made_is_refused_naming_why(nodes, model, says):
    with pytest.raises(PlanError, match=re.escape(says)):
        plan(nodes, model)


def test_a_tie_on_the_slowest_stage_goes_to_the_smaller_sum():
    # the last node is very slow and holds one block: it sets the pace whatever the others hold, and of the
    # splits that tie on it, the one that gives the fast node the most has the smallest sum
    stuck = NodeCost(0.500, 0.0, memory_bytes=1)
    ranges = plan([NodeCost(0.010, 0.0), NodeCost(0.020, 0.0), stuck], PLAIN)
    assert counts(ranges) == [28, 1, 1]
    assert counts(plan([NodeCost(0.010, 0.0), NodeCost(0.020, 0.0), stuck], PLAIN, Objective.LATENCY)) == [28, 1, 1]


@pytest.mark.parametrize("nodes, want", [
    # two alike machines measured 30% apart (a shared VM's vCPUs): one speed, the head still weighed
    ([NodeCost(0.0030, 0.0), NodeCost(0.0039, 0.0195)], [17, 13]),
    ([NodeCost(0.0039, 0.0), NodeCost(0.0030, 0.0150)], [17, 13]),
    # 1.5x apart is a slower machine: it gets fewer blocks
    ([NodeCost(0.0030, 0.0), NodeCost(0.0045, 0.0225)], [21, 9]),
])
def test_block_times_within_the_noise_band_count_as_one_speed_each_node_keeping_its_head_ratio(nodes, want):
    assert counts(plan(nodes, SMOL)) == want
