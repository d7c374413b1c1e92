"""A member's gossip over real HTTP (issue 33; a member: a connection that showed the cluster's certificate): a sync
naming more members than one message may carry is a 400 naming the limit, syncs within it leave every view capped,
and every stage stays alive and held."""
import json

import trio

from cluster import TOKEN, client_http, member_http, start_cluster
from node.membership import gossip
from node.transport import wire
from node.transport.gossip_routes import GOSSIP_MAX_BODY

JSON = {"Content-Type": "application/json"}


def strangers(first: int, n: int) -> bytes:
    """A sync body naming n members nobody runs (port 9 refuses): as many as a member likes."""
    members = [gossip.Member(f"stranger-{i}", "https://127.0.0.1:9", 1) for i in range(first, first + n)]
    return json.dumps({"members": wire.converter.unstructure(members)}).encode()


async def test_a_member_s_syncs_are_refused_past_the_cap_and_leave_views_capped_and_stages_held(
        nursery, tmp_path):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    holders = {name: orch.swim.resolve(name).id for name in ("pp-stage-0", "pp-stage-1")}
    async with client_http(timeout=30) as outsider:  # the token sent as a bearer opens no gossip route
        r = await outsider.post(urls[0] + "/swim/sync", headers={**JSON, "Authorization": f"Bearer {TOKEN}"},
                                content=strangers(0, 1))
        assert r.status_code == 403 and "never sent" in r.json()["error"]
    async with member_http(timeout=30) as client:
        for url in urls:
            r = await client.post(url + "/swim/sync", headers=JSON, content=strangers(0, 4 * gossip.MAX_ENTRIES))
            assert r.status_code == 400, r.text[:300]
            assert f"over the limit of {gossip.MAX_ENTRIES}" in r.json()["error"]
        for batch in range(1, 4):  # within the entry cap, ever more members: 3 * MAX_ENTRIES in all
            r = await client.post(urls[0] + "/swim/sync", headers=JSON,
                                  content=strangers(batch * gossip.MAX_ENTRIES, gossip.MAX_ENTRIES))
            assert r.status_code == 200 and len(r.json()["members"]) <= gossip.MAX_MEMBERS
        await trio.sleep(1.0)  # several protocol periods: the strangers are probed, and gossiped on
        for url in urls:
            view = (await client.get(url + "/v1/members")).json()["members"]
            states = {m["id"]: m["state"] for m in view}
            assert len(view) <= gossip.MAX_MEMBERS
            assert all(states[i] == "alive" for i in holders.values()), states
            assert (await client.get(url + "/health")).status_code == 200
    assert {name: orch.swim.resolve(name).id for name in holders} == holders
    assert len(orch.swim.members()) <= gossip.MAX_MEMBERS
    nursery.cancel_scope.cancel()


async def test_a_gossip_body_past_its_cap_is_refused_before_it_is_decoded(nursery, tmp_path, monkeypatch):
    decoded = []
    real_decode = wire.decode
    # only bodies past the cap count: the two nodes' own pings and acks go on being decoded meanwhile
    monkeypatch.setattr(wire, "decode", lambda kind, body: (len(body) > GOSSIP_MAX_BODY and decoded.append(kind))
                        or real_decode(kind, body))
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    body = strangers(0, 20 * gossip.MAX_ENTRIES)  # about a MiB: well within the app's body limit for prompts
    # HTTP/2: an answer before the body is in resets the stream and the client reads it; over HTTP/1.1 the server
    # closes, and a TLS client whose write broke cannot read the answer behind it (trio's SSLStream is then broken)
    async with member_http(timeout=30, http2=True) as client:
        for path in ("/swim/sync", "/swim/ping", "/swim/ping-req"):
            decoded.clear()
            r = await client.post(urls[0] + path, headers=JSON, content=body)
            assert r.status_code == 413 and "gossip message is at most" in r.json()["error"], r.text[:300]
            assert not [kind for kind in decoded if kind.__module__ == gossip.__name__]
        assert (await client.get(urls[0] + "/health")).status_code == 200
    nursery.cancel_scope.cancel()
