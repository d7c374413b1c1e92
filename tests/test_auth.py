"""Two kinds of credential (node/transport/auth.py): a member's certificate (derived from the cluster token, which is
never sent) opens what the nodes say to each other, a client API key opens the client surface and nothing else. A
client key cannot steer the cluster (issue 23: an API user had the token, and with it gossip, links and ping-req's
dialling), the token sent as a bearer opens nothing of the cluster's, and it is not a client key unless the
operator says so."""
import functools
import json

import pytest
import trio

from cluster import API_KEY, TOKEN, client_http, member_http, start_cluster
from node.transport import auth, wire
from node.membership import gossip
from node.transport.auth import Credential

TOKEN_AUTH = {"Authorization": f"Bearer {TOKEN}"}
KEY_AUTH = {"Authorization": f"Bearer {API_KEY}"}
CLIENT_SURFACE = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                  ("GET", "/v1/models/stub"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/pipeline"),
                  ("GET", "/metrics")]
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/stub", "/tokenize", "/detokenize")
# every endpoint a node serves to its peers and its runner (node/transport/app.py)
INTERNAL = [("POST", "/swim/ping"), ("POST", "/swim/ping-req"), ("POST", "/swim/sync"), ("GET", "/v1/members"),
            ("POST", "/v1/inference"), ("POST", "/v1/cancel"), ("POST", "/v1/response"), ("POST", "/v1/next-token"),
            ("POST", "/v1/end"), ("POST", "/v1/activation"), ("POST", "/v1/link?link=l1&from=pp-stage-0"),
            ("GET", "/v1/link/l1"), ("GET", "/v1/response/r1?wait=0"), ("GET", "/v1/hops"), ("POST", "/v1/hops/reset")]


# --- the decision, as a table ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path, credential, member, opt_in, status", [
    ("/health", Credential.NONE, False, False, None),
    ("/", Credential.NONE, False, False, None),
    ("/v1/chat/completions", Credential.CLIENT, False, False, None),
    ("/v1/chat/completions", Credential.CLIENT, True, False, None),  # a member with a key is a client here
    ("/metrics", Credential.CLIENT, False, False, None),
    ("/v1/pipeline", Credential.CLIENT, False, False, None),
    ("/v1/models", Credential.NONE, False, False, 401),
    ("/v1/models", Credential.NONE, True, False, 403),  # a member's certificate is no client key
    ("/v1/models", Credential.CLUSTER, False, False, 403),
    ("/v1/models", Credential.CLUSTER, False, True, None),
    ("/metrics", Credential.CLUSTER, False, False, 403),
    ("/swim/ping-req", Credential.NONE, True, False, None),  # membership is the connection's certificate
    ("/swim/ping-req", Credential.CLIENT, True, False, None),
    ("/swim/ping-req", Credential.CLUSTER, False, False, 403),  # the token sent opens nothing of the cluster's
    ("/swim/ping-req", Credential.CLUSTER, False, True, 403),
    ("/swim/ping-req", Credential.CLIENT, False, False, 403),
    ("/swim/ping-req", Credential.CLIENT, False, True, 403),  # the opt-in widens the token, never a client key
    ("/swim/ping-req", Credential.NONE, False, False, 401),
    ("/v1/inference", Credential.CLIENT, False, False, 403),
    ("/v1/chat/completions/", Credential.CLIENT, False, False, 403),  # not the client surface: the cluster's
    ("/v1/added-later", Credential.CLIENT, False, False, 403),
    ("/v1/added-later", Credential.NONE, True, False, None),
    ("/tokenize", Credential.CLIENT, False, False, None),
    ("/detokenize", Credential.CLUSTER, False, False, 403),
    ("/detokenize", Credential.NONE, False, False, 401),
    ("/v1/models/org/name", Credential.CLIENT, False, False, None),
    ("/v1/models/org/name", Credential.CLUSTER, False, False, 403),
    ("/v1/modelsx", Credential.CLIENT, False, False, 403),
])
def test_each_path_takes_its_own_kind_of_credential(path, credential, member, opt_in, status):
    refused = auth.refusal(path, credential, member=member, token_is_api_key=opt_in)
    assert (refused and refused.status) == status


