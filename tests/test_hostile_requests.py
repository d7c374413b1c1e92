"""Hostile clients with an API key (issue 23), one finding of the audit per group, each against a live
in-process cluster of the stand-in model (tests/cluster.py) where that is what it needs:

- a poison request (a seed numpy refuses, a temperature that overflows, a compute job that raises) fails
  alone, naming the stage, and the stage goes on; a request that failed is never replayed;
- a client that leaves — over HTTP/1.1 or HTTP/2, plain or TLS, before or after the first byte, streamed or
  not — has its request cancelled, and every slot and record of it freed (bench/hostile.py: how soon);
- work on the event loop is bounded: stop strings are capped and matched in linear time, a prompt longer
  than the context could hold is refused untokenized, and tokenizing runs in a thread, so /health answers
  meanwhile (bench/hostile.py: how fast);
- a malformed body is a 400 in OpenAI's shape, never an HTML 500;
- the chat page is sent with a strict Content-Security-Policy, nosniff and no framing."""
import base64
import functools
import hashlib
import json
import logging
import random
import re
import threading
import urllib.parse

import h2.config
import h2.connection
import h2.events
import httpx
import numpy as np
import pytest
import trio

from cluster import API_KEY, api, ca_context, client_http, slow_stub, start_cluster, stub_tokens
from node.api import openai_read
from node.api.openai_read import prompts as _prompts
from node.api.openai_tools import tool_setup
from node.api.openai_fields import ApiError, body_limit
from node.api.openai_wire import MAX_STOP_CHARS, parse_request
from node.api.text_stream import TextStream, _StopMatcher
from roles import make_actor
from roles.messages import EndReason, EndRequest, InferenceRequest
from worker.contract import Sampling, StepItem
from worker.errors import WorkerError
from worker.models import open_worker, stub_model
from worker.partition import Shard
from worker.sampling import sample
from worker.stage import StageWorker
from worker.stub import StubTokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "Say hello"}]}
LONG = 400  # tokens: with a slowed stand-in, seconds of work if nobody cancels it


async def health(urls):
    async with client_http() as c:
        return [(await c.get(u + "/health")).json() for u in urls]


async def until_idle(urls, within_s=10.0):
    """Every stage holds no slot, and stage 0 neither runs, queues nor follows a request: within `within_s`."""
    deadline = trio.current_time() + within_s
    while True:
        hs = await health(urls)
        left = {"slots": [h["slots_in_use"] for h in hs], "active": hs[0]["slots"]["active"],
                "waiting": hs[0]["queue"]["waiting"], "followed": hs[0].get("followed", 0)}
        if not any(left["slots"]) and not (left["active"] or left["waiting"] or left["followed"]):
            return
        assert trio.current_time() < deadline, f"still held after {within_s} s: {left}"
        await trio.sleep(0.05)


# -- one request's failure is that request's alone ------------------------------------------------------

@pytest.mark.parametrize("seed", [-1, 2 ** 64, -2 ** 70])
def test_a_seed_outside_0_to_2_64_is_refused_naming_seed(seed):
    with pytest.raises(ApiError) as info:
        parse_request({**CHAT, "seed": seed}, chat=True, seed_if_unset=0)
    assert (info.value.status, info.value.param) == (400, "seed")
    assert parse_request({**CHAT, "seed": 2 ** 64 - 1}, chat=True, seed_if_unset=0).sampling.seed == 2 ** 64 - 1


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-6])
def test_a_temperature_below_the_sampling_floor_samples_greedily(temperature):
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)  # a positive maximum: inf - inf without the floor
    assert sample(logits, Sampling(temperature=temperature), np.random.default_rng(0)) == 1


def test_a_seed_numpy_refuses_fails_its_own_request_and_the_rest_of_the_step_computes():
    worker = open_worker(stub_model(), Shard.of(1, 2), max_seqs=4)
    hidden = b"\0" * 4 * worker.info.hidden_dim
    items = [StepItem("bad", 0, hidden=hidden, seq_len=1, sampling=Sampling(1.0, 1.0, -1)),
             StepItem("good", 0, hidden=hidden, seq_len=1, sampling=Sampling(1.0, 1.0, 7))]
    bad, good = worker.run(items)
    assert isinstance(bad, WorkerError) and "seed" in str(bad)
    assert isinstance(good, np.ndarray) and worker.active == {"good"}


