"""Work around hypercorn 0.18's HTTP/2 crash on data for a stream it already closed.

When the app answers before the request body is in (a 401 or 413 refuses a large body early), the
client's remaining DATA frames reach hypercorn's `self.streams[stream_id]` after the stream was
dropped: KeyError. Under trio that error leaves the connection handler and ends the whole server,
so one oversized POST would take a node down. Upstream: pgjones/hypercorn#334 (open). Until it
lands, a closed stream's leftovers go to a sink; hypercorn still acknowledges their flow control.
"""
from __future__ import annotations

from hypercorn.protocol import h2


class _ClosedStream:
    async def handle(self, event) -> None:
        pass


_SINK = _ClosedStream()


class _Streams(dict):
    def __missing__(self, stream_id):
        return _SINK


def install() -> None:
    protocol = h2.H2Protocol
    if getattr(protocol, "_pp_closed_stream_guard", False):
        return
    original_init = protocol.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.streams = _Streams(self.streams)

    protocol.__init__ = __init__
    protocol._pp_closed_stream_guard = True
