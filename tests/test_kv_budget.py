"""Stage 0's KV budget (issue 39): a stage's positions from --kv-cache-memory, entries evicted and the newest
requests preempted so that no stage holds more, preempted requests replayed with the same answers, and
nothing failing for lack of KV while a request could wait."""
import attrs
import numpy as np
import pytest
import trio

from chain import Chain
from cluster import PATIENT_SWIM, client_http, start_cluster
from node.kv_memory import KvPositions, chain_positions, stage_positions
from roles import make_actor
from roles.actions import Refused, Send
from roles.kv_budget import Room, make_room
from roles.messages import (Activation, CancelRequest, EndReason, EndRequest, InferenceRequest, RequestStart,
                            SegmentMeta)
from worker.contract import GREEDY
from worker.models import open_worker, stub_model, tinygrad_model
from worker.partition import Shard
from worker.reference import generate_full
from worker.weights.tiny import TinySource

SYSTEM = "You are a terse assistant who answers in one line. "  # 51 stub tokens: three whole blocks


@pytest.mark.parametrize("need, used, entries, running, grower, want", [
    (5, 10, [], [], "", Room()),  # it fits: nothing goes
    (5, 18, [("e1", 4), ("e2", 4)], [], "", Room(evict=("e1",))),  # least recently used entry first
    (5, 18, [("e1", 2), ("e2", 4)], [], "", Room(evict=("e1", "e2"))),
    (5, 19, [("e1", 2)], [], "", None),  # a new request never preempts: it waits
    (0, 21, [("e1", 2)], [("new", 6), ("old", 9)], "old", Room(evict=("e1",))),
    (0, 24, [("e1", 2)], [("new", 6), ("old", 9)], "old", Room(evict=("e1",), preempt=("new",))),
    (0, 30, [], [("new", 6), ("mid", 5), ("old", 9)], "old", Room(preempt=("new", "mid"))),
    (0, 21, [], [("grower", 11), ("old", 10)], "grower", Room(preempt=("grower",))),  # itself, if newest
    (0, 40, [], [("a", 1)], "b", None),  # nothing frees enough
])
def test_room_is_made_by_evicting_entries_first_then_preempting_the_newest(need, used, entries, running, grower,
                                                                            want):
    assert make_room(need, budget=20, used=used, entries=entries, running=running, grower=grower) == want


def test_without_a_budget_nothing_is_ever_freed():
    assert make_room(10 ** 9, budget=None, used=10 ** 9, running=[("a", 5)], grower="a") == Room()


MIB = 1 << 20


@pytest.mark.parametrize("memory, available, here, want", [
    (64 * MIB, None, 1, KvPositions(8192, 64 * MIB, "given")),  # 8 KiB a position
    (None, 256 * MIB, 2, KvPositions(8192, 64 * MIB, "auto")),  # half the free memory, over 2 stages
    (None, 16 * (1 << 30), 1, KvPositions(65536, 512 * MIB, "slots")),  # every slot's whole context fits
    (1 * MIB, None, 1, KvPositions(2048, 16 * MIB, "context")),  # never less than one context
    (None, None, 1, KvPositions(65536, 512 * MIB, "slots")),  # free memory unknown
])
def test_a_stage_holds_as_many_positions_as_its_kv_memory_allows(memory, available, here, want):
    got = stage_positions(memory, kv_bytes=512 * MIB, slot_positions=65536, max_context=2048, available=available,
                          stages_here=here)
    assert (got.positions, got.memory_bytes, got.how) == (want.positions, want.memory_bytes, want.how)
    assert bool(got.note) == (want.how == "context" or available is None and memory is None)


def test_the_chain_admits_by_the_least_any_stage_holds():
    assert chain_positions([9000, None, 4000, 7000]) == 4000
    assert chain_positions([None, None]) is None


def budget_chain(n: int, budget: int, *, max_seqs: int = 8) -> Chain:
    """A chain whose stage 0 admits by `budget` positions; after every step, no stage holds more."""
    chain = Chain(n, max_seqs=max_seqs)
    chain.actors[0].kv.budget = budget
    chain.peak = 0

    def check(stage):
        held = sum(chain.workers[stage].kv_positions)
        chain.peak = max(chain.peak, held)
        assert held <= budget, (stage, held, budget)
    chain.after_step = check
    return chain


