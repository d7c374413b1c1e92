"""The round-3 audit's findings (issue 54) that live at the API's edge, one regression test each; finding 1 (a
taken entry's writes reaching a slot that shares its pages) is tests/test_kv_pages.py's property test and
tests/test_prefix_cache.py's chain through the actors; finding 4 (a forged split) is tests/test_planning.py's.

- 2: guests (no credential) filled the one cap of streams every request without the cluster token shared, and
  a keyed client got REFUSED_STREAM: keyed clients' streams have caps of their own (tests/test_stream_guard.py),
  and a guest's stream that makes no progress is reset after 5 s, not 30.
- 3: idle connections from a few addresses held the 1,024-connection cap, and members and keyed clients were
  refused: at the cap a newcomer takes the place of the oldest connection no credential has come on.
  And an API body trickled a byte at a time never tripped the 10 s idle limit and held its
  connection for as long as it lasted: after a grace, a body must average a least rate (408).
- 5: the pipeline's POST routes (cluster token) decoded up to 64 MiB on the event loop (/health stalled 2.2 s)
  and buffered any number of such bodies at once: a body is held to what a link frame of its kind may hold,
  decoded in a thread past 1 MiB, and past two such at once the next is a 503.
- 7: one key's burst of costly requests (16 threads of 128 tools) held another key's 4-token chat 3 s: the
  preparation threads' turns are shared among keys (node/api/fair_turns.py).
- 8: a response_format whose grammar passes admission (its first byte walked) and exceeds the library's limits
  as the answer grows failed at the last stage with a 500 `stage_failed`: it is a 400 naming response_format.
- 9: a completion of more prompts than the chain's slots and queue hold got 429 "retry later" on an idle
  cluster, every time: its choices are admitted together. It is a 400 that says why and how many fit.
- 10: an empty completion prompt ran the chat template: echo returned template tokens the client never sent,
  and usage said 0 prompt tokens. It is refused with a 400 naming `prompt`, as vLLM refuses it.
"""
import json
import threading
import time
import urllib.parse

import h2.config
import h2.connection
import h2.events
import h2.settings
import hypercorn.config
import pytest
import trio

from cluster import API_KEY, MEMBER_TLS, client_http, member_http, slow_stub, start_cluster
from test_conn_limits import open_idle
from node.api import openai_api, openai_read
from node.api.openai_fields import ApiError
from node.api.openai_read import prompts
from node.api.openai_tools import tool_setup
from node.transport import conn_guard, h2_flow, wire
from node.transport.conn_guard import ConnectionLimits
from node.transport.tls import CLUSTER_SNI
from node.api.openai_wire import parse_request
from worker.models import open_worker, stub_model
from worker.partition import Shard


@pytest.fixture(scope="module")
def vocabulary():
    return open_worker(stub_model(), Shard.of(0, 2)).vocabulary


@pytest.mark.parametrize("prompt, says", [("", "prompt is empty"), (["Say hello", ""], "prompt[1] is empty"),
                                          ([], "prompt: 0 prompts"), ([[1, 2], []], "prompt[1]: expected a string or "
                                                                                    "a non-empty array")],
                         ids=["an empty text", "one empty text of two", "no prompt", "one empty id list of two"])
def test_an_empty_completion_prompt_is_refused_naming_it(prompt, says):
    with pytest.raises(ApiError) as info:
        parse_request({"model": "stub", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2},
                      chat=False, seed_if_unset=0)
    assert (info.value.status, info.value.param, info.value.code) == (400, "prompt", "invalid_value")
    assert says in str(info.value)


def test_a_prompt_of_one_space_is_still_a_prompt(vocabulary):
    api = parse_request({"model": "stub", "prompt": " ", "max_tokens": 2}, chat=False, seed_if_unset=0)
    [(ids, text)] = prompts(vocabulary, api, tool_setup(None, None))
    assert ids and text == " "


# --- 9: a request that no retry could ever admit --------------------------------------------------------------

