"""Spec tier 3: each role's actor, in-process with the stub worker, does exactly the §3.3 table."""
import pytest

from node.wire import Activation, ActivationMeta, InferenceRequest, InferenceResponse, NextToken, RequestStart
from roles import make_actor
from roles.actions import Refused, Reply, Send
from roles.first import FirstActor
from roles.last import LastActor
from roles.middle import MiddleActor
from worker.models import open_worker, stub_model
from worker.reference import generate_full
from worker.sampling import GREEDY, Sampling

N = 3


def worker(stage, n=N):
    return open_worker(stub_model(), stage, n)


def request(rid="r1", max_tokens=4, **kw):
    return InferenceRequest(rid, "Say hello", max_tokens=max_tokens, reply_to="http://runner", **kw)


def test_make_actor_picks_the_role_of_the_stage():
    assert [type(make_actor(s, 4)) for s in range(4)] == [FirstActor, MiddleActor, MiddleActor, LastActor]


def test_first_tokenizes_embeds_and_sends_a_prefill_activation_to_stage_1():
    actor, w, ref = FirstActor(0, N), worker(0), worker(0)
    req = request(sampling=Sampling(temperature=0.5, seed=3))
    actor.admit(req)
    [out] = actor.process(req, w)
    ids = ref.tokenize("Say hello")
    assert out.dest == "pp-stage-1"
    m = out.message.meta
    assert (m.request_id, m.position, m.seq_len, m.is_prefill, m.reply_to) == ("r1", 0, len(ids), True, "http://runner")
    assert m.start == RequestStart(4, Sampling(temperature=0.5, seed=3), tuple(ids))
    assert len(m.stage_ms) == 1 and m.stage_ms[0] >= 0
    assert out.message.hidden == ref.embed_and_forward("x", ids, 0)


def test_first_runs_a_decode_step_for_each_fed_back_token_and_stops_on_done():
    actor, w, ref = FirstActor(0, N), worker(0), worker(0)
    req = request()
    actor.admit(req)
    [prefill] = actor.process(req, w)
    pos = prefill.message.meta.seq_len
    ref.embed_and_forward("x", list(prefill.message.meta.start.prompt_token_ids), 0)
    tok = NextToken("r1", 7, pos, False, "http://runner")
    actor.admit(tok)
    [out] = actor.process(tok, w)
    assert out.dest == "pp-stage-1"
    assert (out.message.meta.position, out.message.meta.seq_len, out.message.meta.is_prefill) == (pos, 1, False)
    assert out.message.hidden == ref.decode_step("x", 7, pos)
    assert actor.process(NextToken("r1", 9, pos + 1, True), w) == []  # done: drop, and forget the request
    [err] = actor.process(NextToken("r1", 9, pos + 1, False, "http://runner"), w)
    assert isinstance(err, Reply) and "unknown request" in err.response.error and err.response.failed_stage == 0


def test_middle_forwards_an_activation_preserving_its_fields():
    actor, w, ref = MiddleActor(1, N), worker(1), worker(1)
    hidden = worker(0).embed_and_forward("r1", [3, 4, 5], 0)
    meta = ActivationMeta("r1", 0, 3, True, "http://runner", (1.25,), RequestStart(4, GREEDY, (3, 4, 5)))
    act = Activation(meta, hidden)
    actor.admit(act)
    [out] = actor.process(act, w)
    assert out.dest == "pp-stage-2"
    assert out.message.meta == ActivationMeta("r1", 0, 3, True, "http://runner", (1.25, out.message.meta.stage_ms[1]),
                                              meta.start)
    assert out.message.hidden == ref.forward_range("r1", hidden, 0, 3)


