"""Two adjustments to hypercorn 0.18's HTTP/2: survive data for a stream it already closed, and
advertise a large receive window so a prefill activation (128 KiB for 16 tokens at dim 2048) is not
held back by HTTP/2's 64 KiB default window, which costs a WINDOW_UPDATE round trip mid-body.

Closed streams:

When the app answers before the request body is in (a 401 or 413 refuses a large body early), the
client's remaining DATA frames reach hypercorn's `self.streams[stream_id]` after the stream was
dropped: KeyError. Under trio that error leaves the connection handler and ends the whole server,
so one oversized POST would take a node down. Upstream: pgjones/hypercorn#334 (open). Until it
lands, a closed stream's leftovers go to a sink; hypercorn still acknowledges their flow control.
"""
from __future__ import annotations

import h2.settings
from hypercorn.protocol import h2 as hypercorn_h2

RECEIVE_WINDOW = 1 << 24  # per stream and per connection; bodies are bounded by PP_MAX_BODY anyway


class _ClosedStream:
    async def handle(self, event) -> None:
        pass


_SINK = _ClosedStream()


class _Streams(dict):
    def __missing__(self, stream_id):
        return _SINK


def install() -> None:
    protocol = hypercorn_h2.H2Protocol
    if getattr(protocol, "_pp_adjusted", False):
        return
    original_init, original_initiate = protocol.__init__, protocol.initiate

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.streams = _Streams(self.streams)
        settings = dict(self.connection.local_settings.items())  # what hypercorn chose, plus h2's defaults
        settings[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE] = RECEIVE_WINDOW
        self.connection.local_settings = h2.settings.Settings(client=False, initial_values=settings)

    async def initiate(self, *args, **kwargs):
        await original_initiate(self, *args, **kwargs)
        # the connection-wide window is not a setting: open it with one WINDOW_UPDATE
        self.connection.increment_flow_control_window(RECEIVE_WINDOW - 65535)
        await self._flush()

    protocol.__init__, protocol.initiate = __init__, initiate
    protocol._pp_adjusted = True
