"""Spec tier 3: each role's actor, in-process with the stub worker, does exactly the Roles table of
docs/design.md — now for many requests at once: admission and its queue, batched steps, and every way a request ends."""
import collections
import itertools

import attrs
import pytest

from roles import make_actor
from roles.actions import Progress, Refused, Reply, Send
from roles.first import FirstActor
from roles.last import LastActor
from roles.messages import (Activation, ActivationMeta, CancelRequest, EndReason, EndRequest, InferenceRequest,
                            InferenceResponse, NextTokens, RequestStart, SegmentMeta, Token)
from roles.middle import MiddleActor
from worker.batching import Segment
from worker.chain import decode_step, embed_and_forward, forward_range
from worker.contract import GREEDY, Sampling
from worker.errors import WorkerError
from worker.logprobs import token_logprobs
from worker.models import open_worker, stub_model
from worker.partition import Shard
from worker.reference import generate_full

N = 3


def worker(stage, n=N, **kw):
    return open_worker(stub_model(), Shard.of(stage, n), **kw)


def request(rid="r1", max_tokens=4, prompt="Say hello", **kw):
    return InferenceRequest(rid, prompt, max_tokens=max_tokens, reply_to="http://runner", **kw)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def step(actor, w):
    """One planned step through the worker; the actions it produces."""
    planned = actor.plan()
    return [] if planned is None else actor.finish(planned, actor.run(planned, w))


def test_make_actor_picks_the_role_of_the_stage():
    assert [type(make_actor(worker(s, 4))) for s in range(4)] == [FirstActor, MiddleActor, MiddleActor,
                                                                       LastActor]


def test_first_tokenizes_embeds_and_sends_the_prompt_to_stage_1_with_its_start():
    w, ref = worker(0), worker(0)
    actor = make_actor(w)
    assert actor.admit(request(sampling=Sampling(temperature=0.5, seed=3))) == []
    [out] = step(actor, w)
    ids = ref.vocabulary.tokenize("Say hello")
    assert out.dest == "pp-stage-1"
    [seg] = out.message.meta.segments
    assert (seg.request_id, seg.position, seg.seq_len) == ("r1", 0, len(ids))
    assert seg.start == RequestStart(4, Sampling(temperature=0.5, seed=3), tuple(ids), "http://runner", 0.0)
    assert len(seg.stage_ms) == 1 and seg.stage_ms[0] >= 0
    assert out.message.hidden == embed_and_forward(ref, "x", ids, 0)


def test_first_batches_the_fed_back_tokens_of_several_requests_into_one_step():
    w, ref = worker(0, 2), worker(0, 2)
    actor = make_actor(w)
    rids = [("a", "one"), ("b", "two words"), ("c", "three"), ("d", "four")]
    lens = {}
    for rid, prompt in rids:
        actor.admit(request(rid, prompt=prompt))
        [prefill] = step(actor, w)
        lens[rid] = prefill.message.meta.segments[0].seq_len
    actor.admit(NextTokens(tuple(Token(rid, 7 + i, lens[rid], False) for i, (rid, _) in enumerate(rids))))
    [out], [rest] = step(actor, w), step(actor, w)  # two stages: two micro-batches of two (roles/schedule.py)
    assert [(s.request_id, s.position, s.seq_len) for s in out.message.meta.segments] == [
        ("a", lens["a"], 1), ("b", lens["b"], 1)]
    assert [s.request_id for s in rest.message.meta.segments] == ["c", "d"]
    for rid, prompt in rids:
        embed_and_forward(ref, rid, ref.vocabulary.tokenize(prompt), 0)
    assert out.message.hidden == decode_step(ref, "a", 7, lens["a"]) + decode_step(ref, "b", 8, lens["b"])
    assert rest.message.hidden == decode_step(ref, "c", 9, lens["c"]) + decode_step(ref, "d", 10, lens["d"])


def test_a_long_prompt_at_stage_0_rides_with_the_rows_of_a_request_decoding_down_the_chain():
    w = worker(0, 2)
    actor = make_actor(w, prompt_rows=4)
    actor.admit(request("s", prompt="one", max_tokens=50))
    pos = 0
    while (sent := step(actor, w)):  # the prompt in chunks of 4
        pos += sent[0].message.meta.segments[0].seq_len
    actor.admit(NextTokens((Token("s", 7, pos, False),)))
    [first] = step(actor, w)  # s's first decode row goes down the chain
    actor.admit(request("long", prompt=" ".join(["word"] * 40)))
    assert actor.plan() is None  # s decodes down the chain: the prompt waits for its row
    actor.admit(NextTokens((Token("s", 8, pos + 1, False),)))
    [out] = step(actor, w)
    assert sorted((s.request_id, s.seq_len) for s in out.message.meta.segments) == [("long", 3), ("s", 1)]


