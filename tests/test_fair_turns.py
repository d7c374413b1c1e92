"""Turns at the request-preparation threads, shared fairly among client keys (node/api/fair_turns.py; round 3's
finding 7): the decision as a table, and the limiter's order under trio."""
import pytest
import trio

from node.api.fair_turns import FairLimiter, Turns


@pytest.mark.parametrize("arrivals, served", [
    ([("a", 1), ("a", 2), ("a", 3), ("b", 4)], [1, 4, 2, 3]),  # b's one request is next after a's first
    ([("a", 1), ("b", 2), ("a", 3), ("b", 4), ("c", 5)], [1, 2, 5, 3, 4]),
    ([("a", 1), ("a", 2)], [1, 2]),  # one key: first come, first served
], ids=["a burst and a bystander", "three keys", "one key"])
def test_keys_are_served_round_robin_each_in_its_own_order(arrivals, served):
    turns = Turns()
    for key, waiter in arrivals:
        turns.add(key, waiter)
    assert [turns.next() for _ in arrivals] == served and not turns


def test_a_waiter_taken_out_of_line_is_not_served():
    turns = Turns()
    turns.add("a", 1), turns.add("a", 2), turns.add("b", 3)
    assert turns.remove("a", 1) and not turns.remove("a", 1) and not turns.remove("z", 9)
    assert [turns.next(), turns.next()] == [2, 3] and not turns


async def test_a_bystander_s_request_runs_before_a_burst_of_another_key_s(autojump_clock):
    limiter, started = FairLimiter(2), []

    async def work(key: str, name: str, seconds: float):
        async with limiter.hold(key):
            started.append(name)
            await trio.sleep(seconds)
    async with trio.open_nursery() as nursery:
        for i in range(16):
            nursery.start_soon(work, "burst", f"b{i}", 0.3)
            await trio.sleep(0)
        nursery.start_soon(work, "bystander", "chat", 0.01)
    # after the two the threads already held and at most one more of the burst's (its turn may come first),
    # not after all sixteen
    assert started.index("chat") <= 3, started
    assert limiter.free == 2


async def test_a_waiter_cancelled_in_line_gives_its_turn_away_and_leaks_no_slot(autojump_clock):
    limiter, done = FairLimiter(1), []

    async def work(name: str):
        async with limiter.hold(name):
            await trio.sleep(1)
            done.append(name)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(work, "first")
        await trio.sleep(0)
        with trio.move_on_after(0.5):
            await work("cancelled")
        nursery.start_soon(work, "last")
    assert done == ["first", "last"] and limiter.free == 1