@pytest.mark.parametrize("stage", [0, 1])
async def test_a_compute_job_that_raises_fails_its_request_naming_the_stage_and_the_stage_goes_on(
        nursery, tmp_path, monkeypatch, caplog, stage):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, max_seqs=4)
    real_run = StageWorker.run

    def poisoned_run(self, items):
        if self.info.shard.index == stage and any(i.request_id == "poison" for i in items):
            raise RuntimeError("injected: the kernel fell over")
        return real_run(self, items)
    monkeypatch.setattr(StageWorker, "run", poisoned_run)
    with trio.fail_after(30):
        failed = await orch.submit("Say hello", request_id="poison", max_tokens=6)
        assert failed.failed_stage == stage
        assert failed.error == f"stage {stage}: compute failed: RuntimeError: injected: the kernel fell over"
        for i in range(3):  # the stage is still there, and serves everyone else
            r = await orch.submit(f"prompt {i}", max_tokens=6)
            assert r.error is None and list(r.token_ids) == stub_tokens(f"prompt {i}", 6)
        await until_idle(urls)
    [logged] = [r for r in caplog.records if r.getMessage() == "step_failed"]
    assert logged.levelno == logging.ERROR and logged.exc_info[0] is RuntimeError
    nursery.cancel_scope.cancel()


def test_a_request_that_failed_a_stage_is_not_replayed_into_its_replacement():
    n = 3
    workers = [open_worker(stub_model(), Shard.of(s, n)) for s in range(n)]
    first = make_actor(workers[0])
    first.set_chain(("m1", "m2"), standing=True)
    first.admit(InferenceRequest("r", "Say hello", max_tokens=8, reply_to="http://runner"))
    step = first.plan()
    first.finish(step, first.run(step, workers[0]))  # its prompt is on its way to stage 1
    first.set_chain(("m1-new", "m2"), standing=True)  # stage 1 replaced: the request starts its next life
    assert first.live["r"].generation == 1
    # stage 2 had computed the first life and failed it: a replay computes the same again, so it ends
    actions = first.admit(EndRequest("r", EndReason.FAILED, "stage 2: compute failed: ValueError: x", 2, 0,
                                     poison=True))
    assert "r" not in first.live and [a for a in actions if getattr(a, "response", None)]
    assert first.set_chain(("m1-new", "m2-new"), standing=True) == [] and "r" not in first.live


# -- a client that leaves is cancelled, whenever it leaves --------------------------------------------

def _body(stream: bool) -> bytes:
    return json.dumps({**CHAT, "max_tokens": LONG, "temperature": 0, "stream": stream}).encode()


async def _read_until(receive, needle: bytes) -> None:
    seen = b""
    with trio.fail_after(10):
        while needle not in seen:
            seen += await receive()


async def soon() -> None:
    await trio.sleep(random.uniform(0, 0.005))


async def connect(url: str, alpn: str) -> tuple[trio.abc.Stream, str]:
    """A raw connection as a client makes one, plain to an http:// address, TLS (no certificate) to https://; and
    the host:port it names."""
    parts, context = urllib.parse.urlsplit(url), ca_context()
    context.set_alpn_protocols([alpn])
    sock = await trio.open_tcp_stream(parts.hostname, parts.port)
    return sock if parts.scheme == "http" else trio.SSLStream(sock, context, server_hostname="node"), parts.netloc


async def h1_leave(url: str, body: bytes, *, after_first_byte: bool, wait=soon) -> None:
    """HTTP/1.1 on a raw socket: send the request, then close the socket (once `wait` returns, or at the
    first streamed event)."""
    sock, netloc = await connect(url, "http/1.1")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {netloc}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    await sock.send_all(head + body)
    if after_first_byte:
        await _read_until(lambda: sock.receive_some(65536), b"data: ")
    else:
        await wait()
    await sock.aclose()


