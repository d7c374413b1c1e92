"""Bad input at a node's HTTP edge is refused with a clear 4xx, and the node keeps serving; every refusal is
JSON (OpenAI's shape where an OpenAI client may meet it), and /health's status says whether the cluster serves."""
import functools
import json
import struct

import httpx
import pytest
import trio

import cluster as local
from cluster import API_KEY, FAST_SWIM, TOKEN, api, client_http, member_http, stage_config, start_cluster
from node.transport import wire
from worker.models import stub_model
from worker.reference import generate_full
from worker.stub import STUB_DIM

AUTH = {"Authorization": f"Bearer {TOKEN}"}  # the token sent: it opens nothing of the cluster's (a member's connection does)
KEY = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 64 * 1024


@pytest.fixture
async def cluster(nursery, tmp_path):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, max_body_bytes=MAX_BODY)
    async with member_http(http1=False, http2=True, timeout=10) as client:  # a member's certificate
        yield orch, urls, client
    nursery.cancel_scope.cancel()


def activation(rid="r", position=0, seq_len=1, hidden_len=None, prefill=True):
    segment = {"request_id": rid, "position": position, "seq_len": seq_len, "stage_ms": [],
               "start": {"max_tokens": 4, "sampling": {"temperature": 0.0, "top_p": 1.0, "seed": 0},
                         "prompt_token_ids": [1], "reply_to": None, "queued_ms": 0.0} if prefill else None}
    raw = json.dumps({"segments": [segment]}).encode()
    n = seq_len * STUB_DIM * 4 if hidden_len is None else hidden_len
    return struct.pack(">I", len(raw)) + raw + b"\0" * n


async def answer(client, url, path, body, headers=None, content_type="application/json"):
    r = await client.post(url + path, content=body, headers={**(headers or {}), "Content-Type": content_type})
    return r.status_code, r.json().get("error", "")


async def test_health_needs_no_certificate_but_everything_else_does(cluster):
    _, urls, _ = cluster
    async with client_http(timeout=10) as client:  # over TLS, without a member's certificate
        assert (await client.get(urls[0] + "/health")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            status, error = await answer(client, urls[0], "/v1/inference", b"{}", headers)
            assert status == 401 and "member's certificate" in error and TOKEN not in error
            assert (await client.get(urls[0] + "/v1/members", headers=headers)).status_code == 401
        status, error = await answer(client, urls[0], "/v1/inference", b"{}", AUTH)  # the token, sent
        assert status == 403 and "never sent" in error and TOKEN not in error


@pytest.mark.parametrize("body,field", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"request_id": "r"}', "body.prompt"),
    (b'{"request_id": "r", "prompt": "hi", "colour": "red"}', "colour"),
    (b'{"request_id": "r", "prompt": "hi", "max_tokens": "5"}', "body.max_tokens"),
    (b'{"request_id": "r", "prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"request_id": "r", "prompt": "hi", "reply_to": "not a url"}', "reply_to: 'not a url' is not an http(s) URL"),
    (b'{"request_id": "r", "prompt": "hi", "reply_to": "file:///etc/passwd"}', "not an http(s) URL"),
    # a well-formed URL that is nobody in the cluster: the exit node would POST there for whoever asked
    (b'{"request_id": "r", "prompt": "hi", "reply_to": "http://10.1.2.3:80"}', "not the advertised address of a member"),
])
async def test_malformed_requests_get_400_naming_the_problem(cluster, body, field):
    _, urls, client = cluster
    status, error = await answer(client, urls[0], "/v1/inference", body)
    assert status == 400 and field in error


@pytest.mark.parametrize("body,field", [
    (activation(hidden_len=STUB_DIM * 2), "hidden: 32 bytes, expected 1 rows (the segments' seq_len) x hidden_dim 16"),
    (activation(hidden_len=7), "hidden: 7 bytes"),
    (activation()[:2], "shorter than its 4-byte metadata length"),
    (struct.pack(">I", 999) + b"{}", "runs past the body"),
    (activation(seq_len=0), "seq_len"),
    (activation(position=2), "start: present exactly on a request's first segment"),
])
async def test_malformed_activations_get_400(cluster, body, field):
    _, urls, client = cluster
    status, error = await answer(client, urls[1], "/v1/activation", body, content_type="application/octet-stream")
    assert status == 400 and field in error


async def test_an_oversized_body_gets_413(cluster):
    _, urls, client = cluster
    status, error = await answer(client, urls[1], "/v1/activation", b"\0" * (MAX_BODY + 1),
                                 content_type="application/octet-stream")
    assert status == 413 and str(MAX_BODY) in error


