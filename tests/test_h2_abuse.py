"""HTTP/2 abuse at a node's edge (issue 23): a client that opens and resets streams (rapid reset,
CVE-2023-44487) and never grants flow-control credit gets GOAWAY ENHANCE_YOUR_CALM and loses its
connection; the node, its other connections and /health go on. Driven by a raw `h2` client, in plain HTTP at
stage 0's API and over TLS at a stage that serves only the cluster."""
import ssl

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import trio

from cluster import api, ca_context, client_http, open_raw, read_goaway, start_cluster
from node.transport.h2_guard import RESET_FLOOR, too_many_resets


@pytest.mark.parametrize("opened, reset, calm", [
    (0, 0, False), (10_000, 0, False), (RESET_FLOOR, RESET_FLOOR, False),  # the floor: a busy peer's cancels
    (RESET_FLOOR + 1, RESET_FLOOR + 1, True), (1000, 500, False), (1000, 501, True), (100_000, 2000, False),
])
def test_a_connection_is_calmed_once_it_resets_most_of_what_it_opens_past_a_floor(opened, reset, calm):
    assert too_many_resets(opened, reset) is calm



async def rapid_reset(url: str, pairs: int, tls: ssl.SSLContext | None = None,
                      path: bytes = b"/v1/models") -> h2.events.ConnectionTerminated | None:
    """Open and reset `pairs` streams in batches, granting no flow-control credit; the GOAWAY, if one came."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.local_settings = h2.settings.Settings(client=True, initial_values={
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})  # the server can never send a response body
    conn.initiate_connection()
    headers = [(b":method", b"GET"), (b":path", path), (b":scheme", b"http"), (b":authority", b"node")]
    goaway = []
    async with await open_raw(url, tls, ["h2"]) as stream, trio.open_nursery() as nursery:
        # read as we send: over TLS, once a send finds the connection closed nothing more can be read from it
        nursery.start_soon(read_goaway, stream, conn, goaway, nursery.cancel_scope)
        await stream.send_all(conn.data_to_send())
        for _ in range(0, pairs, 200):
            if goaway:  # read while the last batch went out: the connection is closed
                break
            for _ in range(200):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, headers, end_stream=True)
                conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            try:
                await stream.send_all(conn.data_to_send())
            except (trio.BrokenResourceError, trio.ClosedResourceError):  # the server closed the connection
                break
        with trio.move_on_after(5):
            await trio.sleep_forever()
        nursery.cancel_scope.cancel()
    return goaway[0] if goaway else None



@pytest.mark.parametrize("stage, tls", [(0, False), (1, True)], ids=["stage 0 in plain HTTP", "stage 1 over TLS"])
async def test_rapid_reset_without_flow_control_credit_is_calmed_and_the_node_goes_on(nursery, tmp_path, stage, tls):
    _, urls, _ = await start_cluster(nursery, 2, tmp_path)
    door, context = (urls[stage], ca_context()) if tls else (api(urls[stage]), None)  # no member's certificate
    goaway = await rapid_reset(door, 20_000, context)  # main's node died at the 1001st stream in hypercorn's tree
    assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    async with client_http(http1=False, http2=True, timeout=5) as client:
        for url in urls:
            assert (await client.get(url + "/health")).status_code == 200
    assert await rapid_reset(door, 20_000, context) is not None  # and again: nothing was left broken
    nursery.cancel_scope.cancel()
