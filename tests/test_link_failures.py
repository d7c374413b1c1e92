"""A request that fails while a link delivers it fails alone (issue 33): whatever stage 0 cannot do with one
request of a message (here a cache_salt the prefix cache cannot hash, which the API edge now refuses but a
peer or a bug could still send) ends that request, answered with the stage, and every other request of the
message, of the link and of the stage goes on; no slot stays held."""
import pytest
import trio

import roles.actions
import roles.last
import roles.middle

from cluster import slow_stub, start_cluster, stub_tokens
from roles import make_actor
from roles.actions import Progress, Refused, Reply, Send
from roles.first import FirstActor
from roles.messages import (Activation, EndReason, EndRequest, InferenceRequest, NextTokens, RequestStart, SegmentMeta,
                            Token)
from worker.contract import GREEDY, Sampling
from worker.models import open_worker, stub_model
from worker.partition import Shard

from test_hostile_requests import health, until_idle

N = 3
BAD_SALT = "\ud800"  # a lone surrogate: a str, but not encodable text


def request(rid, **kw):
    # a prompt of more than one prefix-cache block: a finished request's KV is kept as an entry
    return InferenceRequest(rid, "Say hello to everyone in the room " * 4, max_tokens=4, reply_to="http://runner",
                            **kw)


def stage0(max_seqs=2, max_queue=4) -> tuple:
    w = open_worker(stub_model(), Shard.of(0, N), max_seqs=max_seqs)
    return make_actor(w, max_queue=max_queue), w


def prefill(actor, w) -> dict[str, int]:
    """Run stage 0's steps until nothing is planned: each started request's next position."""
    nxt = {}
    while (planned := actor.plan()) is not None:
        for send in actor.finish(planned, actor.run(planned, w)):
            for s in send.message.meta.segments:
                nxt[s.request_id] = s.position + s.seq_len
    return nxt


def test_a_waiting_request_that_cannot_start_fails_alone_and_the_next_one_starts():
    actor, w = stage0(max_seqs=1)
    actor.admit(request("a"))
    actor.admit(request("poison", cache_salt=BAD_SALT))  # no slot: it waits, unhashed
    actor.admit(request("c"))
    pos = prefill(actor, w)["a"]
    actions = actor.admit(NextTokens((Token("a", 5, pos, True),)))
    finished = EndRequest("a", EndReason.FINISHED)
    assert actions[:3] == [Progress("a", 5, True), Progress("a", end=finished),
                           Send("pp-stage-1", EndRequest("a", EndReason.FINISHED, keep_as="#1"))]
    [failed, reply] = actions[3:]
    assert failed.request_id == "poison" and failed.end.reason is EndReason.FAILED
    assert failed.end.error.startswith("stage 0: could not start the request: UnicodeEncodeError")
    assert isinstance(reply, Reply) and reply.response.failed_stage == 0 and reply.response.error == failed.end.error
    assert set(actor.live) == {"c"} and not actor.admission.waiting  # the next in line took the slot


def test_a_request_whose_end_raises_fails_alone_and_the_other_tokens_of_its_message_are_taken():
    actor, w = stage0(max_seqs=2)
    # prompt_logprobs: the request never matches the cache, so its salt is first hashed when its entry is kept
    actor.admit(request("poison", cache_salt=BAD_SALT, sampling=Sampling(prompt_logprobs=0)))
    actor.admit(request("b"))
    pos = prefill(actor, w)
    actions = actor.admit(NextTokens((Token("poison", 5, pos["poison"], True), Token("b", 6, pos["b"], False))))
    ends = [a.end for a in actions if isinstance(a, Progress) and a.end is not None]
    assert [(e.request_id, e.reason, e.failed_stage) for e in ends] == [("poison", EndReason.FAILED, 0)]
    assert "UnicodeEncodeError" in ends[0].error
    assert Send("pp-stage-1", EndRequest("poison", EndReason.FAILED)) in actions  # freed on every stage
    assert Progress("b", 6, False) in actions and set(actor.live) == {"b"}
    assert [u.request_id for u in actor.queue.waiting] == ["b"] and actor.live["b"].generated == [6]


def test_a_request_that_cannot_start_at_admission_is_refused_with_a_500_naming_the_stage():
    actor, _ = stage0()
    with pytest.raises(Refused) as info:
        actor.admit(request("poison", cache_salt=BAD_SALT))
    assert info.value.status == 500 and info.value.message.startswith("stage 0: could not start the request")
    assert not actor.live and not actor.admission.waiting


async def test_a_request_failing_at_stage_0_over_a_link_fails_alone_and_eight_others_finish(
        nursery, tmp_path, monkeypatch):
    slow_stub(monkeypatch, 0.01)
    orch, urls, _ = await start_cluster(nursery, 3, tmp_path, max_seqs=4)
    prompts = [f"prompt {i}" for i in range(8)]
    results: dict[str, object] = {}

    async def ask(rid, prompt, salt=""):
        results[rid] = await orch.submit(prompt, request_id=rid, max_tokens=12, cache_salt=salt)

    with trio.fail_after(90):
        async with trio.open_nursery() as clients:
            for i, prompt in enumerate(prompts):
                clients.start_soon(ask, f"r{i}", prompt)
            while (await health(urls[:1]))[0]["queue"]["waiting"] == 0:  # every slot taken: the next one waits
                await trio.sleep(0.02)
            # it waits, so its salt is first hashed when a slot frees: inside the link carrying a done token
            clients.start_soon(ask, "poison", "Say hello", BAD_SALT)
        poison = results.pop("poison")
        assert poison.failed_stage == 0 and "could not start the request: UnicodeEncodeError" in poison.error
        for i, prompt in enumerate(prompts):
            r = results[f"r{i}"]
            assert r.error is None and list(r.token_ids) == stub_tokens(prompt, 12), i
        await until_idle(urls)
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_segment_a_later_stage_cannot_take_fails_its_request_alone(stage, monkeypatch):
    """Taking one request's rows raises at a middle or the last stage: that request is reported failed to
    stage 0 and ended here; the other request of the same activation is queued as ever."""
    real = roles.middle.Unit

    def unit(request_id, *args, **kw):
        if request_id == "poison":
            raise RuntimeError("injected: this request's rows cannot be queued")
        return real(request_id, *args, **kw)
    monkeypatch.setattr(roles.middle if stage == 1 else roles.last, "Unit", unit)
    w = open_worker(stub_model(), Shard.of(stage, N))
    actor, dim = make_actor(w), w.info.hidden_dim
    start = RequestStart(4, GREEDY, (3, 4, 5), "http://runner")
    segs = [(SegmentMeta(rid, 0, 3, (1.0,) * stage, start), b"\0" * 3 * dim * 4) for rid in ("poison", "good")]
    [send] = actor.admit(Activation.of(segs))
    assert send.dest == "pp-stage-0" and send.message.request_id == "poison"
    assert send.message.reason is EndReason.FAILED and send.message.failed_stage == stage
    assert "RuntimeError: injected" in send.message.error
    assert [u.request_id for u in actor.queue.waiting] == ["good"] and set(actor.expected) == {"good"}