def test_last_samples_feeds_the_token_back_to_stage_0_and_replies_when_done():
    model = stub_model()
    ws = [open_worker(model, s, N) for s in range(N)]
    ids = ws[0].tokenize("Say hello")
    want = generate_full(model, ids, 2).token_ids
    actor = LastActor(2, N)
    h = ws[1].forward_range("r1", ws[0].embed_and_forward("r1", ids, 0), 0, len(ids))
    act = Activation(ActivationMeta("r1", 0, len(ids), True, "http://runner", (1.0, 2.0),
                                    RequestStart(2, GREEDY, tuple(ids))), h)
    actor.admit(act)
    [fb] = actor.process(act, ws[2])
    assert fb == Send("pp-stage-0", NextToken("r1", want[0], len(ids), False, "http://runner"))
    pos = len(ids)
    h = ws[1].forward_range("r1", ws[0].decode_step("r1", want[0], pos), pos, 1)
    act = Activation(ActivationMeta("r1", pos, 1, False, "http://runner", (1.0, 2.0)), h)
    actor.admit(act)
    reply, fb = actor.process(act, ws[2])
    assert fb == Send("pp-stage-0", NextToken("r1", want[1], pos + 1, True, "http://runner"))
    assert reply.reply_to == "http://runner"
    r = reply.response
    assert (r.request_id, r.token_ids, r.prompt_token_ids, r.error) == ("r1", tuple(want), tuple(ids), None)
    assert r.text == ws[2].detokenize([t for t in want if t not in ws[2].info.stop_ids])
    assert len(r.stage_compute_ms) == N and r.stage_compute_ms[:2] == (2.0, 4.0)


@pytest.mark.parametrize("actor,message", [
    (FirstActor(0, N), Activation(ActivationMeta("r", 1, 1, False, None), b"")),
    (MiddleActor(1, N), request()),
    (MiddleActor(1, N), NextToken("r", 1, 2, False)),
    (LastActor(2, N), request()),
    (LastActor(2, N), NextToken("r", 1, 2, False)),
    (LastActor(2, N), InferenceResponse("r")),
])
def test_a_message_outside_the_role_is_refused_with_409(actor, message):
    with pytest.raises(Refused) as info:
        actor.admit(message)
    assert info.value.status == 409 and f"does not accept {type(message).__name__}" in info.value.message


@pytest.mark.parametrize("actor,message", [
    (FirstActor(0, N), NextToken("nope", 1, 2, False)),
    (MiddleActor(1, N), Activation(ActivationMeta("nope", 3, 1, False, None), b"")),
    (LastActor(2, N), Activation(ActivationMeta("nope", 3, 1, False, None), b"")),
])
def test_a_step_of_an_unknown_request_is_refused_with_404(actor, message):
    with pytest.raises(Refused) as info:
        actor.admit(message)
    assert info.value.status == 404 and "unknown request 'nope'" in info.value.message


def test_a_worker_error_becomes_an_error_reply_naming_the_stage():
    actor, w = MiddleActor(1, N), worker(1)
    act = Activation(ActivationMeta("r1", 5, 1, False, "http://runner"), b"\0" * 4 * w.info.hidden_dim)
    [reply] = actor.process(act, w)
    assert reply.reply_to == "http://runner" and reply.response.failed_stage == 1
    assert reply.response.error.startswith("stage 1: unknown request 'r1'")


def _route(actors, workers, outs):
    """Deliver every Send to its stage's actor, as the nodes would; return the replies."""
    replies, queue = [], list(outs)
    while queue:
        out = queue.pop(0)
        if isinstance(out, Reply):
            replies.append(out)
            continue
        stage = int(out.dest.rsplit("-", 1)[1])
        actors[stage].admit(out.message)
        queue.extend(actors[stage].process(out.message, workers[stage]))
    return replies


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_actors_routed_in_process_reproduce_single_process_generation(n):
    model = stub_model()
    actors = [make_actor(s, n) for s in range(n)]
    workers = [open_worker(model, s, n) for s in range(n)]
    req = request(max_tokens=12)
    actors[0].admit(req)
    [reply] = _route(actors, workers, actors[0].process(req, workers[0]))
    ids = workers[0].tokenize("Say hello")
    assert list(reply.response.token_ids) == generate_full(model, ids, 12).token_ids
