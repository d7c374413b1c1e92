"""The step planner: decode rows first, prompts chunked into what is left, a request's rows in order."""
import pytest

from roles.messages import RequestStart
from roles.schedule import StageQueue, Unit, bucket_fill, decode_group, plan_rows, prompts_ride
from worker.contract import GREEDY


def d(rid, pos=10):
    return Unit(rid, pos, 1, decode=True, tokens=(1,))


def p(rid, rows, pos=0):
    return Unit(rid, pos, rows, decode=False, tokens=tuple(range(rows)))


def r(rid, rows, pos=0):
    """A replay's prompt rows: a later life's."""
    return Unit(rid, pos, rows, decode=False, tokens=tuple(range(rows)), generation=1)


@pytest.mark.parametrize("waiting,max_rows,want", [
    ([], 4, []),
    ([d("a"), d("b")], 4, [1, 1]),
    ([p("a", 3)], 4, [3]),
    ([p("a", 10)], 4, [4]),  # a long prompt is chunked
    ([p("a", 10), d("b"), d("c")], 4, [2, 1, 1]),  # decodes first, even when they arrived later
    ([d("a"), d("b"), d("c")], 2, [1, 1, 0]),  # oldest decodes first
    ([p("a", 3), p("b", 3)], 4, [3, 1]),  # oldest prompt first, the next one fills the rest
    ([p("a", 6), p("a", 2, pos=6)], 4, [4, 0]),  # a request's later piece waits for its earlier one
    ([p("a", 2), p("a", 2, pos=2), p("b", 1)], 8, [2, 2, 1]),
    ([d("a"), d("b"), p("c", 5)], 2, [1, 1, 0]),  # no room left: the prompt waits one step
    ([p("a", 3), d("a", pos=3), d("b")], 2, [1, 0, 1]),  # a decode never jumps ahead of its own request's rows
])
def test_a_step_takes_waiting_rows_oldest_first_up_to_its_size_and_in_each_request_s_order(waiting, max_rows, want):
    assert plan_rows(waiting, max_rows) == want


@pytest.mark.parametrize("waiting,max_rows,prompt_rows,want", [
    ([p("a", 10)], 8, 3, [3]),  # the chunk, not the step's room, bounds a prompt
    ([d("x"), d("y"), p("a", 10)], 8, 3, [1, 1, 2]),  # decode rows do not count against it (2: rule 6)
    ([d("x"), d("y"), p("a", 10)], 8, 6, [1, 1, 6]),
    ([p("a", 2), p("b", 5)], 8, 4, [2, 2]),  # it bounds a step's prompt rows together
    ([d("x"), d("y"), p("a", 10)], 3, 4, [1, 1, 1]),  # the step's room still bounds everything
    ([d("x"), p("a", 10)], 8, None, [1, 7]),  # no chunk size: the step's room
    ([r("a", 10)], 8, 3, [8]),  # a replay's rows wait: the chunk size does not bound the step
    ([d("x"), r("a", 10), p("b", 5)], 8, 3, [1, 7, 0]),
    ([r("a", 10)], 8, 0, [0]),  # no prompt rows at all (rule 5) still means none
])
def test_the_chunked_prefill_size_caps_a_step_s_prompt_rows_beside_its_decodes(waiting, max_rows, prompt_rows, want):
    assert plan_rows(waiting, max_rows, prompt_rows) == want


@pytest.mark.parametrize("waiting,decode_rows,want", [
    ([d("a"), d("b"), d("c"), d("d")], 2, [1, 1, 0, 0]),  # oldest first, up to the cap
    ([d("a"), d("b"), p("c", 5)], 1, [1, 0, 5]),  # the room the cap leaves goes to prompts
    ([d("a"), d("b")], None, [1, 1]),  # no cap: the step's room
    ([p("a", 3), d("a", pos=3), d("b"), d("c")], 1, [3, 0, 1, 0]),  # a blocked decode does not use the cap
])
def test_stage_0_s_micro_batch_caps_a_step_s_decode_rows(waiting, decode_rows, want):
    assert plan_rows(waiting, 8, None, decode_rows) == want


@pytest.mark.parametrize("running,stages,want", [(0, 2, 1), (1, 5, 1), (8, 2, 4), (9, 2, 5), (8, 5, 2), (16, 3, 6)])
def test_the_requests_running_are_split_into_one_micro_batch_per_stage(running, stages, want):
    assert decode_group(running, stages) == want


