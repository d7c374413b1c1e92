"""RFC 9113 §8.1 for hypercorn 0.18's HTTP/2: a server that answers a request before the request's body is
in ends its response and then resets the stream with NO_ERROR, so the client stops sending a body nobody
will read. hypercorn does not: it answers and then quietly takes the rest of the body into a sink, so a
client that sends its whole body before it reads the answer (httpx does) never learns the answer came.

That is how a link stream (node/transport/streams.py) lost frames silently: a receiver whose handler
ended early (a frame it could not take) answered while the sender went on writing frames nobody read. With
the reset, the sender's next write on that stream fails, once its connection has read the reset (the link
probes its peer on the same connection for that: LinkStream._probe), so it reopens the link and resends
from the last frame the receiver took. An early refusal (a 401, a 413) of any other body over HTTP/2 ends
the same way, rather than costing the rest of the body.

Installed next to node/transport/h2_guard.py, which patches the same class: this wraps the methods as they
are when it is installed, whoever patched them before.
"""
from __future__ import annotations

import h2.errors
import h2.exceptions
from h2.stream import StreamState
from hypercorn.protocol import h2 as hypercorn_h2
from hypercorn.protocol.events import StreamClosed


def body_still_open(state: StreamState | None) -> bool | None:
    """Given the h2 state of a stream whose response the app has completed: True, reset it now (the response
    is out, the client is still sending); None, not yet (the response's end is still to be sent: reset it
    once it is); False, nothing to do (the client's body is in, or the stream is gone)."""
    if state is StreamState.HALF_CLOSED_LOCAL:
        return True
    if state is StreamState.OPEN:
        return None
    return False


def install() -> None:
    protocol = hypercorn_h2.H2Protocol
    if getattr(protocol, "_pp_early_answer", False):
        return
    original_stream_send, original_send_data = protocol.stream_send, protocol._send_data

    async def stream_send(self, event) -> None:
        if isinstance(event, StreamClosed):  # the app is done with the stream: its response is complete
            # before hypercorn's handling, which tells the app the stream is gone: quart then cancels the
            # task this runs in, so nothing after it would run
            await _reset_if_body_open(self, event.stream_id)
        await original_stream_send(self, event)

    async def _send_data(self, stream_id: int) -> None:
        await original_send_data(self, stream_id)
        if stream_id in _pending(self):  # its response's end may just have gone out
            await _reset_if_body_open(self, stream_id)

    protocol.stream_send, protocol._send_data = stream_send, _send_data
    protocol._pp_early_answer = True


def _pending(protocol) -> set[int]:
    """Streams answered whose response's end was not yet sent when the app completed them."""
    pending = getattr(protocol, "_pp_answered_early", None)
    if pending is None:
        pending = protocol._pp_answered_early = set()
    return pending


async def _reset_if_body_open(protocol, stream_id: int) -> None:
    stream = protocol.connection.streams.get(stream_id)
    verdict = body_still_open(None if stream is None else stream.state_machine.state)
    pending = _pending(protocol)
    if verdict is None:
        pending.add(stream_id)
        return
    pending.discard(stream_id)
    if verdict and not protocol.closed:
        try:
            protocol.connection.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError:
            return  # the stream or the connection closed meanwhile: nothing left to stop
        await protocol._flush()
