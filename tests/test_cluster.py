"""Spec tiers 4 and 6: in-process clusters over real hypercorn HTTP/2 on loopback."""
import collections

import pytest
import trio

from cluster import PATIENT_SWIM, client_http, start_cluster, start_cluster_behind_nat
from node.transport import frames, wire
from node.stage_node import StageNode
from worker.models import stub_model, tinygrad_model
from worker.reference import generate_full
from worker.stub import StubTokenizer
from worker.weights.tiny import TinySource


def expected(model, prompt, max_tokens):
    ids = model.tokenizer().encode_chat(prompt)
    return ids, generate_full(model, ids, max_tokens).token_ids


@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_stub_cluster_answers_with_the_single_process_tokens(nursery, tmp_path, n):
    # answers, not liveness: a full suite's slow moments must not declare a stage dead (cluster.PATIENT_SWIM)
    orch, _, _ = await start_cluster(nursery, n, tmp_path, swim_config=PATIENT_SWIM)
    with trio.fail_after(60):
        response = await orch.submit("Say hello", max_tokens=16)
    ids, want = expected(stub_model(), "Say hello", 16)
    assert response.error is None
    assert list(response.token_ids) == want and list(response.prompt_token_ids) == ids
    assert response.text == StubTokenizer().decode([t for t in want if t not in StubTokenizer.stop_ids])
    assert len(response.stage_compute_ms) == n and all(ms > 0 for ms in response.stage_compute_ms)
    nursery.cancel_scope.cancel()


@pytest.mark.slow  # suite time: test_serving's tiny clusters check the same over HTTP/2 at N = 2 and 5
async def test_tiny_model_cluster_of_3_equals_generate_full(nursery, tmp_path):
    # tinygrad's compute thread holds the GIL through graph capture: see cluster.PATIENT_SWIM
    orch, _, _ = await start_cluster(nursery, 3, tmp_path, model="tiny", swim_config=PATIENT_SWIM)
    with trio.fail_after(120):
        response = await orch.submit("Say hello", max_tokens=12)
    _, want = expected(tinygrad_model(TinySource()), "Say hello", 12)
    assert list(response.token_ids) == want and response.text
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("links", ["stream", "post"])
@pytest.mark.parametrize("n", [2, 3, 4])
async def test_every_message_crosses_every_hop_intact_over_http2(nursery, tmp_path, monkeypatch, n, links):
    sent, received = [], []
    real_body_of, real_bodies, real_deliver = wire.body_of, frames.bodies, StageNode.deliver
    ended = trio.Event()  # the EndRequest may still be on its way down the chain when the response lands

    def recording_body_of(message):
        sent.append(message)
        return real_body_of(message)

    def recording_bodies(message):  # what a link stream frames
        sent.append(message)
        return real_bodies(message)

    def recording_deliver(self, message, **kw):
        real_deliver(self, message, **kw)
        received.append(message)
        if isinstance(message, wire.EndRequest) and message.request_id and len(
                [m for m in received if isinstance(m, wire.EndRequest)]) == n - 1:
            ended.set()

    monkeypatch.setattr(wire, "body_of", recording_body_of)
    monkeypatch.setattr(frames, "bodies", recording_bodies)
    monkeypatch.setattr(StageNode, "deliver", recording_deliver)
    # the prompt in one step (no smaller prefill chunks): the count below is one message per step and hop
    orch, urls, _ = await start_cluster(nursery, n, tmp_path, link_streams=links == "stream", chunked_prefill_size=64)
    with trio.fail_after(60):
        await orch.submit("Say hello", max_tokens=5)
        await ended.wait()
    kinds = collections.Counter(type(m).__name__ for m in sent)
    # 1 request; prefill + 4 decode steps through n - 1 hops; 5 tokens fed back; the end of the request
    # down the chain, freeing the slots; 1 response
    assert kinds == {"InferenceRequest": 1, "Activation": 5 * (n - 1), "NextTokens": 5, "EndRequest": n - 1,
                     "InferenceResponse": 1}
    stage_bound = [m for m in sent if not isinstance(m, wire.InferenceResponse)]
    assert sorted(map(repr, stage_bound)) == sorted(map(repr, received))  # equal, field by field, bytes too
    async with client_http() as c:  # every stage speaks TLS
        health = [(await c.get(url + "/health")).json() for url in urls]
    for h in health:  # gossip and these /health calls are HTTP/1.1; the pipeline's messages HTTP/2
        assert set(h["http_versions"]) <= {"2", "1.1"} and h["http_versions"]["2"] > 0
    streams = [h["link_streams"] for h in health]
    if links == "stream":  # each stage opened one stream to its next, the last one to stage 0
        assert streams == [{f"pp-stage-{(i + 1) % n}": 1} for i in range(n)]
        assert all(h["body_bytes"].get("/v1/activation", 0) == 0 for h in health)
    else:
        assert streams == [{}] * n and all(h["body_bytes"].get("/v1/link", 0) == 0 for h in health)
    nursery.cancel_scope.cancel()


async def test_an_orchestrator_nobody_can_reach_introduces_the_nodes_and_polls_for_the_answer(nursery, tmp_path):
    orch, _ = await start_cluster_behind_nat(nursery, 3, tmp_path)
    assert orch.url is None and orch.swim.me.meta.observer
    with trio.fail_after(60):
        response = await orch.submit("Say hello", max_tokens=10)
    _, want = expected(stub_model(), "Say hello", 10)
    assert list(response.token_ids) == want
    nursery.cancel_scope.cancel()