async def h2_leave(url: str, body: bytes, *, after_first_byte: bool, reset: bool, wait=soon):
    """HTTP/2 with prior knowledge on a raw socket (the `h2` library): send the request, then reset the
    stream (the connection stays open: returned, for the caller to close later) or close the connection."""
    sock, netloc = await connect(url, "h2")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
                            (":authority", netloc), ("authorization", f"Bearer {API_KEY}"),
                            ("content-type", "application/json"), ("content-length", str(len(body)))])
    conn.send_data(sid, body, end_stream=True)
    await sock.send_all(conn.data_to_send())
    if after_first_byte:
        async def receive():
            events = conn.receive_data(await sock.receive_some(65536))
            await sock.send_all(conn.data_to_send())
            return b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
        await _read_until(receive, b"data: ")
    else:
        await wait()
    if not reset:
        await sock.aclose()
        return None
    conn.reset_stream(sid)
    await sock.send_all(conn.data_to_send())
    return sock


LEAVING = [  # (how the client leaves, streamed, after the first byte)
    ("http/1.1 close", True, False), ("http/1.1 close", True, True), ("http/1.1 close", False, False),
    ("http/2 reset", True, False), ("http/2 reset", True, True), ("http/2 close", True, False),
    ("http/2 reset", False, False), ("http/1.1 close over TLS", True, True), ("http/2 reset over TLS", True, False)]


@pytest.mark.parametrize("how,stream,after_first_byte", LEAVING,
                         ids=[f"{h}-{'stream' if s else 'whole'}-{'after first byte' if a else 'at once'}"
                              for h, s, a in LEAVING])
async def test_a_client_that_leaves_is_cancelled_and_frees_its_slots_and_the_entry_s_records(
        nursery, tmp_path, monkeypatch, how, stream, after_first_byte):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, max_seqs=4, max_queue=16)
    slow_stub(monkeypatch, 0.005)  # 400 tokens: seconds of steps if nobody cancels them
    body, kept = _body(stream), []
    door = urls[0] if "TLS" in how else api(urls[0])  # stage 0's API is served both ways

    async def admitted():  # the entry follows a request: one of these was admitted before its client left
        with trio.fail_after(10):
            while not (await health(urls[:1]))[0]["followed"]:
                await trio.sleep(0.001)

    async def leave(wait):
        if how.startswith("http/1.1"):
            await h1_leave(door, body, after_first_byte=after_first_byte, wait=wait)
        else:
            kept.append(await h2_leave(door, body, after_first_byte=after_first_byte, reset="reset" in how,
                                       wait=wait))
    clients = 2 if after_first_byte else 8  # 8: four running, four waiting for a slot
    async with trio.open_nursery() as n:
        for i in range(clients):  # half leave 0-5 ms after sending (admitted or not), half once one is admitted
            n.start_soon(leave, soon if i % 2 else admitted)
    try:
        await until_idle(urls)  # bench/hostile.py measures how soon: within a second
    finally:
        for sock in filter(None, kept):
            await sock.aclose()
    async with client_http() as c:
        metrics = (await c.get(urls[0] + "/metrics", headers=AUTH)).text
    ended = dict(re.findall(r'pp_requests_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)', metrics))
    assert float(ended.get("cancelled", 0)) >= 1, metrics  # they were admitted, then cancelled
    assert float(ended.get("finished", 0)) == 0, metrics  # none ran on to max_tokens with nobody reading
    nursery.cancel_scope.cancel()


# -- bounded work on the event loop ---------------------------------------------------------------

def test_a_stop_string_past_the_cap_is_refused_naming_stop():
    parse_request({**CHAT, "stop": ["x" * MAX_STOP_CHARS] * 4}, chat=True, seed_if_unset=0)
    with pytest.raises(ApiError) as info:
        parse_request({**CHAT, "stop": ["a", "x" * (MAX_STOP_CHARS + 1)]}, chat=True, seed_if_unset=0)
    assert (info.value.status, info.value.param) == (400, "stop")


