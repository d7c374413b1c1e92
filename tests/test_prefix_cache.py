"""The prefix cache across the pipeline, in-process: a finished request's KV stays on every stage, later
requests start after the blocks they share with it (taking its slot or copying its rows), and the answers
are the ones computed without it — at N = 2, 3 and 5, with 8 requests at once, across evictions, and when
a stage lacks the entry (it reports the request lost and stage 0 replays it in full)."""
import httpx
import numpy as np
import pytest
import trio

from chain import Chain
from cluster import API_KEY, PATIENT_SWIM, api, start_cluster

from worker.contract import FromCache, StepItem
from worker.errors import PrefixMissing
from worker.models import open_worker, stub_model, tinygrad_model
from worker.partition import Shard
from worker.batching import Segment
from worker.weights.tiny import TinySource

SYSTEM = "You are a terse assistant who answers in one line. "  # 51 stub tokens: three whole blocks


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_follow_up_starts_after_its_cached_prefix_and_answers_as_without_the_cache(n):
    chain = Chain(n)
    first = chain.tokens(SYSTEM + "Say hello.")
    [answer] = chain.ask({"turn1": first}).values()
    follow_up = [*first, *answer[:-1], *chain.tokens(" And now say goodbye, kindly.")]
    got = chain.ask({"turn2": follow_up})["turn2"]
    assert got == chain.reference(follow_up)
    assert chain.starts == {"turn1": 0, "turn2": (len(first) + len(answer) - 1) // 16 * 16}
    health = chain.actors[0].health()["prefix_cache"]
    assert (health["queries"], health["hits"]) == (len(first) + len(follow_up), chain.starts["turn2"])
    chain.assert_clean()


@pytest.mark.parametrize("n", [2, 3, 5])
def test_eight_requests_at_once_sharing_prefixes_answer_as_without_the_cache_across_evictions(n):
    chain = Chain(n, max_seqs=3)
    chain.ask({"warm": chain.tokens(SYSTEM + "Hi.")})
    questions = ["Say hello.", "Name a river.", "Why is the sky blue?", "Count to three.", "Hi.",
                 "What is two and two?", "Spell cat.", "Say hello again."]
    prompts = {f"q{i}": chain.tokens((SYSTEM if i % 2 == 0 else "Another preamble entirely, longer. ") + q)
               for i, q in enumerate(questions)}
    got = chain.ask(prompts)  # more requests than slots: they wait, copy, take and evict as slots turn over
    assert got == {rid: chain.reference(ids) for rid, ids in prompts.items()}
    assert any(position > 0 for position in chain.starts.values())
    chain.assert_clean()
    again = chain.ask({f"again-{rid}": ids for rid, ids in prompts.items()})
    assert again == {f"again-{rid}": want for rid, want in got.items()}
    chain.assert_clean()


@pytest.mark.parametrize("n", [2, 3])
def test_requests_at_once_that_share_part_of_an_entry_copy_its_rows_and_leave_it_for_the_next(n):
    chain = Chain(n, max_seqs=4)
    chain.ask({"long": chain.tokens(SYSTEM + "Tell me about the rivers of Europe, at some length.")})
    [entry] = chain.actors[0].cache.index.names()
    prompts = {f"q{i}": chain.tokens(SYSTEM + q) for i, q in enumerate(["Say hello.", "Name a colour."])}
    assert chain.ask(prompts) == {rid: chain.reference(ids) for rid, ids in prompts.items()}
    assert chain.starts["q0"] == chain.starts["q1"] == 48  # SYSTEM's three whole blocks
    assert entry in chain.actors[0].cache.index.names()  # copied, not taken
    chain.assert_clean()


def test_requests_share_cached_prefixes_only_under_the_same_cache_salt():
    chain = Chain(2)
    ids = chain.tokens(SYSTEM + "Say hello.")
    chain.ask({"a": ids}, salt="tenant-1")
    chain.ask({"other": ids}, salt="tenant-2")
    chain.ask({"unsalted": ids})
    chain.ask({"same": ids}, salt="tenant-1")
    assert chain.starts == {"a": 0, "other": 0, "unsalted": 0, "same": 48}


def test_with_the_cache_off_every_request_starts_at_position_0_and_nothing_is_kept():
    chain = Chain(3, prefix_cache=False)
    ids = chain.tokens(SYSTEM + "Say hello.")
    assert chain.ask({"a": ids})["a"] == chain.ask({"b": ids})["b"] == chain.reference(ids)
    assert chain.starts == {"a": 0, "b": 0}
    assert all(w.kept == {} for w in chain.workers)
    assert chain.actors[0].health()["prefix_cache"] == {
        "enabled": False, "block_size": 16, "entries": 0, "blocks": 0, "queries": 0, "hits": 0}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_stage_that_lacks_the_entry_reports_it_and_the_request_is_replayed_in_full(stage):
    """A stage restarted without stage 0 hearing of it (its worker is fresh): the request that starts from
    an entry it no longer holds is replayed from position 0, and its answer is still exact."""
    chain = Chain(3)
    first = chain.tokens(SYSTEM + "Say hello.")
    chain.ask({"a": first})
    chain.workers[stage] = open_worker(chain.model, Shard.of(stage, 3), max_seqs=chain.max_seqs)
    follow_up = [*first, *chain.tokens(" Then say goodbye.")]
    assert chain.ask({"b": follow_up})["b"] == chain.reference(follow_up)
    # from the entry, then again from the first token (stage 0 itself replays it before any row leaves)
    assert chain.lives["b"] == ([0] if stage == 0 else [48, 0])
    assert chain.actors[0].live == {} and all(w.active == frozenset() for w in chain.workers)
    assert "#1" not in chain.actors[0].cache.index.names()  # the entry a stage lacked is forgotten


def test_a_kept_entry_taken_or_copied_continues_as_the_original_request_on_tinygrad():
    """The worker contract on the real backend, both ends of a 2-stage chain: a slot kept as an entry, then
    one request copies its first rows into another slot and a second takes the slot itself; both compute
    the logits the whole prompt gives."""
    model = tinygrad_model(TinySource())
    w0, w1 = (open_worker(model, Shard.of(s, 2), max_seqs=3) for s in (0, 1))
    ids = w0.vocabulary.tokenize("Name three rivers of Europe, briefly, and say why they matter.", chat=False)

    def run(rid, position, start=None):
        [hidden] = w0.run([StepItem(rid, position, tokens=tuple(ids[position:]), from_cache=start)])
        [logits] = w1.run([StepItem(rid, position, hidden=hidden, seq_len=len(ids) - position, from_cache=start)])
        return logits
    whole = run("whole", 0)
    for w in (w0, w1):
        w.release("whole", keep_as="e")
    k = len(ids) // 2
    copied = run("c", k, FromCache("e"))
    taken = run("t", k, FromCache("e", take=True))
    np.testing.assert_array_equal(copied, whole)
    np.testing.assert_array_equal(taken, whole)
    assert all(w.kept == {} and w.active == {"c", "t"} for w in (w0, w1))


@pytest.mark.parametrize("n", [2, 3])
def test_a_request_that_takes_an_entry_another_reads_leaves_that_one_s_answer_as_without_the_cache(n):
    """Issue 54, finding 1, on the real backend's shared pages: every slot busy, a victim shares entry E1's
    first 64 positions, then a request that matches only E1's first block takes E1's slot and writes from
    position 16 on. The victim must read E1's rows, not the newcomer's: its answer is its cache-free one."""
    chain = Chain(n, max_seqs=3, model=tinygrad_model(TinySource()))
    e1 = "The river Danube flows through ten countries, more than any other river in the world, from " \
         "the Black Forest to the Black Sea."
    chain.ask({"e1": chain.tokens(e1)})
    prompts = {"filler": chain.tokens("Something else entirely, to hold a slot for a while."),
               "victim": chain.tokens(e1[:64] + " And which cities does it pass?"),
               "intruder": chain.tokens(e1[:16] + " is a phrase that starts many a story about rivers.")}
    got = chain.ask(prompts, max_tokens=24)
    assert chain.starts["victim"] == 64 and chain.starts["intruder"] == 16, chain.starts
    assert got == {rid: chain.reference(ids, 24) for rid, ids in prompts.items()}
    chain.assert_clean()


def test_a_request_naming_an_entry_the_worker_lacks_is_refused_as_a_missing_prefix():
    w = open_worker(stub_model(), Shard.of(0, 2), max_seqs=2)
    [out] = w.run([StepItem("r", 16, tokens=(3,) * 4, from_cache=FromCache("gone"))])
    assert isinstance(out, PrefixMissing) and "'gone' is not held at stage 0" in str(out)
    w.run([StepItem("a", 0, tokens=(3,) * 20)])
    w.release("a", keep_as="e")
    [short] = w.run([StepItem("r", 32, tokens=(3,) * 4, from_cache=FromCache("e"))])
    assert isinstance(short, PrefixMissing) and "holds 20 positions, not 32" in str(short)


def test_entries_are_dropped_when_stage_0_says_and_make_room_when_only_they_hold_slots():
    w = open_worker(stub_model(), Shard.of(0, 2), max_seqs=2)
    for rid in ("a", "b"):
        w.run([StepItem(rid, 0, tokens=(3,) * 20)])
        w.release(rid, keep_as=f"e-{rid}")
    assert w.kept == {"e-a": 20, "e-b": 20}
    w.run([StepItem("c", 0, tokens=(4,) * 5)])  # no slot free: the least recently used entry gives its own
    assert w.kept == {"e-b": 20}
    w.run([StepItem("d", 0, tokens=(4,) * 5, from_cache=FromCache(drop=("e-b",)))])
    assert w.kept == {} and w.active == {"c", "d"}


async def chat_twice(url: str, system: str, questions: list[str]) -> list[str]:
    """Every question at once, each sharing `system`; then each conversation's second turn at once: the
    greedy answer texts in order."""
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        async def ask(messages, into, i):
            r = await client.post(url + "/v1/chat/completions", json={
                "model": "stub", "messages": messages, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            into[i] = r.json()["choices"][0]["message"]["content"]
        turns = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
        first, second = [None] * len(turns), [None] * len(turns)
        async with trio.open_nursery() as nursery:
            for i, messages in enumerate(turns):
                nursery.start_soon(ask, messages, first, i)
        async with trio.open_nursery() as nursery:
            for i, messages in enumerate(turns):
                follow = [*messages, {"role": "assistant", "content": first[i]}, {"role": "user", "content": "More?"}]
                nursery.start_soon(ask, follow, second, i)
    return first + second


async def test_a_live_cluster_answers_the_same_with_and_without_the_prefix_cache(tmp_path):
    """Three in-process nodes over HTTP, 8 chats at once sharing a system prompt, then their second turns:
    the texts equal a cluster's with --no-prefix-cache, and the cache was used."""
    system = "You are a helpful assistant. Answer every question briefly and plainly, in one sentence."
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    answers, hits = {}, {}
    for cache in (True, False):
        async with trio.open_nursery() as nursery:
            # answers, not liveness: a full suite's slow moments must not declare a stage dead
            _, urls, _ = await start_cluster(nursery, 3, tmp_path / str(cache), max_seqs=4,
                                             prefix_cache=cache, swim_config=PATIENT_SWIM)
            with trio.fail_after(300):
                answers[cache] = await chat_twice(api(urls[0]), system, questions)  # as a user's client asks
            async with httpx.AsyncClient(timeout=30) as client:
                hits[cache] = (await client.get(api(urls[0]) + "/health")).json()["prefix_cache"]["hits"]
            nursery.cancel_scope.cancel()
    assert answers[True] == answers[False] and len(set(answers[True])) > 1  # and the questions were told apart
    assert hits[True] > 0 and hits[False] == 0


def test_off_the_cpu_a_slot_s_rows_are_copied_by_tinygrad_as_the_cpu_copies_them(monkeypatch):
    """The path a GPU takes (a tinygrad slice assign, not a host memcpy), run here on the CPU device."""
    from worker.compute import kv_rows as tinygrad_slice
    model = tinygrad_model(TinySource())
    host, device = (model.open_slice(range(model.total_blocks), embed=True, head=True, max_seqs=3) for _ in range(2))
    ids = model.tokenizer().encode_prompt("Name three rivers of Europe, briefly.")
    for s in (host, device):
        s.forward_batch(s.embed(ids), [Segment(0, 0, len(ids))])
    host.copy_rows(0, 2, len(ids) - 3)
    monkeypatch.setattr(tinygrad_slice, "zero_copy", lambda buffer: False)
    device.copy_rows(0, 2, len(ids) - 3)
    for a, b in zip(host.model.blocks, device.model.blocks):
        np.testing.assert_array_equal(a.cache.numpy(), b.cache.numpy())
    rest = [Segment(2, len(ids) - 3, 3)]
    np.testing.assert_array_equal(device.forward_batch(device.embed(ids[-3:]), rest),
                                  host.forward_batch(host.embed(ids[-3:]), rest))
