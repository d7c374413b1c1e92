"""runner/keeper.py with stand-in holders and a gossip view the test edits, in virtual time: who gets
replaced, when, how often it is retried, and that a lost holder is retired."""
import attrs
import pytest
import trio

from node.membership.gossip import Member, Meta, State
from runner.common import RunFailed
from runner.keeper import keep_stages, ready_member


class View:
    """The part of Swim the keeper uses: members(), wait_until(), and confirm_dead() (recorded)."""

    def __init__(self, members):
        self._members = {m.id: m for m in members}
        self._changed = trio.Event()
        self.confirmed: list[str] = []

    def confirm_dead(self, member_id):
        self.confirmed.append(member_id)

    def members(self):
        return dict(self._members)

    def put(self, member):
        self._members[member.id] = member
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate):
        while True:
            changed = self._changed
            if result := predicate(self):
                return result
            await changed.wait()


@attrs.define(eq=False)
class Holder:
    url: str
    gone: trio.Event = attrs.Factory(trio.Event)

    async def ended(self):
        await self.gone.wait()
        return "exited"


def member(mid, stage, url, state=State.ALIVE, ready=True):
    return Member(mid, url, 1, state, Meta(stage=stage, ready=ready))


@pytest.mark.parametrize("members, want", [
    ([member("a", 1, "u")], "a"),
    ([member("a", 1, "u", ready=False)], None),  # still loading
    ([member("a", 2, "u")], None),  # another stage
    ([member("a", 1, "v")], None),  # elsewhere
    ([member("a", 1, "u", State.DEAD)], None),
    ([member("old", 1, "u", State.SUSPECT), member("new", 1, "u")], "old"),  # not yet told apart...
])
def test_the_ready_member_at_an_address_is_found_by_stage_and_state(members, want):
    found = ready_member(View(members), 1, "u")
    assert (found.id if found else None) == want


def test_a_replacement_on_the_same_address_is_told_apart_from_the_one_it_replaces():
    view = View([member("old", 1, "u", State.SUSPECT), member("new", 1, "u")])
    assert ready_member(view, 1, "u", retired={"old"}).id == "new"  # ...until the old one is retired


class Cluster:
    def __init__(self, nursery, fail_first=0):
        self.view = View([member("m0", 0, "u0"), member("m1", 1, "u1")])
        self.holders = {0: Holder("u0"), 1: Holder("u1")}
        self.started, self.retired, self.replaced, self.lines = [], [], [], []
        self.fail_first, self.nursery = fail_first, nursery

    async def replace(self, stage, attempt):
        holder = Holder(f"u{stage}.{attempt}")
        self.started.append((stage, attempt))
        if attempt <= self.fail_first:
            holder.gone.set()  # dies before it is ready
        else:
            self.nursery.start_soon(self.boot, stage, attempt, holder.url)
        return holder

    async def boot(self, stage, attempt, url):
        await trio.sleep(5)  # loading
        self.view.put(member(f"m{stage}.{attempt}", stage, url))

    async def retire(self, holder):
        self.retired.append(holder.url)

    def keep(self, **kw):
        return keep_stages(self.view, self.holders, self.replace, ready_timeout_s=60, progress=self.lines.append,
                           on_replaced=lambda stage, h: self.replaced.append((stage, h.url)), retire=self.retire, **kw)


async def test_a_holder_whose_process_ends_is_replaced_and_retired(nursery, autojump_clock):
    c = Cluster(nursery)
    nursery.start_soon(c.keep)
    await trio.sleep(1)
    c.holders[1].gone.set()
    await trio.sleep(10)
    assert c.started == [(1, 1)] and c.replaced == [(1, "u1.1")] and c.retired == ["u1"]
    assert any("stage 1 replaced in 5.0 s by u1.1; requests in flight resume" in line for line in c.lines)
    assert c.view.confirmed == ["m1"]  # gossip hears it from the runner at once, with no suspicion to wait out


async def test_a_member_gossip_declares_dead_is_replaced_though_its_process_runs(nursery, autojump_clock):
    c = Cluster(nursery)
    nursery.start_soon(c.keep)
    await trio.sleep(1)
    c.view.put(member("m1", 1, "u1", State.DEAD))
    await trio.sleep(10)
    assert c.replaced == [(1, "u1.1")] and not c.holders[1].gone.is_set()
    assert "was declared dead by gossip" in c.lines[0]


async def test_the_replacement_is_followed_in_turn(nursery, autojump_clock):
    c = Cluster(nursery)
    nursery.start_soon(c.keep)
    c.holders[0].gone.set()
    await trio.sleep(10)
    c.view.put(member("m0.1", 0, "u0.1", State.DEAD))  # the replacement dies too
    await trio.sleep(10)
    assert c.replaced == [(0, "u0.1"), (0, "u0.2")]
    assert "its requests in flight were lost with it" in c.lines[0]


async def test_replacements_that_die_before_they_are_ready_are_retried_then_the_run_fails(nursery, autojump_clock):
    c = Cluster(nursery, fail_first=2)
    nursery.start_soon(c.keep)
    c.holders[1].gone.set()
    await trio.sleep(10)
    assert c.started == [(1, 1), (1, 2), (1, 3)] and c.replaced == [(1, "u1.3")]
    assert c.retired == ["u1", "u1.1", "u1.2"]  # the failed ones are retired as well
    c2 = Cluster(nursery, fail_first=3)
    c2.holders[1].gone.set()
    with pytest.raises(RunFailed, match="3 replacements in a row failed"):
        await c2.keep()


async def test_a_replacement_that_never_gets_ready_counts_as_failed(nursery, autojump_clock):
    c = Cluster(nursery)
    c.boot = lambda stage, attempt, url: trio.sleep_forever()
    c.holders[1].gone.set()
    with pytest.raises(RunFailed, match="could not be replaced"):
        await c.keep()
    assert c.retired == ["u1", "u1.1", "u1.2", "u1.3"]
    assert "not ready within 60 s" in c.lines[1]


async def test_a_retire_that_fails_ends_the_run_with_its_reason_and_starts_no_further_replacement(
        nursery, autojump_clock):
    c = Cluster(nursery, fail_first=1)

    async def port_still_taken(holder):  # as runner/ports.py's PortHeld: the next try could not listen either
        c.retired.append(holder.url)
        if holder.url == "u1.1":
            raise RunFailed(f"port of {holder.url} is still taken")
    c.retire = port_still_taken
    c.holders[1].gone.set()
    with trio.fail_after(60), pytest.raises(RunFailed, match="port of u1.1 is still taken"):
        await c.keep()
    assert c.retired == ["u1", "u1.1"] and c.started == [(1, 1)]


async def test_a_replacement_that_is_not_ready_is_retired_before_the_next_one_starts(nursery, autojump_clock):
    c = Cluster(nursery, fail_first=1)
    events = []
    replace, retire = c.replace, c.retire

    async def logged_replace(stage, attempt):
        events.append(("start", attempt))
        return await replace(stage, attempt)

    async def logged_retire(holder):
        events.append(("retire", holder.url))
        await retire(holder)
    c.replace, c.retire = logged_replace, logged_retire
    nursery.start_soon(c.keep)
    c.holders[1].gone.set()
    await trio.sleep(10)
    assert events == [("retire", "u1"), ("start", 1), ("retire", "u1.1"), ("start", 2)]
