"""A node captures its smallest step bucket at boot and serves; the other buckets are captured later, one at a
time, while it idles once the chain serves (worker/compute/warm.py, StageNode._idle). Until then steps are cut
into the captured buckets alone, and every answer is the same as with every bucket captured."""
import types

import numpy as np
import pytest
import trio

from cluster import PATIENT_SWIM, client_http, start_cluster
from node import main as node_main, stage_node
from node.membership.gossip import Member, Meta, State
from node.stage_node import StageNode
from worker.batching import Segment
from worker.chain import run_chain
from worker.compute import warm
from worker.models import open_worker, tinygrad_model
from worker.partition import Shard
from worker.weights.tiny import TinySource


def chain(n: int = 2) -> list:
    model = tinygrad_model(TinySource())
    return [open_worker(model, Shard.of(i, n)) for i in range(n)]


def captured(worker) -> list[int]:
    return sorted(worker.compute.model.bucket_cost)


def test_a_lazy_warm_up_captures_only_the_smallest_bucket_and_steps_use_it_alone():
    workers = chain()
    assert [list(w.warm_up(lazy=True, prompt_rows=1)) for w in workers] == [[1], [1]]
    result = run_chain(workers, list(range(3, 40)), 4)  # a prompt of 37 rows: 37 calls of bucket 1
    assert len(result.token_ids) == 4 and [captured(w) for w in workers] == [[1], [1]]


def test_warm_more_captures_the_other_buckets_smallest_first_then_says_none():
    [first, _] = chain()
    first.warm_up(lazy=True, prompt_rows=1)
    buckets = first.compute.model.buckets
    taken = []
    while (more := first.warm_more()) is not None:
        taken.append(more[0])
        assert more[1] > 0
    assert taken == list(buckets[1:]) and captured(first) == list(buckets)


def test_a_lazily_warmed_chain_answers_bit_for_bit_as_a_fully_warmed_one():
    lazy, full = chain(3), chain(3)
    for w in lazy:
        w.warm_up(lazy=True, prompt_rows=1)
    for w in full:
        w.warm_up()
    prompt = list(range(5, 30))
    a, b = run_chain(lazy, prompt, 6), run_chain(full, prompt, 6)
    assert a.token_ids == b.token_ids
    assert all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("rows,captured,missing", [
    (1, {1}, None), (2, {1}, 2), (3, {1, 2}, None), (4, {1, 2}, 4), (4, {1, 4}, None), (3, {1, 4}, 2),
    (16, {1, 2, 4, 8, 16}, None), (16, {1, 2, 4, 8}, 16), (12, {1, 4}, 8), (5, {1, 4, 16}, None), (40, {1, 4}, 16),
])
def test_a_missing_bucket_serves_a_step_where_the_plain_cut_of_its_rows_holds_it(rows, captured, missing):
    assert warm.missing_for(rows, captured, (1, 2, 4, 8, 16)) == missing


@pytest.mark.parametrize("prompt_rows,boot", [(None, (1, 16)), (4, (1, 4)), (1, (1,)), (3, (1, 4)), (64, (1, 16))])
def test_a_node_captures_the_smallest_bucket_and_the_one_a_prompt_chunk_fills_at_boot(prompt_rows, boot):
    assert warm.boot_buckets((1, 2, 4, 8, 16), prompt_rows) == boot


@pytest.mark.parametrize("want,captured,bucket", [
    (4, {1}, 4), (16, {1}, 16), (8, {1, 16}, 8), (0, {1}, 2), (2, {1, 2}, 4), (0, {1, 4}, 2),
])
def test_the_bucket_captured_on_demand_is_the_largest_the_steps_lacked(want, captured, bucket):
    assert warm.demanded(want, captured, (1, 2, 4, 8, 16)) == bucket


COSTS = {1: 0.005, 4: 0.0092}  # a 10-block SmolLM2 slice's calls on this box (bucket 16 took 0.0305)