@pytest.mark.parametrize("stage,path,body,status,text", [
    (0, "/v1/next-token", wire.encode(wire.NextTokens((wire.Token("nope", 1, 3, False),))), 404,
     "unknown request 'nope'"),
    (1, "/v1/activation", activation(rid="nope", position=3, prefill=False), 404, "unknown request 'nope'"),
    (1, "/v1/next-token", wire.encode(wire.NextTokens((wire.Token("r", 1, 3, False),))), 409,
     "does not accept NextTokens"),
    (1, "/v1/cancel", wire.encode(wire.CancelRequest("r")), 409, "does not accept CancelRequest"),
    (1, "/v1/inference", wire.encode(wire.InferenceRequest("r", "hi")), 409, "does not accept InferenceRequest"),
    (0, "/v1/activation", activation(), 409, "does not accept Activation"),
    (0, "/v1/response", wire.encode(wire.InferenceResponse("r")), 409, "does not accept InferenceResponse"),
])
async def test_unknown_requests_and_wrong_role_messages_get_a_clear_4xx(cluster, stage, path, body, status, text):
    _, urls, client = cluster
    ctype = "application/octet-stream" if path == "/v1/activation" else "application/json"
    got, error = await answer(client, urls[stage], path, body, content_type=ctype)
    assert got == status and text in error


async def test_a_reply_to_naming_the_orchestrator_or_a_member_is_accepted(cluster):
    orch, urls, client = cluster
    for n, target in enumerate([orch.url, urls[1] + "/"]):
        body = json.dumps({"request_id": f"r{n}", "prompt": "hi", "max_tokens": 2, "reply_to": target}).encode()
        assert await answer(client, urls[0], "/v1/inference", body) == (202, "")


@pytest.mark.parametrize("text, ok", [
    ("http://10.0.0.1:8000", True), ("https://node.example/base", True), ("http://[::1]:9/", True),
    ("ftp://10.0.0.1", False), ("http://", False), ("10.0.0.1:8000", False), ("http://a:99999", False),
    ("http://user@host:1", False), ("http://host:1/?x=1", False), ("", False),
])
def test_only_absolute_http_urls_can_be_replied_to(text, ok):
    from roles.messages import is_http_url
    assert is_http_url(text) is ok


@pytest.mark.parametrize("reply_to, known, ok", [
    ("http://a:1", ["http://a:1"], True), ("http://a:1/", ["http://a:1"], True), ("http://a:1", ["http://a:1/"], True),
    ("http://a:2", ["http://a:1", None], False), ("http://a:1/x", ["http://a:1"], False),
])
def test_a_reply_target_must_be_a_known_address(reply_to, known, ok):
    from node.stage_node import reply_target_error
    assert (reply_target_error(reply_to, known) is None) is ok


async def test_the_node_still_serves_after_bad_input_and_speaks_http1_too(cluster):
    orch, urls, client = cluster
    await answer(client, urls[0], "/v1/inference", b"garbage")
    await answer(client, urls[1], "/v1/activation", b"\0" * (MAX_BODY + 1), content_type="application/octet-stream")
    async with member_http(http1=True, http2=False) as h1:
        r = await h1.get(urls[0] + "/v1/members")
        assert r.status_code == 200 and r.http_version == "HTTP/1.1" and len(r.json()["members"]) == 3
    with trio.fail_after(30):
        response = await orch.submit("Say hello", max_tokens=8)
    model = stub_model()
    assert list(response.token_ids) == generate_full(model, model.tokenizer().encode_chat("Say hello"), 8).token_ids


async def test_a_large_body_refused_before_it_is_read_does_not_take_the_node_down(cluster):
    orch, urls, client = cluster
    async with client_http(http1=False, http2=True, timeout=10) as guest:
        for asker, status in ((guest, 401), (client, 413)):  # 401 before reading, and 413 before reading
            got, _ = await answer(asker, urls[1], "/v1/activation", b"\0" * (4 * MAX_BODY),
                                  content_type="application/octet-stream")
            assert got == status
    assert (await client.get(urls[1] + "/health")).status_code == 200


async def test_one_http2_connection_carries_more_than_a_thousand_requests(cluster):
    # hypercorn's default would end the connection after 1000 requests, and httpx does not retry that
    _, urls, client = cluster
    for _ in range(1100):
        r = await client.get(urls[0] + "/health")
        assert r.status_code == 200 and r.http_version == "HTTP/2"


async def test_a_long_poll_with_nothing_to_return_keeps_the_http2_connection(cluster):
    _, urls, client = cluster
    for _ in range(3):
        r = await client.get(urls[0] + "/v1/response/nobody?wait=0.1")
        assert r.status_code == 204 and r.http_version == "HTTP/2"
    r = await client.get(urls[0] + "/v1/members")
    assert r.status_code == 200


async def test_an_early_refusal_over_http1_closes_the_connection_instead_of_leaving_it_hanging(cluster):
    # Headers and body in separate writes, as httpx sends them: the 401 is decided on the headers, before
    # the body is in. hypercorn then sometimes left the kept-alive connection answering nothing.
    _, urls, _ = cluster
    host, port = urls[0].split("://")[1].split(":")  # stage 0's port serves its API in plain HTTP too
    head = "POST /v1/inference HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 35\r\n\r\n"
    for _ in range(20):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(head.encode())
            await trio.sleep(0.002)
            await stream.send_all(b"x" * 35)
            received = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some():  # until the server closes
                    received += chunk
        status_line, headers = received.split(b"\r\n", 1)
        assert b" 401 " in status_line and b"connection: close" in headers.lower()
    async with httpx.AsyncClient(http1=True, http2=False, timeout=3) as h1:
        for _ in range(50):  # a client that keeps connections alive gets every answer
            r = await h1.post(api(urls[0]) + "/v1/inference", content=b"x" * 35)
            assert r.status_code == 401 and r.http_version == "HTTP/1.1"
        r = await h1.get(api(urls[0]) + "/health")
        assert r.status_code == 200 and "close" not in r.headers.get("connection", "")


