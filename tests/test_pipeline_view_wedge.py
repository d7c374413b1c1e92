"""A flood of `GET /v1/pipeline` (a client key's) neither wedges stage 0's HTTP/2 connections to the other stages
nor multiplies the asks for hop figures it makes of them (issue 33's second audit, finding 2), on an in-process
cluster over real HTTP."""
import pytest
import trio

import node.main
from cluster import API_KEY, client_http, start_cluster
from node.api import pipeline_view
from node.api.pipeline_view import HOPS_FRESH_S, fresh
from node.observe.hops import HopStats
from node.transport.client import PeerClient

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONNECTIONS, VIEWS = 2, 50  # concurrent views on each of a key holder's HTTP/2 connections (under the 128 in flight
# node/transport/stream_guard.py allows one address)


async def _flood_of_views(url: str) -> list[int]:
    statuses = []

    async def views():
        async with client_http(http1=False, http2=True, timeout=60, headers=AUTH) as client:
            async with trio.open_nursery() as nursery:
                for _ in range(VIEWS):
                    nursery.start_soon(view, client)

    async def view(client):
        statuses.append((await client.get(url + "/v1/pipeline")).status_code)

    async with trio.open_nursery() as nursery:
        for _ in range(CONNECTIONS):
            nursery.start_soon(views)
    return statuses


def _slower_than_the_view(answer):
    async def slow():
        await trio.sleep(2 * pipeline_view.HOPS_TIMEOUT_S)
        return await answer()
    return slow


async def test_a_flood_of_views_cut_off_mid_ask_leaves_the_pipeline_connections_open_to_new_requests(
        nursery, tmp_path, monkeypatch):
    # The stages answer their hop figures slower than the view waits, so every ask is cut off while in flight; on
    # the pipeline's HTTP/2 client that leaked a stream each (encode/httpcore#1022) until every new request there,
    # the link's probe and reopen too, failed with "Max outbound streams is 100, 100 open".
    monkeypatch.setattr(pipeline_view, "HOPS_FRESH_S", 0.0)  # every view gathers anew: as many cut-off asks as can be
    pipeline_clients, apps = [], []

    class Recorded(PeerClient):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            pipeline_clients.append(self)

    def make_app(*a, **kw):
        apps.append(real_make_app(*a, **kw))
        return apps[-1]

    real_make_app = node.main.make_app
    monkeypatch.setattr(node.main, "PeerClient", Recorded)
    monkeypatch.setattr(node.main, "make_app", make_app)
    _, urls, _ = await start_cluster(nursery, 3, tmp_path)
    assert len(pipeline_clients) == 3
    for app in apps[1:]:
        app.view_functions["hop_figures"] = _slower_than_the_view(app.view_functions["hop_figures"])
    for _ in range(3):
        assert set(await _flood_of_views(urls[0])) == {200}
    for client in pipeline_clients:  # every node's pipeline client still opens new requests to every stage
        for url in urls:
            with trio.fail_after(10):
                assert (await client.http.get(url + "/health")).status_code == 200
    nursery.cancel_scope.cancel()


async def test_concurrent_views_share_their_asks_for_hop_figures(nursery, tmp_path, monkeypatch):
    asks = []
    real = HopStats.summary

    def counted(self):
        asks.append(self)
        return real(self)

    monkeypatch.setattr(HopStats, "summary", counted)
    _, urls, _ = await start_cluster(nursery, 3, tmp_path)
    asks.clear()
    assert set(await _flood_of_views(urls[0])) == {200}
    # One gathering asks stages 1 and 2 once each; the flood spans a few gatherings at most, never one per view.
    assert 2 <= len(asks) <= 2 * 10, len(asks)
    async with client_http(timeout=30, headers=AUTH) as client:
        stages = (await client.get(urls[0] + "/v1/pipeline")).json()["stages"]
    assert [s["state"] for s in stages] == ["alive"] * 3
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("gathered, asked, now, expected", [
    (None, ((1, "a"),), 0.0, False),  # nothing gathered yet
    ((10.0, ((1, "a"),)), ((1, "a"),), 10.0 + HOPS_FRESH_S / 2, True),
    ((10.0, ((1, "a"),)), ((1, "a"),), 10.0 + HOPS_FRESH_S, False),  # too old
    ((10.0, ((1, "a"),)), ((1, "b"),), 10.0, False),  # stage 1 has a new holder
    ((10.0, ((1, "a"),)), ((1, "a"), (2, "c")), 10.0, False),  # stage 2 came alive
])
def test_gathered_hop_figures_serve_views_only_while_fresh_and_of_the_same_stages(gathered, asked, now, expected):
    assert fresh(gathered, asked, now) is expected
