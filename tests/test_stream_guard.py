"""Requests in flight over HTTP/2 from non-members (issue 33's second audit): a burst of streams from one address
(200 connections × 100 `GET /health` got stage 0 declared dead) is refused past a cap per address and in all,
with REFUSED_STREAM and before any app task; members (a connection that showed the cluster's certificate) are never counted; whatever a
connection held is given back however it ends."""
import h2.config
import h2.connection
import h2.errors
import h2.events
import hpack
import trio
from quart_trio import QuartTrio

from node.transport import h2_guard, stream_guard
from node.transport.app import serve_app
from node.transport.conn_guard import ConnectionLimits
from node.transport.stream_guard import GuestStreams, stream_refusal

LIMITS = ConnectionLimits(per_peer=3, total=5)


def test_a_guest_stream_is_refused_past_the_per_address_or_the_total_limit_saying_which():
    assert stream_refusal(LIMITS, 2, 4) is None
    assert "3 requests in flight without the cluster token from this address" in stream_refusal(LIMITS, 3, 3)
    assert "5 requests in flight without the cluster token, the most this node takes" in stream_refusal(LIMITS, 0, 5)


def test_guest_streams_are_counted_by_address_and_given_back_by_stream_or_by_connection():
    guests = GuestStreams(lambda header: False, LIMITS)
    a1, a2, b1 = ("a", 1), ("a", 2), ("b", 1)
    assert [guests.take(a1, 1), guests.take(a1, 3), guests.take(a2, 1)] == [None] * 3
    assert "from this address" in guests.take(a2, 3)
    assert guests.take(b1, 1) is None and guests.take(b1, 3) is None
    assert "the most this node takes" in guests.take(b1, 5)
    guests.release(a1, 3)
    guests.release(a1, 3)  # twice: nothing more is given back
    guests.release(a1, 99)  # never taken
    assert dict(guests.by_peer) == {"a": 2, "b": 2}
    guests.release_connection(a2)
    guests.release_connection(b1)
    guests.release_connection(b1)
    assert dict(guests.by_peer) == {"a": 1} and guests.refused == 2


def _app() -> QuartTrio:
    app = QuartTrio("guarded")
    app.release = trio.Event()
    app.pp_members = {}  # connections that showed a member's certificate (node/transport/tls_accept.py)

    @app.get("/wait")
    async def wait():
        await app.release.wait()
        return "done"

    @app.get("/ok")
    async def ok():
        return "ok"
    return app


def _headers(path: bytes) -> list:
    return [(b":method", b"GET"), (b":path", path), (b":scheme", b"http"), (b":authority", b"node")]


