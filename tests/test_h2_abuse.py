"""HTTP/2 abuse at a node's edge (issue 23): a client that opens and resets streams (rapid reset,
CVE-2023-44487) and never grants flow-control credit gets GOAWAY ENHANCE_YOUR_CALM and loses its
connection; the node, its other connections and /health go on. Driven by a raw `h2` client."""
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import httpx
import pytest
import trio

from cluster import start_cluster
from node.transport.h2_guard import RESET_FLOOR, too_many_resets


@pytest.mark.parametrize("opened, reset, calm", [
    (0, 0, False), (10_000, 0, False), (RESET_FLOOR, RESET_FLOOR, False),  # the floor: a busy peer's cancels
    (RESET_FLOOR + 1, RESET_FLOOR + 1, True), (1000, 500, False), (1000, 501, True), (100_000, 2000, False),
])
def test_a_connection_is_calmed_once_it_resets_most_of_what_it_opens_past_a_floor(opened, reset, calm):
    assert too_many_resets(opened, reset) is calm


async def rapid_reset(url: str, pairs: int, path: bytes = b"/v1/models") -> h2.events.ConnectionTerminated | None:
    """Open and reset `pairs` streams in batches, granting no flow-control credit; the GOAWAY, if one came."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.local_settings = h2.settings.Settings(client=True, initial_values={
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})  # the server can never send a response body
    conn.initiate_connection()
    headers = [(b":method", b"GET"), (b":path", path), (b":scheme", b"http"), (b":authority", b"node")]
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(conn.data_to_send())
        for _ in range(0, pairs, 200):
            for _ in range(200):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, headers, end_stream=True)
                conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            try:
                await stream.send_all(conn.data_to_send())
            except trio.BrokenResourceError:  # the server closed the connection
                break
        with trio.move_on_after(5):
            while data := await stream.receive_some():
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        return event
    return None


async def test_rapid_reset_without_flow_control_credit_is_calmed_and_the_node_goes_on(nursery, tmp_path):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    goaway = await rapid_reset(urls[0], 20_000)  # main's node died at the 1001st stream in hypercorn's tree
    assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    async with httpx.AsyncClient(http1=False, http2=True, timeout=5) as client:
        for url in urls:
            assert (await client.get(url + "/health")).status_code == 200
    assert await rapid_reset(urls[0], 20_000) is not None  # and again: nothing was left broken
    nursery.cancel_scope.cancel()