def test_a_replay_s_rows_do_not_wait_for_a_request_decoding_down_the_chain():
    """After a stage is replaced every request is replayed; one whose replay is through decodes down the chain,
    and the others' replay rows go on at once: their streams stand still until they are through."""
    w = worker(0, 2)
    actor = make_actor(w, prompt_rows=4)
    actor.set_chain(("m1",), standing=True)
    for rid in ("a", "b"):
        actor.admit(request(rid, prompt="one", max_tokens=50))
    sent = collections.Counter()
    while (out := step(actor, w)):
        for seg in out[0].message.meta.segments:
            sent[seg.request_id] += seg.seq_len
    actor.admit(NextTokens((Token("a", 7, sent["a"], False), Token("b", 8, sent["b"], False))))
    while step(actor, w):
        pass  # both decode rows down the chain
    actor.set_chain(("m1-replacement",), standing=True)  # both replayed: prompt and token again
    replayed = collections.Counter()
    while replayed["b"] < sent["b"] + 1:
        [out] = step(actor, w)  # never None: b's replay rows do not wait for a's row
        for seg in out.message.meta.segments:
            replayed[seg.request_id] += seg.seq_len
    assert replayed["a"] == sent["a"] + 1


def test_a_done_token_ends_the_request_down_the_chain_and_frees_its_slot():
    w = worker(0)
    actor = make_actor(w)
    actor.admit(request())
    [prefill] = step(actor, w)
    pos = prefill.message.meta.segments[0].seq_len
    finished = EndRequest("r1", EndReason.FINISHED)
    assert actor.admit(NextTokens((Token("r1", 5, pos, True),))) == [
        Progress("r1", 5, True), Progress("r1", end=finished), Send("pp-stage-1", finished)]
    assert "r1" in w.active
    step(actor, w)  # a step with nothing to compute still frees the slot
    assert w.active == frozenset() and actor.plan() is None
    assert actor.admit(NextTokens((Token("r1", 6, pos + 1, False),))) == []  # a late token is dropped


def test_past_the_free_slots_requests_wait_in_order_and_past_the_queue_get_429():
    clock, w = Clock(), worker(0, max_seqs=2)
    actor = FirstActor(Shard.of(0, N), tokenize=lambda p, chat: w.vocabulary.tokenize(p, chat=chat), max_context=512,
                       max_rows=4, capacity=2, max_queue=2, clock=clock)
    for rid in "abcd":
        actor.admit(request(rid))
    with pytest.raises(Refused) as info:
        actor.admit(request("e"))
    assert info.value.status == 429 and info.value.retry_after_s >= 1 and "retry" in info.value.message
    assert set(actor.live) == {"a", "b"} and list(actor.admission.waiting) == ["c", "d"]
    clock.now += 2.5
    actor.admit(CancelRequest("a"))
    assert set(actor.live) == {"b", "c"} and list(actor.admission.waiting) == ["d"]
    units = actor.queue.waiting
    assert [u.request_id for u in units] == ["a", "b", "c"][1:] and units[-1].start.queued_ms == 2500.0


def test_cancel_ends_a_running_request_everywhere_and_drops_a_waiting_one_quietly():
    w = worker(0, max_seqs=1)
    actor = make_actor(w, max_queue=4)
    actor.admit(request("run"))
    actor.admit(request("wait"))
    step(actor, w)
    assert actor.admit(CancelRequest("wait")) == [Progress("wait", end=EndRequest("wait", EndReason.CANCELLED))]
    cancelled = EndRequest("run", EndReason.CANCELLED)
    assert actor.admit(CancelRequest("run")) == [Progress("run", end=cancelled), Send("pp-stage-1", cancelled)]
    assert actor.admit(CancelRequest("run")) == []  # idempotent
    assert actor.live == {} and not actor.admission.waiting


def test_a_failure_reported_by_a_stage_is_answered_by_stage_0_which_ends_the_request():
    w = worker(0)
    actor = make_actor(w)
    actor.admit(request())
    step(actor, w)
    end = EndRequest("r1", EndReason.FAILED, "stage 2: out of memory", 2)
    progress, send, reply = actor.admit(end)
    assert progress == Progress("r1", end=end) and send == Send("pp-stage-1", EndRequest("r1", EndReason.FAILED))
    assert reply == Reply("http://runner", InferenceResponse("r1", error="stage 2: out of memory", failed_stage=2))


