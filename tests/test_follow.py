"""Stage 0's inboxes (node/follow.py): an asker that reads no further holds its requests' rows once a few events
wait for it, and nothing more than those few (and the ones on their way) is kept; reading lets them run again."""
import trio

from node.follow import FOLLOW_EVENTS, Followers


class Actor:
    def __init__(self):
        self.held: set[str] = set()
        self.wakes = 0

    def wake(self):
        self.wakes += 1


def followers():
    actor = Actor()
    return actor, Followers(lambda: actor.held, actor.wake)


async def test_an_asker_that_reads_no_further_holds_its_request_and_keeps_its_order():
    actor, f = followers()
    inbox = f.follow("a")
    for i in range(FOLLOW_EVENTS):
        f.send("a", i)
    assert not actor.held
    f.send("a", FOLLOW_EVENTS)  # the buffer is full: the request waits, this event with it
    f.send("a", FOLLOW_EVENTS + 1)  # one already on its way when it was held
    assert actor.held == {"a"} and inbox.unread == FOLLOW_EVENTS + 2
    assert f.figures() == {"followed": 1, "behind": 1, "unread_events": FOLLOW_EVENTS + 2}
    got = [await inbox.__anext__() for _ in range(2)]  # room for the stash again
    assert actor.held == set() and actor.wakes == 1
    got.append(await inbox.__anext__())
    f.send("a", FOLLOW_EVENTS + 2)
    assert actor.held == set()
    f.unfollow("a")
    got += [e async for e in inbox]
    assert got == list(range(FOLLOW_EVENTS + 3))


async def test_the_requests_of_one_inbox_each_have_their_share_and_their_own_hold():
    actor, f = followers()
    inbox = f.follow("a")
    f.follow("b", inbox)
    for i in range(2 * FOLLOW_EVENTS):
        f.send("a", ("a", i))
    f.send("b", ("b", 0))  # a's events took b's share too: b waits behind them
    assert actor.held == {"b"}
    f.send("a", ("a", 2 * FOLLOW_EVENTS))
    assert actor.held == {"a", "b"}
    await inbox.__anext__()
    assert actor.held == {"a"}  # the oldest stash first; the next read moves a's
    await inbox.__anext__()
    assert actor.held == set()


async def test_a_request_no_longer_followed_drops_what_waited_and_is_released():
    actor, f = followers()
    inbox = f.follow("a")
    for i in range(FOLLOW_EVENTS + 3):
        f.send("a", i)
    f.unfollow("a")
    assert actor.held == set() and not f.following("a") and f.was_followed("a")
    assert [e async for e in inbox] == list(range(FOLLOW_EVENTS))  # the inbox ends with its last request
    f.send("a", 99)  # a late reply is nobody's
    assert inbox.unread == 0


async def test_a_reader_waiting_on_an_empty_inbox_gets_the_next_event():
    _, f = followers()
    inbox = f.follow("a")
    async with trio.open_nursery() as n:
        got = []

        async def read():
            got.append(await inbox.__anext__())
        n.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        f.send("a", "token")
    assert got == ["token"]