def test_a_missing_bucket_is_priced_on_the_line_through_the_timed_ones():
    assert warm.estimated({1: 0.005}, 16) is None
    assert warm.estimated(COSTS, 16) == pytest.approx(0.005 + 15 * 0.0042 / 3)
    assert warm.estimated(COSTS, 2) == pytest.approx(0.0064)


@pytest.mark.parametrize("rows,want,seconds", [
    (4, None, None),                                  # bucket 4 is there: nothing is lost
    (16, 16, 4 * 0.0092 - (0.005 + 15 * 0.0014)),     # four calls of 4 against one of 16
    (2, 2, 0.0092 - 0.0064),                          # padded to 4 (cheaper than 1 + 1) against one of 2
])
def test_a_step_loses_what_its_cut_costs_beyond_the_cut_with_the_bucket_it_lacks(rows, want, seconds):
    found = warm.lost(rows, COSTS, (1, 2, 4, 8, 16))
    assert (found is None) if want is None else (found[0] == want and found[1] == pytest.approx(seconds))


def test_a_replay_s_prefill_does_not_pay_for_a_capture_it_would_not_earn_back():
    """1440 rows in steps of 16 on a slice with buckets 1 and 4: each step loses ~11 ms without bucket 16,
    ~1 s in all, less than the ~1.2 s a capture costs: no capture on demand in the middle of it."""
    lost = sum(warm.lost(16, COSTS, (1, 2, 4, 8, 16))[1] for _ in range(1440 // 16))
    assert 0.5 < lost < 1.2


def test_steps_that_keep_wanting_a_missing_bucket_ask_for_its_capture_and_it_resets():
    [first, _] = chain()
    first.warm_up(lazy=True, prompt_rows=1)
    model, hidden = first.compute.model, np.zeros((4, first.compute.model.config.dim), dtype=np.float32)
    for step in range(warm.DEMAND_ROWS // 4):
        assert not first.wants_capture, step
        model.forward_batch(hidden, [Segment(0, 0, 4)])
    assert first.wants_capture
    assert first.warm_more()[0] == 4 and not first.wants_capture


async def test_a_stage_captures_its_other_buckets_once_the_chain_serves_and_it_idles(nursery, tmp_path, monkeypatch):
    monkeypatch.setattr(stage_node, "CAPTURE_IDLE_S", 0.05)
    nodes, real_init = [], StageNode.__init__

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        nodes.append(self)
    monkeypatch.setattr(StageNode, "__init__", init)
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, model="tiny", swim_config=PATIENT_SWIM)
    async with client_http(timeout=30) as client:
        assert (await client.get(urls[1] + "/health")).json()["warming"] is True  # buckets left: /health says so
        with trio.fail_after(120):
            while not all(captured(n.worker) == list(n.worker.compute.model.buckets) for n in nodes):
                await trio.sleep(0.05)
            response = await orch.submit("Say hello", max_tokens=4)
        assert response.error is None and len(response.token_ids) == 4
        with trio.fail_after(30):  # the capture is over once its step returns
            while any([(await client.get(u + "/health")).json()["warming"] for u in urls]):
                await trio.sleep(0.05)
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("others,replaces", [
    ([], False),
    ([("old", 1, State.DEAD)], True),     # the holder it replaces: its requests are replayed through it next
    ([("old", 1, State.LEFT)], True),
    ([("old", 1, State.SUSPECT)], False),  # not gone yet
    ([("other", 2, State.DEAD)], False),   # another stage's
])
def test_a_node_captures_the_replay_bucket_at_boot_only_when_it_replaces_a_gone_holder(others, replaces):
    me = Member("new", "http://n:1", 1, State.ALIVE, Meta(stage=1))
    view = {me.id: me, **{i: Member(i, f"http://{i}:1", 1, s, Meta(stage=st)) for i, st, s in others}}
    swim = types.SimpleNamespace(me=me, members=lambda: view)
    assert node_main.replacing(swim, 1) is replaces