def test_middle_forwards_each_segment_with_its_compute_time_and_passes_ends_on():
    w, ref = worker(1), worker(1)
    actor = make_actor(w)
    h = embed_and_forward(worker(0), "r1", [3, 4, 5], 0)
    seg = SegmentMeta("r1", 0, 3, (1.25,), RequestStart(4, GREEDY, (3, 4, 5)))
    actor.admit(Activation(ActivationMeta((seg,)), h))
    [out] = step(actor, w)
    [got] = out.message.meta.segments
    assert out.dest == "pp-stage-2" and got == SegmentMeta("r1", 0, 3, (1.25, got.stage_ms[1]), seg.start)
    assert out.message.hidden == forward_range(ref, "r1", h, 0, 3)
    end = EndRequest("r1", EndReason.FINISHED)
    assert actor.admit(end) == [Send("pp-stage-2", end)]
    step(actor, w)
    assert w.active == frozenset()


def test_last_samples_feeds_tokens_back_to_stage_0_and_replies_when_done():
    model = stub_model()
    ws = [open_worker(model, Shard.of(s, N)) for s in range(N)]
    ids = ws[0].vocabulary.tokenize("Say hello")
    want = generate_full(model, ids, 2).token_ids
    actor = make_actor(ws[2])
    h = forward_range(ws[1], "r1", embed_and_forward(ws[0], "r1", ids, 0), 0, len(ids))
    seg = SegmentMeta("r1", 0, len(ids), (1.0, 2.0), RequestStart(2, GREEDY, tuple(ids), "http://runner", 40.0))
    actor.admit(Activation(ActivationMeta((seg,)), h))
    [fb] = step(actor, ws[2])
    assert fb == Send("pp-stage-0", NextTokens((Token("r1", want[0], len(ids), False),)))
    pos = len(ids)
    h = forward_range(ws[1], "r1", decode_step(ws[0], "r1", want[0], pos), pos, 1)
    actor.admit(Activation(ActivationMeta((SegmentMeta("r1", pos, 1, (1.0, 2.0)),)), h))
    reply, fb = step(actor, ws[2])
    assert fb == Send("pp-stage-0", NextTokens((Token("r1", want[1], pos + 1, True),)))
    assert reply.reply_to == "http://runner"
    r = reply.response
    assert (r.request_id, r.token_ids, r.prompt_token_ids, r.error, r.queued_s) == ("r1", tuple(want), tuple(ids),
                                                                                    None, 0.04)
    assert r.text == ws[2].vocabulary.detokenize([t for t in want if t not in ws[2].info.stop_ids])
    assert len(r.stage_compute_ms) == N and r.stage_compute_ms[:2] == (2.0, 4.0)


@pytest.mark.parametrize("stage,message", [
    (0, Activation(ActivationMeta((SegmentMeta("r", 1, 1),)), b"")),
    (1, request()),
    (1, NextTokens((Token("r", 1, 2, False),))),
    (1, CancelRequest("r")),
    (2, request()),
    (2, NextTokens((Token("r", 1, 2, False),))),
    (2, InferenceResponse("r")),
])
def test_a_message_outside_the_role_is_refused_with_409(stage, message):
    with pytest.raises(Refused) as info:
        make_actor(worker(stage)).admit(message)
    assert info.value.status == 409 and f"does not accept {type(message).__name__}" in info.value.message


@pytest.mark.parametrize("stage", [1, 2])
def test_an_activation_with_rows_of_an_unknown_request_is_refused_whole(stage):
    actor = make_actor(worker(stage))
    good = SegmentMeta("ok", 0, 1, start=RequestStart(4, GREEDY, (1,)))
    bad = SegmentMeta("nope", 3, 1)
    with pytest.raises(Refused) as info:
        actor.admit(Activation(ActivationMeta((good, bad)), b"\0" * 2 * 16 * 4))
    assert info.value.status == 404 and "unknown request 'nope'" in info.value.message
    assert actor.plan() is None  # nothing of it was taken


def test_unknown_tokens_at_stage_0_are_refused_with_404():
    with pytest.raises(Refused) as info:
        make_actor(worker(0)).admit(NextTokens((Token("nope", 1, 2, False),)))
    assert info.value.status == 404 and "unknown request 'nope'" in info.value.message


def test_a_worker_error_at_a_middle_stage_is_reported_to_stage_0():
    w = worker(1)
    actor = make_actor(w)
    seg = SegmentMeta("r1", 0, 1, start=RequestStart(4, GREEDY, (1,), "http://runner"))
    actor.admit(Activation(ActivationMeta((seg,)), b"\0" * 4 * w.info.hidden_dim))
    w.run = lambda items: [WorkerError("no free slot")]
    [report] = step(actor, w)
    assert report == Send("pp-stage-0", EndRequest("r1", EndReason.FAILED, "stage 1: no free slot", 1, poison=True))


