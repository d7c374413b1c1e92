"""One adjustment to hypercorn 0.18's HTTP/1.1 under quart-trio: a connection hypercorn decides to close
is closed even when the decision is taken inside a request's ASGI task that is being cancelled.

When the app answers before the request body is in (a 401 is decided on the headers), hypercorn's h11
protocol closes the connection once the response is sent — from inside the app's last `send`. quart-trio
cancels that task as soon as the response is complete, which interrupts the close half way (at the
socket's send_eof): the connection is then neither closed nor ready for the next request, and a client
keeping it alive waits for an answer until the keep-alive timeout. The close is a few system calls, so
it runs shielded."""
from __future__ import annotations

import trio
from hypercorn.trio import tcp_server


def install() -> None:
    server = tcp_server.TCPServer
    if getattr(server, "_pp_h1_adjusted", False):
        return
    original_close = server._close

    async def _close(self) -> None:
        with trio.CancelScope(shield=True):
            await original_close(self)

    server._close = _close
    server._pp_h1_adjusted = True