@pytest.mark.parametrize("credential, member, status", [(Credential.CLIENT, False, None),
                                                        (Credential.CLUSTER, False, None), (Credential.NONE, True, None),
                                                        (Credential.NONE, False, 401)])
def test_a_path_no_route_serves_is_for_either_credential_to_hear_so(credential, member, status):
    refused = auth.refusal("/v1/embeddings", credential, member=member, routed=False)  # the app answers it 404
    assert (refused and refused.status) == status


def test_a_header_is_the_token_a_client_key_or_nothing():
    keys = auth.Keys.of(TOKEN, ("k1", "k2"))
    assert [keys.credential(h) for h in (f"Bearer {TOKEN}", "Bearer k2", "Bearer k1", "k1", "Bearer k", "",
                                         f"Bearer {TOKEN} ")] == \
        [Credential.CLUSTER, Credential.CLIENT, Credential.CLIENT] + [Credential.NONE] * 4
    assert TOKEN not in repr(keys) and "k1" not in repr(keys)


def test_refusals_name_the_credential_wanted_and_hold_none():
    messages = [auth.refusal(p, c).message for p, c in [("/v1/models", Credential.NONE), ("/v1/models", Credential.CLUSTER),
                                                          ("/swim/sync", Credential.NONE), ("/swim/sync", Credential.CLIENT)]]
    assert "API key" in messages[0] and "cluster token" in messages[1] and "PP_TOKEN_IS_API_KEY" in messages[1]
    assert "member's certificate" in messages[2] and "client API key opens only" in messages[3]
    assert "never sent" in auth.refusal("/swim/sync", Credential.CLUSTER).message


# --- on a live cluster -------------------------------------------------------------------------------------------

@pytest.fixture
async def cluster(nursery, tmp_path):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    async with client_http(timeout=10) as client:  # over TLS, without a member's certificate
        yield orch, urls, client
    nursery.cancel_scope.cancel()


async def call(client, method, url, headers, body=b"{}"):
    r = await client.request(method, url, headers={**headers, "Content-Type": "application/json"},
                             content=body if method == "POST" else None)
    return r.status_code, r.json()


async def test_a_path_no_route_serves_is_404_to_a_client_key_and_the_token_and_401_to_anyone_else(cluster):
    _, urls, client = cluster
    for headers, status in ((KEY_AUTH, 404), (TOKEN_AUTH, 404), ({}, 401), ({"Authorization": "Bearer x"}, 401)):
        r = await client.get(urls[0] + "/v1/no-such-endpoint", headers=headers)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_a_client_key_opens_no_internal_endpoint(cluster):
    _, urls, client = cluster
    for url in urls:
        for method, path in INTERNAL:
            status, body = await call(client, method, url + path, KEY_AUTH)
            assert status == 403 and "for the cluster's own nodes" in body["error"], (url, path, body)
            assert API_KEY not in json.dumps(body) and TOKEN not in json.dumps(body)
    for url in urls:  # nor does the token itself, sent
        for method, path in INTERNAL:
            status, body = await call(client, method, url + path, TOKEN_AUTH)
            assert status == 403 and "never sent" in body["error"], (url, path, body)
    async with member_http(timeout=10) as member:  # a member's certificate does
        status, body = await call(member, "GET", urls[0] + "/v1/members", {})
    assert status == 200 and len(body["members"]) == 3


async def test_ping_req_with_a_client_key_is_refused_and_the_node_dials_nobody(cluster, nursery):
    # the SSRF of issue 23: stage 0 POSTed to any address named in target_addr, with the bearer token attached
    _, urls, client = cluster
    dialled = []

    async def listener(stream):
        dialled.append(await stream.receive_some())
    [listening] = await nursery.start(functools.partial(trio.serve_tcp, listener, 0, host="127.0.0.1"))
    port = listening.socket.getsockname()[1]
    me = gossip.Member("prober", "http://127.0.0.1:9", 1)
    probe = wire.encode(gossip.PingReq(me, "stage1", f"http://127.0.0.1:{port}/any/path?q=", 1))
    status, body = await call(client, "POST", urls[0] + "/swim/ping-req", KEY_AUTH, probe)
    await trio.sleep(1.0)  # a probe would go out at once, within the relay's probe timeout
    assert status == 403 and dialled == []