QUESTIONS = ["Say hello.", "Name a river.", "Why is the sky blue?", "Count to three.", "Hi.",
             "What is two and two?", "Spell cat.", "Say hello again."]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_burst_that_outgrows_the_budget_answers_as_alone_and_no_stage_holds_more(n):
    chain = budget_chain(n, budget=160)
    prompts = {f"q{i}": chain.tokens(q * 3) for i, q in enumerate(QUESTIONS)}
    need = sum(len(ids) for ids in prompts.values()) + len(prompts) * 12
    assert need > 2 * 160  # far more than the budget holds at once
    got = chain.ask(prompts, max_tokens=12)
    assert got == {rid: chain.reference(ids, 12) for rid, ids in prompts.items()}
    kv = chain.actors[0].health()["kv"]
    assert kv["preemptions"] > 0 and chain.peak > 100
    assert kv["used_positions"] == chain.actors[0].cache.positions()  # only entries are left
    chain.assert_clean()


def test_entries_are_evicted_for_a_growing_request_and_every_stage_forgets_them():
    chain = budget_chain(3, budget=10 ** 6, max_seqs=4)
    chain.ask({"warm1": chain.tokens(SYSTEM + "Hi."), "warm2": chain.tokens("Another preamble entirely. Hi.")})
    assert chain.actors[0].cache.positions() == 96  # two entries, 60 and 36 positions
    long = chain.tokens("Tell me everything about the rivers of Europe, at length. " * 2)  # shares no block
    chain.actors[0].kv.budget = 96 + len(long) + 10  # it starts beside both entries, and grows past them
    got = chain.ask({"long": long}, max_tokens=40)
    assert got["long"] == chain.reference(long, 40)
    kept = set(chain.actors[0].cache.index.names())
    assert all(set(w.kept) == kept for w in chain.workers)  # the evicted entries are gone everywhere
    assert chain.actors[0].health()["kv"]["preemptions"] == 0


def test_a_request_that_would_copy_an_entry_too_big_to_keep_beside_it_starts_afresh_rather_than_wait():
    chain = budget_chain(2, budget=10 ** 6, max_seqs=4)
    first = chain.tokens(SYSTEM * 3 + "Tell me about rivers.")
    chain.ask({"first": first})  # its KV stays: an entry of len(first) + 5 positions
    second = chain.tokens(SYSTEM * 3 + "Name every colour you know of, please.")  # shares 144 of them
    chain.actors[0].kv.budget = len(second) + 10  # the entry and a copy of its rows cannot both fit
    got = chain.ask({"second": second})
    assert got["second"] == chain.reference(second) and chain.starts["second"] == 0
    assert len(chain.actors[0].cache.index) == 1  # the first's entry went, the second's is kept
    chain.assert_clean()


def test_a_prompt_the_budget_can_never_hold_is_refused_rather_than_left_waiting():
    actor, _ = entry(budget=20)
    with pytest.raises(Refused) as refused:
        actor.admit(request("big", range(1, 21)))
    assert refused.value.status == 400 and "KV budget of 20 positions" in str(refused.value)


def entry(max_seqs=4, budget=None):
    w = open_worker(stub_model(), Shard.of(0, 2), max_seqs=max_seqs)
    actor = make_actor(w, prefix_cache=False)
    actor.set_chain(("m1",), standing=True)
    actor.kv.budget = budget
    return actor, w


def request(rid, ids, max_tokens=8):
    return InferenceRequest(rid, "", max_tokens=max_tokens, reply_to="http://runner", prompt_token_ids=tuple(ids))


def feed(actor, w, rid, generation=0):
    """Compute stage 0's waiting rows and feed back one token for `rid` as the last stage would."""
    from roles.messages import NextTokens, Token
    step = actor.plan()
    actor.finish(step, actor.run(step, w))
    live = actor.live[rid]
    return actor.admit(NextTokens((Token(rid, 7, live.next_position, False, generation),)))


def ends(actions) -> list:
    return [a.message for a in actions if isinstance(a, Send) and isinstance(a.message, EndRequest)]


