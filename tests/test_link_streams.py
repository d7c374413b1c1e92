"""Link streams between stages, through real in-process clusters: a stream whose connection drops mid-request
is re-opened and the request goes on as if nothing happened (the stand-in model's tokens show any step
lost, repeated or reordered); a stage that restarts mid-request fails it cleanly, naming the stage, and
the chain serves the next request through the new stage; what a sender resends when a stream opens again."""
import functools

import attrs
import httpx
import pytest
import trio

from cluster import API_KEY, _node_until_listening, client_http, slow_stub, stage_config, start_cluster, stub_tokens
from node.observe import hops
from runner.orchestrator import StageDied
from node.stage_node import StageNode
from node.transport.streams import LinkLost, LinkStream
from roles.messages import EndReason, EndRequest
from worker.models import stub_model
from worker.reference import generate_full


def record_nodes(monkeypatch) -> list[StageNode]:
    nodes, real_init = [], StageNode.__init__

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        nodes.append(self)
    monkeypatch.setattr(StageNode, "__init__", init)
    return nodes


async def drop_connections(node: StageNode) -> int:
    """Close every connection the node's client holds, as a network failure would: the peer sees EOF."""
    pool = node.client.http._transport._pool
    for connection in list(pool.connections):
        await connection.aclose()
    return len(pool.connections)


async def test_a_link_whose_connection_drops_mid_request_is_reopened_and_loses_nothing(nursery, tmp_path, monkeypatch):
    nodes = record_nodes(monkeypatch)
    orch, urls, _ = await start_cluster(nursery, 3, tmp_path)
    slow_stub(monkeypatch, 0.01)

    async def drop_twice():
        for _ in range(2):
            await trio.sleep(0.3)
            for node in (nodes[0], nodes[2]):  # the link 0 -> 1 and the feedback 2 -> 0
                await drop_connections(node)

    async with trio.open_nursery() as inner:
        inner.start_soon(drop_twice)
        with trio.fail_after(60):
            response = await orch.submit("Say hello", max_tokens=60)
    assert response.error is None and list(response.token_ids) == stub_tokens("Say hello", 60)
    async with client_http() as c:
        opened = [(await c.get(u + "/health")).json()["link_streams"] for u in urls]
    assert opened[0]["pp-stage-1"] >= 2 and opened[2]["pp-stage-0"] >= 2, opened
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("stage", [0, 1])
async def test_a_link_stream_its_receiver_ends_early_is_reset_reopened_and_resent_from_the_frame_after(
        nursery, tmp_path, monkeypatch, stage):
    """The receiver's handler fails after delivering a frame (any exception but a malformed frame): its
    answer comes while the sender still writes, so the stream is reset (node/transport/h2_early_answer.py),
    the sender reopens it and resends exactly the frames after that one: none lost, none twice."""
    nodes = record_nodes(monkeypatch)
    orch, urls, _ = await start_cluster(nursery, 3, tmp_path, max_seqs=4)
    slow_stub(monkeypatch, 0.01)
    real, taken = StageNode.take_frame, []

    def take_frame(self, link_id, source, seq, sent_at, message):
        real(self, link_id, source, seq, sent_at, message)
        if self is nodes[stage]:
            taken.append(seq)
            if len(taken) == 12:  # mid-answer, once
                raise RuntimeError("injected: the handler fell over after taking a frame")
    monkeypatch.setattr(StageNode, "take_frame", take_frame)
    prompts = [f"prompt {i}" for i in range(4)]
    results = {}

    async def ask(prompt):
        results[prompt] = await orch.submit(prompt, max_tokens=30)

    with trio.fail_after(60):
        async with trio.open_nursery() as clients:
            for prompt in prompts:
                clients.start_soon(ask, prompt)
    for prompt in prompts:
        assert results[prompt].error is None and list(results[prompt].token_ids) == stub_tokens(prompt, 30)
    link = nodes[stage - 1].links.streams[f"pp-stage-{stage}"]  # stage 0's sender is the last stage
    assert link.opened >= 2 and len(taken) > 12
    assert taken == sorted(set(taken)), "a frame delivered twice or out of order"
    nursery.cancel_scope.cancel()