async def test_a_client_key_can_neither_declare_a_stage_dead_nor_announce_a_member(cluster):
    orch, urls, client = cluster
    async with member_http(timeout=10) as member:
        _, view = await call(member, "GET", urls[0] + "/v1/members", {})
    stage1 = next(gossip_member(m) for m in view["members"] if m["meta"]["stage"] == 1)
    me = gossip.Member("prober", "http://127.0.0.1:9", 1)
    dead = gossip.Ping(me, "stage0", 7, updates=(gossip.Member(stage1.id, stage1.addr, stage1.incarnation + 1,
                                                               gossip.State.DEAD, stage1.meta),))
    fake = gossip.Sync((gossip.Member("fake-stage1", "http://127.0.0.1:9", stage1.incarnation + 1,
                                      meta=gossip.Meta(stage=1, names=("pp-stage-1",), ready=True)),))
    for url in urls:
        assert (await call(client, "POST", url + "/swim/ping", KEY_AUTH, wire.encode(dead)))[0] == 403
        assert (await call(client, "POST", url + "/swim/sync", KEY_AUTH, wire.encode(fake)))[0] == 403
    await trio.sleep(1.0)  # several protocol periods: what had been taken in would have spread
    for url in urls:
        async with member_http(timeout=10) as member:
            _, view = await call(member, "GET", url + "/v1/members", {})
        states = {m["id"]: m["state"] for m in view["members"]}
        assert states[stage1.id] == "alive" and "fake-stage1" not in states and "prober" not in states, states
    assert orch.swim.resolve("pp-stage-1").id == stage1.id


def gossip_member(raw: dict) -> gossip.Member:
    return wire.converter.structure(raw, gossip.Member)


async def test_the_cluster_token_is_refused_on_the_client_surface_and_a_client_key_opens_it(cluster):
    _, urls, client = cluster
    chat = json.dumps({"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    completion = json.dumps({"model": "stub", "prompt": "hi", "max_tokens": 2}).encode()
    bodies = {"/v1/chat/completions": chat, "/v1/completions": completion, "/tokenize": b'{"prompt": "hi"}',
              "/detokenize": b'{"tokens": [2, 3]}'}
    for method, path in CLIENT_SURFACE:
        r = await client.request(method, urls[0] + path, headers=TOKEN_AUTH, content=bodies.get(path))
        error = r.json()["error"]
        assert r.status_code == 403, (path, r.text)
        message = error["message"] if path in API_PATHS else error  # OpenAI's shape on its paths
        assert "not a client API key" in message and TOKEN not in r.text
        r = await client.request(method, urls[0] + path, headers=KEY_AUTH, content=bodies.get(path))
        assert r.status_code == 200, (path, r.text)
    assert (await client.get(urls[1] + "/metrics", headers=KEY_AUTH)).status_code == 200  # on every node
    assert (await client.get(urls[1] + "/metrics", headers=TOKEN_AUTH)).status_code == 403


async def test_a_missing_key_is_401_naming_the_credential_each_path_wants(cluster):
    _, urls, client = cluster
    r = await client.get(urls[0] + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "API key" in r.json()["error"]["message"]
    r = await client.get(urls[0] + "/metrics", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "API key" in r.json()["error"]
    r = await client.post(urls[0] + "/swim/sync", content=b"{}", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "member's certificate" in r.json()["error"]
    assert (await client.get(urls[0] + "/health")).status_code == 200 and (await client.get(urls[0] + "/")).status_code == 200


async def test_with_the_operators_opt_in_the_cluster_token_opens_the_client_surface_too(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, token_is_api_key=True)
    async with client_http(timeout=10) as client:
        for headers in (TOKEN_AUTH, KEY_AUTH):
            assert (await client.get(urls[0] + "/v1/models", headers=headers)).status_code == 200
            assert (await client.get(urls[1] + "/metrics", headers=headers)).status_code == 200
        status, _ = await call(client, "POST", urls[0] + "/swim/sync", KEY_AUTH)
        assert status == 403  # a client key still opens nothing of the cluster's
    nursery.cancel_scope.cancel()