def test_rows_that_come_back_together_leave_stage_0_as_micro_batches():
    queue = StageQueue(max_rows=16)
    for rid in "abcdefgh":
        queue.add(d(rid))
    first, second = queue.next_step(decode_group(8, 2)), queue.next_step(decode_group(8, 2))
    assert [u.request_id for u in first.units] == list("abcd") and [u.request_id for u in second.units] == list("efgh")
    assert queue.next_step(decode_group(8, 2)) is None


@pytest.mark.parametrize("elsewhere,waiting,want", [
    (True, [p("a", 10)], True),  # a stream's row is down the chain: the prompt waits for it
    (True, [p("a", 10), d("b")], False),  # a decode row is here: the prompt rides with it
    (False, [p("a", 10)], False),  # nobody decoding: the prompt runs as fast as it can
    (False, [], False),
    (True, [p("r", 10)], False),  # a replay's rows: its stream stands still until they are through
])
def test_prompt_rows_ride_with_decode_rows_while_a_request_decodes_down_the_chain(elsewhere, waiting, want):
    assert prompts_ride(elsewhere, waiting, frozenset({"r"})) is want


def test_a_step_without_prompts_takes_only_the_decode_rows_and_releases():
    queue = StageQueue(max_rows=16, prompt_rows=4)
    queue.add(p("a", 10))
    assert queue.next_step(prompts=False) is None
    queue.add(d("b"))
    step = queue.next_step(prompts=True)
    assert [(u.request_id, u.rows) for u in step.units] == [("a", 3), ("b", 1)]  # a bucket of 4 (rule 6)


@pytest.mark.parametrize("decodes,room,max_rows,want", [
    (1, 4, 16, 3),  # 1 + 3 fill a bucket of 4; 1 + 4 would run as 8
    (2, 4, 16, 2),
    (4, 4, 16, 4),  # 4 + 4 fill 8 already
    (0, 4, 16, 4),  # no decode rows: the chunk as it is
    (8, 4, 16, 4),  # no bucket between 9 and 12: the chunk as it is, prompts always advance
    (1, 7, 8, 7),
    (2, 1, 3, 1),  # the last bucket need not be a power of two
])
def test_prompt_rows_beside_decode_rows_stop_where_the_step_fills_a_bucket(decodes, room, max_rows, want):
    assert bucket_fill(decodes, room, max_rows) == want


def test_a_decode_waits_at_most_one_step_whatever_the_prompts_waiting():
    queue = StageQueue(max_rows=4)
    queue.add(p("long", 100))
    queue.add(d("gen"))
    first = queue.next_step()
    assert [(u.request_id, u.rows) for u in first.units] == [("long", 3), ("gen", 1)]
    queue.add(d("gen", pos=11))
    second = queue.next_step()
    assert [(u.request_id, u.position, u.rows) for u in second.units] == [("long", 3, 3), ("gen", 11, 1)]


def test_a_split_prompt_keeps_its_start_and_upstream_time_on_the_first_piece():
    start = RequestStart(4, GREEDY, (1, 2, 3, 4, 5))
    unit = Unit("a", 0, 5, decode=False, hidden=bytes(range(20)), stage_ms=(2.0, 3.0), start=start, sample=True)
    head, tail = unit.split(2)
    assert (head.rows, head.hidden, head.start, head.stage_ms, head.sample) == (2, bytes(range(8)), start,
                                                                                 (2.0, 3.0), False)
    assert (tail.position, tail.rows, tail.hidden, tail.start, tail.stage_ms, tail.sample) == (
        2, 3, bytes(range(8, 20)), None, (0.0, 0.0), True)


def test_an_ended_request_loses_its_waiting_rows_and_frees_its_slot_in_the_next_step():
    queue = StageQueue(max_rows=4)
    queue.add(p("a", 2))
    queue.add(p("b", 2))
    queue.end("a")
    assert queue.ended("a") and not queue.ended("b")
    step = queue.next_step()
    assert [u.request_id for u in step.units] == ["b"] and step.release == (("a", ""),)
    queue.end("b", keep_as="kept-b")
    assert queue.next_step().release == (("b", "kept-b"),) and queue.next_step() is None


def test_a_held_request_s_rows_stay_in_place_while_the_others_run():
    """node/follow.py: an asker that reads no further holds its request's rows; they keep their place in line."""
    queue = StageQueue(max_rows=4)
    for unit in (d("slow"), d("b"), p("c", 2)):
        queue.add(unit)
    step = queue.next_step(held={"slow"})
    assert [(u.request_id, u.rows) for u in step.units] == [("b", 1), ("c", 2)]
    assert queue.next_step(held={"slow"}) is None
    queue.add(d("b", 11))
    step = queue.next_step()  # caught up: it runs first, as the oldest
    assert [u.request_id for u in step.units] == ["slow", "b"]