def test_a_preempted_request_waits_first_in_line_and_restarts_with_its_tokens_as_a_later_life():
    actor, w = entry(budget=20)
    actor.admit(request("old", range(1, 10)))
    actor.admit(request("new", range(1, 11)))  # 9 + 10 = 19 positions of 20
    actor.admit(request("later", range(1, 3)))  # 2 more do not fit: it waits
    assert list(actor.admission.waiting) == ["later"]
    assert ends(feed(actor, w, "new")) == []  # new's first token takes the 20th position
    preempted = ends(feed(actor, w, "old"))  # old's needs a 21st: the newest request goes
    assert preempted == [EndRequest("new", EndReason.PREEMPTED, generation=0)]
    assert list(actor.admission.waiting) == ["new", "later"] and actor.live["new"].generation == 1
    assert actor.health()["kv"] == {"budget_positions": 20, "used_positions": 10, "preemptions": 1}
    assert [u.request_id for u in actor.queue.waiting] == ["old"]  # nothing of new's is computed any more
    actor.end(EndRequest("old", EndReason.FINISHED))  # room again: new restarts first, then later
    restart = next(u for u in actor.queue.waiting if u.request_id == "new")
    assert (restart.position, restart.generation, restart.start.replayed) == (0, 1, (7,))
    assert restart.tokens == (*range(1, 11), 7) and not actor.admission.waiting


def test_a_cancelled_preempted_request_leaves_the_line_and_nothing_of_it_stays():
    actor, w = entry(budget=20)
    actor.admit(request("old", range(1, 10)))
    actor.admit(request("new", range(1, 12)))  # 20 of 20
    feed(actor, w, "old")  # new preempted
    assert actor.live["new"].preempted
    actor.admit(CancelRequest("new"))
    assert "new" not in actor.live and "new" not in actor.admission.waiting


@pytest.mark.parametrize("stage", [1, 2])
def test_a_stage_frees_a_preempted_request_s_slot_and_takes_its_later_life(stage):
    w = open_worker(stub_model(), Shard.of(stage, 3), max_seqs=2)
    actor = make_actor(w)
    start = RequestStart(8, GREEDY, (1, 2, 3), "http://runner")
    hidden = bytes(3 * w.info.hidden_dim * 4)
    actor.admit(Activation.of([(SegmentMeta("r", 0, 3, (1.0,), start), hidden)]))
    actor.finish(step := actor.plan(), actor.run(step, w))
    assert w.active == {"r"}
    actor.admit(EndRequest("r", EndReason.PREEMPTED, generation=0))
    actor.finish(step := actor.plan(), actor.run(step, w))
    assert w.active == frozenset() and not actor.queue.ended("r")
    later = RequestStart(8, GREEDY, (1, 2, 3), "http://runner", replayed=(5,))
    actor.admit(Activation.of([(SegmentMeta("r", 0, 4, (1.0,), later, generation=1), bytes(4 * w.info.hidden_dim * 4))]))
    actor.finish(step := actor.plan(), actor.run(step, w))
    assert w.active == {"r"} and actor.is_live("r", 1)


ENDLESS = attrs.evolve(GREEDY, ignore_eos=True)  # every request its whole 24 tokens: it grows as far as it may


async def test_a_cluster_with_one_context_of_kv_memory_preempts_and_answers_every_request_as_alone(
        nursery, tmp_path):
    """--kv-cache-memory through a real cluster: 1 byte is raised to one context (64 positions), which 8
    requests of 34-48 positions at once outgrow many times over: they wait at the door, and those that started
    together outgrow it as they decode (preempted, then replayed); none fails, each answers as alone."""
    model = tinygrad_model(TinySource())
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, model="tiny", max_seqs=8, ctx=64, kv_cache_memory=1,
                                        swim_config=PATIENT_SWIM)
    rng = np.random.default_rng(39)
    prompts = [tuple(int(t) for t in rng.integers(3, 200, size=10 + 2 * i)) for i in range(8)]

    async def one(i, into):
        into[i] = await orch.submit("", prompt_token_ids=prompts[i], max_tokens=24, sampling=ENDLESS)
    got: dict = {}
    with trio.fail_after(240):
        async with trio.open_nursery() as n:
            for i in range(len(prompts)):
                n.start_soon(one, i, got)
    for i, ids in enumerate(prompts):
        want = generate_full(model, list(ids), 24, ENDLESS).token_ids
        assert got[i].error is None and list(got[i].token_ids) == want, i
    async with client_http() as c:  # every stage's port speaks TLS
        health = [(await c.get(u + "/health")).json() for u in urls]
    assert health[0]["kv"]["budget_positions"] == 64
    assert sum(r.queued_s > 0 for r in got.values()) >= 4  # 8 prompts of 136 positions in all: half must wait
    assert [h["kv_positions"]["total"] for h in health] == [64, 64]  # what each stage may hold
    nursery.cancel_scope.cancel()
