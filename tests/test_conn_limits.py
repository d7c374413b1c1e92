"""Connection limits at a node's socket edge (issue 23): past so many connections from one address, or in
all, a new connection is closed at once; the node serves again as soon as they close."""
import httpx
import hypercorn.config
import pytest
import trio

from cluster import client_http, start_cluster
from node.transport import conn_guard
from node.transport.conn_guard import ConnectionLimits, refusal

LIMITS = ConnectionLimits(per_peer=3, total=5)


@pytest.mark.parametrize("from_peer, in_all, refused", [
    (0, 0, None), (2, 4, None), (3, 3, "from this address"), (0, 5, "the most this node takes"),
    (3, 5, "the most this node takes"),  # the total is said first
])
def test_a_connection_is_refused_past_the_per_address_or_the_total_limit(from_peer, in_all, refused):
    why = refusal(LIMITS, from_peer, in_all)
    assert why is None if refused is None else refused in why


def test_admission_counts_by_address_and_gives_back_what_closes():
    admission = conn_guard.Admission(LIMITS)

    def take(peer):  # a connection with no key (a TLS stream's): counted by its peer, never displaced
        return admission.admit(peer, None, None)[0]
    assert [take("a") for _ in range(3)] == [None] * 3
    assert "from this address" in take("a")
    assert take("b") is None and take("b") is None
    assert "the most this node takes" in take("c")
    admission.close(None, "a")
    assert take("c") is None and admission.refused == 2
    assert dict(admission.by_peer) == {"a": 2, "b": 2, "c": 1}


def test_at_a_limit_a_newcomer_displaces_the_oldest_connection_no_credential_has_come_on():
    """Round 3's finding 3: idle connections held the cap against members and keyed clients."""
    admission = conn_guard.Admission(LIMITS)
    for port, peer in enumerate("aabbc"):
        assert admission.admit(peer, (peer, port), f"stream {port}") == (None, None)
    admission.trust(("a", 0))
    admission.trust(("b", 2))
    assert admission.admit("d", ("d", 9), "new") == (None, "stream 1")  # the total binds: the oldest untrusted
    assert admission.admit("a", ("a", 8), "new") == (None, "stream 3")  # b's: a still holds 1 of its 3 here
    admission.trust(("a", 8))
    assert admission.admit("a", ("a", 7), "new") == (None, "stream 4")
    admission.trust(("a", 7))
    admission.trust(("d", 9))
    why, closing = admission.admit("e", ("e", 6), "new")  # every connection trusted: refused
    assert "the most this node takes" in why and closing is None
    assert (admission.evicted, admission.refused) == (3, 1) and sum(admission.by_peer.values()) == 5
    admission.close(("a", 0))
    admission.close(("a", 0))  # once
    assert dict(admission.by_peer) == {"a": 2, "b": 1, "d": 1}


async def open_idle(url: str, n: int) -> tuple[list[trio.SocketStream], int]:
    """Open `n` connections that send nothing; the ones the node kept, and how many it closed at once."""
    host, port = url.split("://", 1)[-1].rsplit(":", 1)
    streams = [await trio.open_tcp_stream(host, int(port)) for _ in range(n)]
    closed = []

    async def watch(stream):
        with trio.move_on_after(1):
            if await stream.receive_some() == b"":
                closed.append(stream)
    async with trio.open_nursery() as watchers:
        for stream in streams:
            watchers.start_soon(watch, stream)
    for stream in closed:
        await stream.aclose()
    return [s for s in streams if s not in closed], len(closed)


async def test_a_flood_of_idle_connections_is_cut_at_the_limit_and_the_node_serves_as_soon_as_they_close(
        nursery, tmp_path, monkeypatch):
    limits = ConnectionLimits(per_peer=40, total=50)  # room for the cluster's own connections on 127.0.0.1
    monkeypatch.setattr(conn_guard.install, "__defaults__", (limits,))  # what serve_app installs
    # hypercorn kept a connection its peer had closed until its keep-alive timer ran out, counted all along
    monkeypatch.setattr(hypercorn.config.Config, "keep_alive_timeout", 600)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    kept, closed = await open_idle(urls[1], 60)
    assert closed >= 20 and len(kept) <= 40  # the cluster's own connections count too
    for stream in kept:
        await stream.aclose()
    with trio.fail_after(10):
        while not await health_ok(urls[1]):
            await trio.sleep(0.25)
    assert await health_ok(urls[0])
    nursery.cancel_scope.cancel()


async def health_ok(url: str) -> bool:
    async with client_http(http1=False, http2=True, timeout=5) as client:  # every stage speaks TLS
        try:
            return (await client.get(url + "/health")).status_code == 200
        except httpx.TransportError:  # refused at the limit: closed before a byte was read
            return False


async def test_a_connection_that_sends_nothing_is_closed_at_the_keep_alive_timeout(nursery, tmp_path, monkeypatch):
    """Until its first byte a connection is parked before hypercorn sets it up (conn_guard._first_byte), and
    still closed when hypercorn would have closed it, idle, unlike one that sent its request."""
    monkeypatch.setattr(hypercorn.config.Config, "keep_alive_timeout", 0.5)
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    host, port = urls[0].split("://", 1)[-1].rsplit(":", 1)
    async with await trio.open_tcp_stream(host, int(port)) as silent:
        with trio.fail_after(10):
            assert await silent.receive_some() == b""
    assert await health_ok(urls[0])
    nursery.cancel_scope.cancel()