def route(actors, workers, prompts, max_tokens):
    """Deliver every message to its stage's actor and run steps, as the nodes would, with all `prompts`
    admitted at once; returns the replies by request id."""
    inbox = {s: [] for s in range(len(actors))}
    for rid, prompt in prompts.items():
        inbox[0].append(request(rid, max_tokens=max_tokens, prompt=prompt))
    replies = {}
    while any(inbox.values()) or any(a.queue.waiting for a in actors):
        for s in itertools.cycle(range(len(actors))):
            for m in inbox[s]:
                for action in actors[s].admit(m):
                    deliver(action, inbox, replies)
            inbox[s] = []
            for action in step(actors[s], workers[s]):
                deliver(action, inbox, replies)
            if s == len(actors) - 1:
                break
    return replies


def deliver(action, inbox, replies):
    if isinstance(action, Progress):
        return  # for the entry's API; nobody follows these requests there
    if isinstance(action, Reply):
        replies[action.response.request_id] = action.response
    else:
        inbox[int(action.dest.rsplit("-", 1)[1])].append(action.message)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_many_requests_routed_in_process_each_get_their_single_process_tokens(n):
    model = stub_model()
    workers = [open_worker(model, Shard.of(s, n), max_seqs=3) for s in range(n)]
    actors = [make_actor(w) for w in workers]
    prompts = {f"r{i}": "x" * (1 + 7 * i) for i in range(8)}  # more than the slots: some wait their turn
    replies = route(actors, workers, prompts, 12)
    assert set(replies) == set(prompts)
    for rid, prompt in prompts.items():
        ids = workers[0].vocabulary.tokenize(prompt)
        assert list(replies[rid].token_ids) == generate_full(model, ids, 12).token_ids, rid
    assert all(w.active == frozenset() for w in workers)


def route_following(actors, workers, requests):
    """As route, for InferenceRequests given whole; also returns the Progress events stage 0 sent."""
    inbox = {s: [] for s in range(len(actors))}
    inbox[0].extend(requests)
    replies, progress = {}, []
    while any(inbox.values()) or any(a.queue.waiting for a in actors):
        for s in range(len(actors)):
            for m in inbox[s]:
                for action in actors[s].admit(m):
                    (progress.append(action) if isinstance(action, Progress) else deliver(action, inbox, replies))
            inbox[s] = []
            for action in step(actors[s], workers[s]):
                (progress.append(action) if isinstance(action, Progress) else deliver(action, inbox, replies))
    return replies, progress


@pytest.mark.parametrize("n", [2, 3])
def test_prompt_and_token_logprobs_come_back_as_one_process_computes_them(n):
    """The prompt runs in chunks at the last stage; each chunk's rows give the logprobs of the prompt tokens
    after them, and all of them travel with the first token; each token brings its own."""
    model = stub_model()
    workers = [open_worker(model, Shard.of(s, n), max_seqs=3) for s in range(n)]
    actors = [make_actor(w, prompt_rows=2) for w in workers]
    ids = workers[0].vocabulary.tokenize("a longer prompt, in chunks")
    sampling = Sampling(logprobs=2, prompt_logprobs=3)
    other = InferenceRequest("plain", "", max_tokens=3, reply_to="http://runner", prompt_token_ids=tuple(ids))
    asked = attrs.evolve(other, request_id="asked", sampling=sampling)
    replies, progress = route_following(actors, workers, [other, asked])
    full = model.open_slice(range(model.total_blocks), embed=True, head=True)
    logits = full.forward_batch(full.embed(ids), [Segment(0, 0, len(ids))], logit_rows=range(len(ids)))
    mine = [p for p in progress if p.request_id == "asked" and p.token_id is not None]
    assert mine[0].prompt_logprobs == tuple(token_logprobs(logits[:-1], ids[1:], 3))
    assert all(p.prompt_logprobs == () for p in mine[1:])
    want = generate_full(model, ids, 3)
    assert [p.token_id for p in mine] == want.token_ids == list(replies["asked"].token_ids)
    assert [p.logprob for p in mine] == [token_logprobs(lg[None], [t], 2)[0] for lg, t in zip(want.logits, want.token_ids)]
    plain = [p for p in progress if p.request_id == "plain" and p.token_id is not None]
    assert all(p.logprob is None and p.prompt_logprobs == () for p in plain)