def test_four_stops_at_the_cap_read_each_streamed_character_once(monkeypatch):
    """The old matcher rescanned every held-back prefix of every stop on each token (4 x 150k characters: 7.8 s
    for 4 tokens); bench/hostile.py times both."""
    fed = []
    real_feed = _StopMatcher.feed
    monkeypatch.setattr(_StopMatcher, "feed", lambda self, char: fed.append(char) or real_feed(self, char))
    stops = tuple("a" * (MAX_STOP_CHARS - 1) + end for end in "bcde")  # each always almost there
    text = TextStream(stops)
    out = [text.push(b"a") for _ in range(5000)]
    assert "".join(out) == "a" * (5000 - (MAX_STOP_CHARS - 1)) and not text.stopped
    assert len(fed) == 5000 * len(stops)


def test_the_streaming_matcher_finds_what_a_search_of_the_whole_text_finds():
    rng = random.Random(23)
    for _ in range(400):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4)))
        whole = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(whole) + 1), min(3, len(whole) + 1)))
        pieces = [whole[i:j] for i, j in zip([0, *cuts], [*cuts, len(whole)])]
        stream = TextStream(stops)
        out = "".join(stream.push(p.encode()) for p in pieces) + stream.flush()
        ends = {s: whole.find(s) + len(s) for s in stops if s in whole}
        first_end = min(ends.values(), default=None)  # generation stops as soon as any stop is complete
        want = whole if first_end is None else whole[:first_end - max(len(s) for s in ends if ends[s] == first_end)]
        assert (out, stream.stopped) == (want, first_end is not None), (stops, pieces)


class _Untokenizable:
    """A vocabulary that must not be asked to tokenize."""
    max_context, vocab_size, longest_token_bytes = 512, 32, 1

    def tokenize(self, *a, **kw):
        raise AssertionError("tokenized a prompt the context cannot hold")
    tokenize_messages = tokenize


@pytest.mark.parametrize("body,chat", [({**CHAT, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}, True),
                                       ({"model": "stub", "prompt": "x" * 513}, False),
                                       ({"model": "stub", "prompt": list(range(5)) * 200_000}, False)])
def test_a_prompt_longer_than_the_context_could_hold_is_refused_before_tokenizing(body, chat):
    api = parse_request(body, chat=chat, seed_if_unset=0)
    with pytest.raises(ApiError) as info:
        _prompts(_Untokenizable(), api, tool_setup(None, None))
    assert (info.value.status, info.value.code) == (400, "context_length_exceeded")


async def test_health_is_answered_while_a_prompt_is_tokenized(nursery, tmp_path, monkeypatch):
    """Tokenizing ran on the event loop: a 2 MiB message stalled /health 1.9 s. The stand-in's chat template is
    held here until /health has answered meanwhile, which it can only do if tokenizing runs in a thread
    (bench/hostile.py measures /health's latency under long prompts and stop lists)."""
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, max_seqs=4)
    real, tokenizing, answered, waited = StubTokenizer.encode_messages, threading.Event(), threading.Event(), []

    def held_template(self, messages, **kw):
        tokenizing.set()
        waited.append(answered.wait(timeout=10))  # False: /health could not answer while this ran
        return real(self, messages, **kw)
    monkeypatch.setattr(StubTokenizer, "encode_messages", held_template)
    async with client_http(timeout=30) as client, client_http(timeout=30, headers=AUTH) as user:
        async with trio.open_nursery() as n:
            n.start_soon(functools.partial(user.post, urls[0] + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}))
            await trio.to_thread.run_sync(tokenizing.wait, 20)
            assert (await client.get(urls[0] + "/health")).status_code == 200
            answered.set()
    assert waited == [True]
    nursery.cancel_scope.cancel()


# -- malformed bodies -------------------------------------------------------------------------------

MALFORMED = {
    "invalid UTF-8": b'{"model": "stub", "prompt": "\xff\xfe"}',
    "nested 100,000 deep": b'{"model": "stub", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "bad JSON": b'{"model": "stub", "prompt": }',
    "cut short": b'{"model": "stub", "prompt": "Say',
    "empty": b"",
    "an integer of 5000 digits": b'{"model": "stub", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    "a lone surrogate": b'{"model": "stub", "prompt": "a\\ud800b"}',
    "not an object": b'["model", "stub"]',
}