# -- every refusal is JSON --------------------------------------------------------------------------------

@pytest.mark.parametrize("method,path,headers,status,code", [
    ("GET", "/v1/embeddings", KEY, 404, None),  # no such route: any credential of the node's may learn that
    ("POST", "/v1/embeddings", AUTH, 404, None),
    ("POST", "/v1/embeddings", {}, 401, "invalid_api_key"),
    ("GET", "/v1/chat/completions", KEY, 405, None),
    ("DELETE", "/v1/models/stub", KEY, 405, None),
    ("GET", "/tokenize", KEY, 405, None),
    ("GET", "/v1/inference", AUTH, 405, None),  # the cluster's own route: a member may call it, not with GET
])
async def test_404s_and_405s_under_v1_are_openai_json_not_html_pages(cluster, method, path, headers, status, code):
    _, urls, member = cluster
    async with client_http(timeout=10) as guest:  # AUTH stands for a member's connection here
        client = member if headers is AUTH else guest
        r = await client.request(method, urls[0] + path, headers={} if headers is AUTH else headers)
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    if status != 401:
        assert error["type"] == "invalid_request_error" and path in error["message"]
    if status == 405:
        assert method not in r.headers["allow"] and r.headers["allow"] in error["message"]


async def test_elsewhere_and_on_the_other_stages_a_404_is_json_too(cluster):
    _, urls, client = cluster
    for url, path, headers in ((urls[0], "/nope", {}), (urls[1], "/v1/models", KEY), (urls[1], "/tokenize", KEY)):
        r = await client.get(url + path, headers=headers)
        assert r.status_code == 404 and r.json() == {"error": f"no such endpoint: GET {path}"}


async def test_a_model_is_retrieved_by_its_id_as_v1_models_lists_it_and_another_id_is_404(cluster):
    _, urls, client = cluster
    [listed] = (await client.get(urls[0] + "/v1/models", headers=KEY)).json()["data"]
    r = await client.get(urls[0] + "/v1/models/stub", headers=KEY)
    assert r.status_code == 200 and r.json() == listed
    r = await client.get(urls[0] + "/v1/models/gpt-4o", headers=KEY)
    error = r.json()["error"]
    assert r.status_code == 404 and (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "model", "model_not_found") and "'gpt-4o'" in error["message"]
    r = await client.get(urls[0] + "/v1/models/stub", headers=AUTH)
    assert r.status_code == 403 and r.json()["error"]["message"].startswith("the cluster token is not a client API key")


async def test_a_model_name_with_slashes_is_retrieved_by_it(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    async with client_http(timeout=10, headers=KEY) as client:
        r = await client.get(urls[0] + "/v1/models/HuggingFaceTB/SmolLM2-135M-Instruct")
        assert r.status_code == 200 and r.json()["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert (await client.get(urls[0] + "/v1/models/HuggingFaceTB")).status_code == 404
    nursery.cancel_scope.cancel()


# -- /health's status -----------------------------------------------------------------------------------------

async def test_health_is_503_until_the_chain_can_serve_then_200_and_503_again_while_a_stage_is_missing(
        nursery, tmp_path):
    orch = await nursery.start(functools.partial(local.run_orchestrator, TOKEN, swim_config=FAST_SWIM))
    compute = await nursery.start(local._shared_compute)
    def config(stage, peer):
        return stage_config(stage, 2, model="stub", seed=orch.url, peer=peer, tmp=tmp_path)
    url0 = await nursery.start(local._scoped, trio.CancelScope(), config(0, None), compute)
    async with client_http(timeout=10) as client:
        with trio.fail_after(30):
            while not (alone := await client.get(url0 + "/health")).json()["ready"]:
                await trio.sleep(0.05)
        assert alone.status_code == 503 and alone.json()["admitting"] is False  # loaded, but alone
        stage1 = trio.CancelScope()
        url1 = await nursery.start(local._scoped, stage1, config(1, url0), compute)
        with trio.fail_after(30):
            await orch.converge(2)
        whole = await client.get(url0 + "/health")
        assert whole.status_code == 200 and whole.json()["admitting"] is True
        assert set(whole.json()) == set(alone.json()) and whole.json()["ok"] is True  # the body is the same
        assert (await client.get(url1 + "/health")).status_code == 200
        stage1.cancel()  # gossip declares it dead: stage 0 admits nothing until a replacement joins
        with trio.fail_after(30):
            while (await client.get(url0 + "/health")).status_code != 503:
                await trio.sleep(0.1)
    nursery.cancel_scope.cancel()