async def _member_answered(port: int, app) -> bool:
    """A request on a connection the registry holds as a member's (as tls_accept registers one that showed the
    cluster's certificate) is answered, whatever the guests hold from the same address."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        app.pp_members[stream.socket.getsockname()[:2]] = "stage1"
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, _headers(b"/ok"), end_stream=True)
        await stream.send_all(conn.data_to_send())
        return _answered(await _read(stream, conn, lambda ev: _answered(ev, {sid})), {sid}) == {sid}


async def _read(stream, conn, until) -> list:
    """The h2 events read until `until(events so far)` is true (or 5 s pass, or the connection ends)."""
    events = []
    with trio.move_on_after(5):
        while not until(events) and (data := await stream.receive_some()):
            events += conn.receive_data(data)
            await stream.send_all(conn.data_to_send())
    return events


def _refused(events) -> int:
    return sum(isinstance(e, h2.events.StreamReset) and e.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
               for e in events)


def _answered(events, path_ids) -> set:
    return {e.stream_id for e in events if isinstance(e, h2.events.StreamEnded) and e.stream_id in path_ids}


async def test_guest_streams_past_the_cap_are_refused_a_member_s_are_not_and_the_count_comes_back(
        nursery, monkeypatch):
    monkeypatch.setattr(stream_guard, "GUEST_LIMITS", LIMITS)
    h2_guard.install()
    stream_guard.install()
    app = _app()
    port = await nursery.start(serve_app, app, "127.0.0.1", 0)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        guests = [conn.get_next_available_stream_id() for _ in range(1)]
        conn.send_headers(guests[0], _headers(b"/wait"), end_stream=True)
        for _ in range(9):
            sid = conn.get_next_available_stream_id()
            guests.append(sid)
            conn.send_headers(sid, _headers(b"/wait"), end_stream=True)
        await stream.send_all(conn.data_to_send())
        events = await _read(stream, conn, lambda ev: _refused(ev) >= 7)
        assert _refused(events) == 7  # 3 taken, the rest refused before any app task
        assert await _member_answered(port, app)  # a member's request is never counted
        assert sum(app.pp_streams.by_peer.values()) == 3
        app.release.set()
        events = await _read(stream, conn, lambda ev: len(_answered(ev, set(guests))) >= 3)
        assert len(_answered(events, set(guests))) == 3
        assert sum(app.pp_streams.by_peer.values()) == 0
        again = [conn.get_next_available_stream_id() for _ in range(1)]
        conn.send_headers(again[0], _headers(b"/ok"), end_stream=True)
        await stream.send_all(conn.data_to_send())
        events = await _read(stream, conn, lambda ev: _answered(ev, set(again)))
        assert _answered(events, set(again)) == set(again) and not _refused(events)
    nursery.cancel_scope.cancel()


async def test_a_connection_that_ends_on_an_exception_gives_back_the_streams_it_held(nursery, monkeypatch):
    monkeypatch.setattr(stream_guard, "GUEST_LIMITS", LIMITS)
    h2_guard.install()
    stream_guard.install()
    app = _app()
    port = await nursery.start(serve_app, app, "127.0.0.1", 0)
    for _ in range(3):  # each time the address's whole share, the last a header block hypercorn raises on
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        conn.initiate_connection()
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            for _ in range(2):
                conn.send_headers(conn.get_next_available_stream_id(), _headers(b"/wait"), end_stream=True)
            block = hpack.Encoder().encode([(b":method", b"CONNECT"), (b":authority", b"x")])  # no :path
            raw = len(block).to_bytes(3, "big") + bytes([1, 5]) + (99).to_bytes(4, "big") + block
            await stream.send_all(conn.data_to_send() + raw)
            with trio.move_on_after(5):
                while await stream.receive_some():
                    pass
        with trio.fail_after(5):
            while app.pp_streams.by_peer:
                await trio.sleep(0.01)
    assert app.pp_streams.refused == 0
    nursery.cancel_scope.cancel()


def test_guests_holding_all_theirs_refuse_no_keyed_client_whose_streams_have_caps_of_their_own():
    """Round 3's finding 2: four addresses' zero-window `GET /health` streams filled the one cap every request
    without the cluster token shared, and a client with the API key got REFUSED_STREAM on 9 of 9 requests."""
    key = b"Bearer client-key"
    streams = GuestStreams(lambda connection: connection == ("m", 1), LIMITS, is_client=lambda header: header == key,
                           client_limits=ConnectionLimits(per_peer=2, total=10))
    for peer in "abcd":
        for sid in range(1, 10, 2):
            streams.take((peer, 1), sid)
    assert sum(streams.guests.by_peer.values()) == 5  # the guests' cap, whoever asks
    keyed = streams.kind(key)
    assert (keyed, streams.kind(b"", ("m", 1)), streams.kind(key, ("m", 1)), streams.kind(b"Bearer other")) == \
        ("client", "member", "member", "guest")
    assert streams.take(("e", 1), 1, keyed) is None and streams.take(("e", 1), 3, keyed) is None
    assert "with a client API key from this address" in streams.take(("e", 1), 5, keyed)
    assert "without a credential" in streams.take(("f", 1), 1)
    streams.release(("e", 1), 1)
    assert dict(streams.clients.by_peer) == {"e": 1}
    streams.release_connection(("e", 1))
    assert not streams.clients.by_peer and sum(streams.guests.by_peer.values()) == 5
