"""Link streams between stages, through real in-process clusters: a stream whose connection drops mid-request
is re-opened and the request goes on as if nothing happened (the stand-in model's tokens show any step
lost, repeated or reordered); a stage that restarts mid-request fails it cleanly, naming the stage, and
the chain serves the next request through the new stage."""
import functools

import attrs
import httpx
import trio

from cluster import TOKEN, _node_until_listening, slow_stub, stage_config, start_cluster, stub_tokens
from node.orchestrator import StageDied
from node.stage_node import StageNode
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
    async with httpx.AsyncClient() as c:
        opened = [(await c.get(u + "/health")).json()["link_streams"] for u in urls]
    assert opened[0]["pp-stage-1"] >= 2 and opened[2]["pp-stage-0"] >= 2, opened
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
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        r = await c.post(urls[0] + "/v1/chat/completions", json={
            "model": "stub", "messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    model = stub_model()
    want = generate_full(model, model.tokenizer().encode_messages(messages), 8).token_ids
    assert r.json()["choices"][0]["token_ids"] == list(want)
    nursery.cancel_scope.cancel()
