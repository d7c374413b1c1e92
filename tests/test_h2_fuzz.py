"""No packet ends a node (issue 33): a seeded fuzzer sends hostile HTTP/2 frame sequences and HTTP/1.1 requests
(tests/h2_fuzz.py) to a live 2-stage cluster of the stand-in model, by every way in (stage 0's API in plain HTTP,
and over TLS each stage as a member and as a stranger); after every batch each node answers /health, and at the
end every node answers and the cluster serves a real request end to end. Before the fix, any
exception escaping one connection's handling ended the whole server; the audit's named vectors are pinned
below one by one, each ending only its own connection."""
import ssl

import pytest
import trio

from cluster import API_KEY, MEMBER_TLS, api, ca_context, client_http, open_raw, start_cluster, stub_tokens
from h2_fuzz import END_HEADERS, END_STREAM, HEADERS, PREFACE, PRIORITY, SETTINGS, Fuzz, frame, header_block, request_headers

BATCH = 25  # connections at once


def doors(urls: list[str]) -> list[tuple[str, dict[str, ssl.SSLContext | None]]]:
    """The ways into the cluster a case takes, in turn, each with its TLS context by the case's kind ("h2" or "h1",
    whose protocol ALPN asks for; none for plain HTTP): stage 0's API in plain HTTP, stage 0 and stage 1 over TLS
    as a member (every route is open to it), stage 1 over TLS as a stranger (no certificate)."""
    def by_kind(make) -> dict[str, ssl.SSLContext]:
        contexts = {"h2": make(), "h1": make()}
        contexts["h2"].set_alpn_protocols(["h2"])
        contexts["h1"].set_alpn_protocols(["http/1.1"])
        return contexts
    member = by_kind(MEMBER_TLS.client_context)
    return [(api(urls[0]), {"h2": None, "h1": None}), (urls[0], member), (urls[1], member),
            (urls[1], by_kind(ca_context))]



async def exchange(url: str, data: bytes, tls: ssl.SSLContext | None = None, *, linger_s: float = 0.05) -> bytes:
    """Send `data` on a fresh connection, read what comes back for `linger_s` (or until the node closes it)."""
    got = b""
    try:
        async with await open_raw(url, tls) as stream:
            await stream.send_all(data)
            with trio.move_on_after(linger_s):
                while chunk := await stream.receive_some(65536):
                    got += chunk
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # refused or reset mid-send: the node's choice
    return got


async def closed_by_node(url: str, data: bytes, tls: ssl.SSLContext | None = None, within_s: float = 10.0) -> bool:
    """Send `data` and wait for the node to close the connection (EOF or reset)."""
    async with await open_raw(url, tls) as stream:
        await stream.send_all(data)
        with trio.move_on_after(within_s):
            try:
                while await stream.receive_some(65536):
                    pass
            except trio.BrokenResourceError:
                pass
            return True
    return False


async def answers(url: str) -> None:
    async with client_http(timeout=10) as c:
        assert (await c.get(url + "/health")).status_code == 200


async def fuzz(urls: list[str], seed: int, cases: int) -> None:
    gen, ways = Fuzz(seed), doors(urls)
    for start in range(0, cases, BATCH):
        async with trio.open_nursery() as n:
            for i in range(start, min(start + BATCH, cases)):
                kind, data = gen.case()
                url, tls = ways[i % len(ways)]
                n.start_soon(exchange, url, data, tls[kind])
        for url in urls:  # each still alive after this batch
            await answers(url)


async def served_end_to_end(orch, urls: list[str]) -> None:
    for url in urls:
        await answers(url)
    with trio.fail_after(30):
        r = await orch.submit("after the fuzz", max_tokens=6)
    assert r.error is None and list(r.token_ids) == stub_tokens("after the fuzz", 6)
    async with client_http(http1=False, http2=True, timeout=30) as c:
        r = await c.post(urls[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text


def test_the_fuzzer_is_deterministic_per_seed():
    assert [Fuzz(7).case() for _ in range(50)] == [Fuzz(7).case() for _ in range(50)]
    assert [Fuzz(7).case() for _ in range(5)] != [Fuzz(8).case() for _ in range(5)]


async def test_hostile_frames_and_requests_from_a_seeded_fuzzer_never_end_a_node(nursery, tmp_path):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    await fuzz(urls, seed=33, cases=300)
    await served_end_to_end(orch, urls)
    nursery.cancel_scope.cancel()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
async def test_a_longer_fuzz_of_several_seeds_never_ends_a_node(nursery, tmp_path, seed):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    await fuzz(urls, seed=seed, cases=3000)
    await served_end_to_end(orch, urls)
    nursery.cancel_scope.cancel()


# -- the audit's named vectors, each ending its own connection only -----------------------------------------

def h2_request(headers: list[tuple[bytes, bytes]], *, sid: int = 1) -> bytes:
    return PREFACE + frame(SETTINGS, 0, 0, b"") + frame(HEADERS, END_HEADERS | END_STREAM, sid, header_block(headers))


VECTORS = {
    "CONNECT without :path": h2_request([(b":method", b"CONNECT"), (b":authority", b"node:80")]),
    "non-ASCII :path": h2_request(request_headers(b"GET", b"/\xff\xfe\xc3(")),
    "non-ASCII :method": h2_request(request_headers(b"G\xffT", b"/health")),
    "PRIORITY for 2000 never-opened streams": PREFACE + frame(SETTINGS, 0, 0, b"") + b"".join(
        frame(PRIORITY, 0, sid, b"\0\0\0\0\x10") for sid in range(1, 4001, 2)),
    "Upgrade: h2c with a malformed HTTP2-Settings": b"GET /health HTTP/1.1\r\nHost: node\r\n"
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: !!!notbase64\r\n\r\n",
}


@pytest.mark.parametrize("vector", list(VECTORS))
async def test_each_vector_the_audit_named_ends_its_own_connection_only(nursery, tmp_path, vector):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path)
    kind = "h2" if VECTORS[vector].startswith(PREFACE) else "h1"
    async with client_http(http1=False, http2=True, timeout=10) as bystander:  # a connection open throughout
        for url, tls in doors(urls):
            assert (await bystander.get(url + "/health")).status_code == 200
            assert await closed_by_node(url, VECTORS[vector], tls[kind]), url
            assert (await bystander.get(url + "/health")).status_code == 200
    await served_end_to_end(orch, urls)
    nursery.cancel_scope.cancel()