async def test_every_malformed_body_on_the_api_paths_is_an_openai_shaped_400(nursery, tmp_path):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    answers = {}
    async with httpx.AsyncClient(timeout=30, headers={**AUTH, "Content-Type": "application/json"}) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for name, body in MALFORMED.items():
                r = await client.post(api(urls[0]) + path, content=body)
                shaped = r.headers.get("content-type", "").startswith("application/json") and \
                    set(r.json().get("error", {})) == {"message", "type", "param", "code"}
                answers[path, name] = (r.status_code, shaped)
        assert (await client.post(api(urls[0]) + "/v1/completions",
                                  json={"model": "stub", "prompt": "hi", "max_tokens": 2})).status_code == 200
    assert answers == {key: (400, True) for key in answers}
    nursery.cancel_scope.cancel()


async def test_a_body_past_what_the_context_could_need_is_an_openai_shaped_413(nursery, tmp_path):
    """The API's bodies were allowed the 64 MiB an activation may need. Now the limit is what the context could
    hold (openai_fields.body_limit), said by Content-Length or found while reading a chunked body; a body just
    under it is read and refused for its length in tokens instead."""
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    probe = open_worker(stub_model(), Shard.of(0, 2))  # stage 0's vocabulary and context, as the cluster's
    limit = body_limit(probe.info.max_context, probe.vocabulary.longest_token_bytes)
    async with httpx.AsyncClient(timeout=30, headers=AUTH) as client:
        over = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * limit}]}).encode()

        async def chunked():
            for i in range(0, len(over), 65536):
                yield over[i:i + 65536]
        answers = [await client.post(api(urls[0]) + "/v1/chat/completions", content=over,
                                     headers={"Content-Type": "application/json"}),
                   await client.post(api(urls[0]) + "/v1/chat/completions", content=chunked(),
                                     headers={"Content-Type": "application/json"})]
        under = await client.post(api(urls[0]) + "/v1/chat/completions",
                                  json={**CHAT, "messages": [{"role": "user", "content": "x" * (limit // 2)}]})
    assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(413, "request_too_large")] * 2
    assert (under.status_code, under.json()["error"]["code"]) == (400, "context_length_exceeded")
    nursery.cancel_scope.cancel()


async def test_a_body_that_stalls_is_a_408_and_the_stage_serves_on(nursery, tmp_path, monkeypatch):
    """A client that sends its headers and then nothing held a request for quart's 120 s; now BODY_IDLE_S
    (shortened here) ends it, before the first byte of the body or between two."""
    monkeypatch.setattr(openai_read, "BODY_IDLE_S", 0.5)
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    parts = urllib.parse.urlsplit(api(urls[0]))
    answers = []
    for sent in (b"", b'{"model": "stub", '):
        sock = await trio.open_tcp_stream(parts.hostname, parts.port)
        await sock.send_all((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                             f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: 1000\r\n\r\n").encode() + sent)
        seen = b""
        with trio.fail_after(20):
            while b"\r\n\r\n" not in seen or not seen.rstrip().endswith(b"}"):
                seen += await sock.receive_some(65536)
        answers.append((seen.split(b" ", 2)[1], json.loads(seen.split(b"\r\n\r\n", 1)[1])["error"]["code"]))
        await sock.aclose()
    assert answers == [(b"408", "timeout")] * 2
    await until_idle(urls)
    nursery.cancel_scope.cancel()


# -- the chat page's headers ------------------------------------------------------------------------

async def test_the_chat_page_is_sent_with_a_strict_csp_nosniff_and_no_framing(nursery, tmp_path):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    async with httpx.AsyncClient() as client:
        r = await client.get(api(urls[0]) + "/")
    policy = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
    inline = {kind: [f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                     for k, b in re.findall(r"<(script|style)>(.*?)</\1>", r.text, re.DOTALL) if k == kind]
              for kind in ("script", "style")}
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'" and policy["base-uri"] == "'none'"
    assert policy["script-src"].split() == inline["script"] and policy["style-src"].split() == inline["style"]
    assert "unsafe" not in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
    nursery.cancel_scope.cancel()