async def test_a_stage_restarted_mid_request_fails_it_naming_the_stage_then_the_chain_serves_again(
        nursery, tmp_path, monkeypatch):
    orch, urls, scopes = await start_cluster(nursery, 3, tmp_path)
    slow_stub(monkeypatch, 0.01)

    async def stop_stage_1():
        await trio.sleep(0.5)
        scopes[1].cancel()

    nursery.start_soon(stop_stage_1)
    with trio.fail_after(30):
        try:
            response = await orch.submit("Say hello", max_tokens=400)
        except StageDied as exc:  # gossip noticed first
            assert exc.member.meta.stage == 1
        else:
            assert response.error is not None and "pp-stage-1" in response.error, response
    old = orch.swim.resolve("pp-stage-1")
    config = attrs.evolve(stage_config(1, 3, model="stub", seed=orch.url, peer=urls[0], tmp=tmp_path),
                          node_id="stage1-again")
    new_url = await nursery.start(functools.partial(_node_until_listening, config, None))
    with trio.fail_after(30):
        await orch.swim.wait_until(lambda s: (m := s.resolve("pp-stage-1")) is not None and m.addr == new_url
                                   and m.meta.ready)
    assert old is None or old.addr != new_url
    # through the entry's API: the runner's own submit refuses to ask a cluster that has lost a member
    messages = [{"role": "user", "content": "Say hello"}]
    async with client_http(timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        r = await c.post(urls[0] + "/v1/chat/completions", json={
            "model": "stub", "messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    model = stub_model()
    want = generate_full(model, model.tokenizer().encode_messages(messages), 8).token_ids
    assert r.json()["choices"][0]["token_ids"] == list(want)
    nursery.cancel_scope.cancel()


# --- what a sender resends when it opens a stream again (LinkStream._resume), against a stand-in peer --------

def link_to(answers: list[dict]) -> tuple[LinkStream, list]:
    """A link to a peer that answers GET /v1/link/<id> with `answers`, in turn; and the lost messages."""
    replies, lost = iter(answers), []
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=next(replies)))
    link = LinkStream("pp-stage-1", source="pp-stage-0", resolve=lambda name: "http://peer",
                      client=httpx.AsyncClient(transport=transport), stats=hops.HopStats(),
                      on_lost=lambda messages, error: lost.append((messages, error)))
    return link, lost


ENDS = [EndRequest(f"r{n}", EndReason.FINISHED) for n in range(3)]


async def test_frames_a_peer_has_not_taken_are_resent_and_those_it_has_are_dropped():
    link, _ = link_to([{"last_seq": None, "boot": "a"}, {"last_seq": 2, "boot": "a"}])
    assert await link._resume("http://peer") == []
    for message in ENDS:
        link.frame(message)
    assert await link._resume("http://peer") == [(3, ENDS[2])]


async def test_a_peer_that_took_nothing_yet_gets_every_kept_frame():
    link, _ = link_to([{"last_seq": None, "boot": "a"}, {"last_seq": None, "boot": "a"}])
    await link._resume("http://peer")
    for message in ENDS:
        link.frame(message)
    assert await link._resume("http://peer") == list(enumerate(ENDS, start=1))


async def test_a_restarted_peer_is_sent_nothing_it_lost_the_start_of():
    # the stages after it still hold those requests: a start resent through it would arrive there twice
    link, _ = link_to([{"last_seq": None, "boot": "a"}, {"last_seq": None, "boot": "b"},
                       {"last_seq": None, "boot": "b"}])
    await link._resume("http://peer")
    link.frame(ENDS[0])
    with pytest.raises(LinkLost, match="pp-stage-1 restarted"):
        await link._resume("http://peer")
    link._take_kept()  # as run() does: those requests fail
    assert await link._resume("http://peer") == []  # and the link goes on with the new peer