async def test_a_completion_with_more_prompts_than_slots_and_queue_together_is_a_400_not_a_429(nursery, tmp_path):
    """Its choices are admitted together or not at all: with 2 slots and 2 places in the queue, 5 prompts could
    never start, however idle the cluster. The audit got 429 "retry later" every time; it is a 400 saying why."""
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, max_seqs=2, max_queue=2)
    async with client_http(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        r = await client.post(urls[0] + "/v1/completions",
                              json={"model": "stub", "prompt": [f"Say hello {i}" for i in range(5)], "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and "at most 4" in error["message"] and "could never start" in error["message"]
        r = await client.post(urls[0] + "/v1/completions",
                              json={"model": "stub", "prompt": [f"Say hello {i}" for i in range(4)], "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
        r = await client.post(urls[0] + "/v1/chat/completions", json={
            "model": "stub", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2})
        assert r.status_code == 200, r.text  # n up to the slots, as before
    nursery.cancel_scope.cancel()


# --- 8: a schema that passes admission and fails as the answer grows ------------------------------------------

def wide_schema(properties: int = 1300) -> dict:
    """A short string first, then an object of many optional properties: admission walks the first byte, and the
    grammar library's limits bind only once the answer reaches the second property."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(properties)}}
    return {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}, "b": wide},
            "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_response_format_that_fails_at_the_last_stage_is_a_400_naming_it(nursery, tmp_path, stream):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    body = {"model": "stub", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 200,
            "stream": stream, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "wide", "schema": wide_schema()}}}
    async with client_http(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        r = await client.post(urls[0] + "/v1/chat/completions", json=body)
        if stream:
            assert r.status_code == 200
            errors = [json.loads(line[6:])["error"] for line in r.text.splitlines()
                      if line.startswith("data: {") and '"error"' in line]
            assert len(errors) == 1, r.text[-2000:]
            error = errors[0]
        else:
            assert r.status_code == 400, r.text
            error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "invalid_value", error
    assert "response_format" in error["message"]
    nursery.cancel_scope.cancel()


# --- 7: one key's costly requests and another key's cheap one --------------------------------------------------

async def test_one_key_s_burst_of_costly_requests_does_not_hold_back_another_key_s(nursery, tmp_path, monkeypatch):
    """16 requests of one key, each costing 0.3 s of preparation (the audit's 128 tools), then one of another
    key: it is prepared after a turn or two, not after the whole burst (the two threads were first come, first
    served)."""
    started, real = [], openai_api.parse_request

    def parse_request(body, **kw):
        started.append(body["messages"][0]["content"])
        if body["messages"][0]["content"].startswith("costly"):
            time.sleep(0.3)
        return real(body, **kw)
    monkeypatch.setattr(openai_api, "parse_request", parse_request)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path, api_keys=(API_KEY, "bystander-key"))

    async def chat(key: str, content: str):
        async with client_http(headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
            r = await client.post(urls[0] + "/v1/chat/completions", json={
                "model": "stub", "messages": [{"role": "user", "content": content}], "max_tokens": 1})
            assert r.status_code == 200, r.text
    async with trio.open_nursery() as burst:
        for i in range(16):
            burst.start_soon(chat, API_KEY, f"costly {i}")
        with trio.fail_after(60):
            while len(started) < 2:  # the two threads are busy: the rest of the burst queues behind them
                await trio.sleep(0.05)
        await trio.sleep(0.2)
        assert len(started) < 8
        await chat("bystander-key", "hi")
        assert started.index("hi") < len(started) and started.index("hi") <= 8, started
    nursery.cancel_scope.cancel()


# --- 5: POST bodies on the pipeline's routes (a member's connection) --------------------------------------------


async def test_a_pipeline_post_past_what_a_link_frame_holds_is_refused_as_it_arrives(nursery, tmp_path):
    """A 17 MiB body to /v1/next-token: the app's 64 MiB limit let the audit's 48 MB through to be decoded on the
    event loop; a link frame of NextTokens holds at most 16 MiB of metadata."""
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    status, _, body = await _answer_to_a_body_begun(urls[1], "/v1/next-token", 17 << 20, b'{"tokens": [' + b"0," * 4096)
    assert status == 413 and b"what a link frame of it may hold" in body, body[:300]
    nursery.cancel_scope.cancel()


async def _answer_to_a_body_begun(url: str, path: str, length: int, begun: bytes = b"") -> tuple[int, dict, bytes]:
    """A member's POST that says its length and sends the first bytes of its body, and what the node answers before
    the rest: status, headers and body. (httpx writes a whole body before it reads: over TLS, an answer that comes
    meanwhile is lost with the connection the node closes, and over HTTP/2 httpx waits for a window the node's
    reset never gives.)"""
    parts, context = urllib.parse.urlsplit(url), MEMBER_TLS.client_context()
    context.set_alpn_protocols(["http/1.1"])  # offered h2 too, the node would pick it
    stream = trio.SSLStream(await trio.open_tcp_stream(parts.hostname, parts.port), context,
                            server_hostname=CLUSTER_SNI)
    await stream.send_all(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/octet-stream"
                          f"\r\nContent-Length: {length}\r\n\r\n".encode() + begun)
    answer, headers = b"", {}
    with trio.fail_after(10):
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < int(headers["content-length"]):
            answer += await stream.receive_some()
            lines = answer.partition(b"\r\n\r\n")[0].decode().split("\r\n")
            headers = dict((k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    await trio.aclose_forcefully(stream)
    return int(lines[0].split()[1]), headers, answer.partition(b"\r\n\r\n")[2]


async def test_a_large_pipeline_body_is_decoded_off_the_event_loop(nursery, tmp_path, monkeypatch):
    """A 2 MiB JSON body (under the frame's limit) is decoded in a worker thread: the event loop, and /health with
    it, never waits on its decoding."""
    threads, real = [], wire.decode

    def decode(kind, body):
        threads.append((len(body), threading.current_thread() is threading.main_thread()))
        return real(kind, body)
    monkeypatch.setattr(wire, "decode", decode)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    body = b'{"request_id": "' + b"x" * (2 << 20) + b'", "reason": "cancelled"}'
    async with member_http(timeout=60) as client:
        r = await client.post(urls[1] + "/v1/end", content=body)
    assert r.status_code in (202, 400, 404), r.text[:300]
    assert [on_loop for n, on_loop in threads if n > (2 << 20)] == [False], threads
    nursery.cancel_scope.cancel()


async def test_past_two_large_pipeline_bodies_at_once_the_next_is_a_503_before_its_body_is_read(
        nursery, tmp_path, monkeypatch):
    """Activation bodies of 3 MiB at once: two are taken (each decoded while the others arrive), the rest are
    refused with 503 and Retry-After at once, rather than buffered (the audit held 509 MiB with 8 of 64 MiB)."""
    real, release = wire.decode_activation, trio.Event()
    decoding = []

    def decode_activation(body, hidden_dim):
        decoding.append(len(body))
        trio.from_thread.run(release.wait)
        return real(body, hidden_dim)
    monkeypatch.setattr(wire, "decode_activation", decode_activation)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    statuses = []

    async def post(client):
        r = await client.post(urls[1] + "/v1/activation", content=b"\0" * (3 << 20))
        statuses.append(r.status_code)
    async with member_http(timeout=60) as client:
        async with trio.open_nursery() as posts:
            for _ in range(2):
                posts.start_soon(post, client)
            with trio.fail_after(30):
                while len(decoding) < 2:  # two bodies taken, in and decoding
                    await trio.sleep(0.05)
            for _ in range(6):  # the next are answered on their headers (httpx would lose the answer: see the helper)
                status, headers, _ = await _answer_to_a_body_begun(urls[1], "/v1/activation", 3 << 20, b"\0" * 4096)
                assert (status, headers.get("retry-after")) == (503, "1"), (status, headers)
            assert len(decoding) == 2 and not statuses, (decoding, statuses)
            release.set()
    assert len(statuses) == 2 and 503 not in statuses, statuses
    nursery.cancel_scope.cancel()


# --- 3: a body trickled to hold a connection ----------------------------------------------------------------

async def test_a_body_trickled_slower_than_the_least_rate_is_a_408_however_steady(nursery, tmp_path, monkeypatch):
    """A byte every 0.2 s never stalls for the idle limit, so it held its connection as long as the body lasted
    (the audit: a byte every 4 s under a 10 s idle limit). After the grace it must average the least rate."""
    monkeypatch.setattr(openai_read, "BODY_GRACE_S", 1.0)
    monkeypatch.setattr(openai_read, "BODY_MIN_RATE", 64)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    parts = urllib.parse.urlsplit(urls[0])
    sock = await trio.open_tcp_stream(parts.hostname, parts.port)
    await sock.send_all((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                         f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 1000\r\n\r\n").encode())
    started, seen = trio.current_time(), b""

    async def trickle():
        for _ in range(1000):
            await sock.send_all(b" ")
            await trio.sleep(0.2)
    with trio.fail_after(15):
        async with trio.open_nursery() as sending:
            sending.start_soon(trickle)
            while b"\r\n\r\n" not in seen or not seen.rstrip().endswith(b"}"):
                seen += await sock.receive_some(65536)
            sending.cancel_scope.cancel()
    assert seen.split(b" ", 2)[1] == b"408" and b"a body comes at 64 bytes a second" in seen
    assert trio.current_time() - started < 5
    await sock.aclose()
    nursery.cancel_scope.cancel()


# --- 2: guests' streams that make no progress -----------------------------------------------------------------

async def test_a_guest_s_stalled_stream_is_reset_long_before_a_keyed_client_s(nursery, tmp_path, monkeypatch):
    """Zero-window streams: a guest's `GET /health` held its place for the 30 s every stream had; it is reset after
    GUEST_STALL_S (0.5 s here), while a keyed client's chat keeps its 30 s (SEND_STALL_S, 3 s here)."""
    monkeypatch.setattr(h2_flow, "GUEST_STALL_S", 0.5)
    monkeypatch.setattr(h2_flow, "SEND_STALL_S", 3.0)
    slow_stub(monkeypatch, 0.02)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    parts = urllib.parse.urlsplit(urls[0])
    sock = await trio.open_tcp_stream(parts.hostname, parts.port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.local_settings = h2.settings.Settings(client=True, initial_values={
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    conn.initiate_connection()
    base = [(":scheme", "http"), (":authority", parts.netloc)]
    guest = conn.get_next_available_stream_id()
    conn.send_headers(guest, [(":method", "GET"), (":path", "/health"), *base], end_stream=True)
    keyed = conn.get_next_available_stream_id()
    chat = json.dumps({"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
                       "stream": True}).encode()
    conn.send_headers(keyed, [(":method", "POST"), (":path", "/v1/chat/completions"), *base,
                              ("authorization", f"Bearer {API_KEY}"), ("content-type", "application/json"),
                              ("content-length", str(len(chat)))])
    conn.send_data(keyed, chat, end_stream=True)
    await sock.send_all(conn.data_to_send())
    reset, started = {}, trio.current_time()
    with trio.move_on_after(2.0):
        while True:
            for event in conn.receive_data(await sock.receive_some(65536)):
                if isinstance(event, h2.events.StreamReset):
                    reset[event.stream_id] = trio.current_time() - started
            await sock.send_all(conn.data_to_send())
    assert set(reset) == {guest} and reset[guest] < 1.5, reset
    await sock.aclose()
    nursery.cancel_scope.cancel()


# --- 3: the connection cap, held by connections with no credential -------------------------------------------

async def test_idle_connections_at_the_cap_give_way_to_a_member_and_a_keyed_client(nursery, tmp_path, monkeypatch):
    """The audit held the 1,024-connection cap with idle connections from a few addresses; /health from elsewhere
    got 0-3% answers, and new gossip connections were refused too. At the cap, a newcomer now takes the place of
    the oldest connection no credential has come on; the cluster's own (a member's certificate) are never the ones
    closed."""
    monkeypatch.setattr(conn_guard.install, "__defaults__", (ConnectionLimits(per_peer=60, total=60),))
    monkeypatch.setattr(hypercorn.config.Config, "keep_alive_timeout", 600)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    kept, closed = await open_idle(urls[1], 70)  # the cap, and then some: the newest displace the oldest
    assert closed >= 10 and len(kept) <= 60, (closed, len(kept))
    member, keyed = member_http(timeout=10), client_http(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    for client, who in ((member, "member"), (keyed, "client")):  # and these displace idle ones in turn
        async with client:
            r = await client.get(urls[1] + "/health")
            assert r.status_code == 200, who
    for stream in kept:
        await stream.aclose()
    nursery.cancel_scope.cancel()
