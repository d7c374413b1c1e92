"""What only a stage serves: its hop figures, and link streams (node/transport/streams.py), whose frames are read
as they arrive for as long as the sender keeps writing."""
from __future__ import annotations

import logging
from typing import Protocol

from quart import jsonify, request
from quart_trio import QuartTrio

from roles.actions import Refused

from node.observe.hops import HopStats
from node.observe.log import error_event
from node.transport import frames, wire
from node.transport.routes import Traffic, still_loading
from node.transport.streams import LinkReceiver

log = logging.getLogger("pp.http")


class LinkDispatcher(Protocol):
    """What the link routes hand frames to: a stage node."""

    loading: bool  # True until frames can be admitted: still_loading()
    hidden_dim: int | None  # the activations' width, once not loading
    links_in: LinkReceiver  # the links read here: their last frames delivered, and the cap on open ones
    hops: HopStats  # where each hop's time goes

    def take_frame(self, link_id: str, source: str, seq: int, sent_at: float, message) -> None: ...


def add_link_routes(app: QuartTrio, stage: LinkDispatcher) -> None:
    @app.get("/v1/hops")
    async def hop_figures():
        """Where each hop's time goes (node/observe/hops.py): median and p99 per part, per link."""
        return jsonify(stage.hops.summary())

    @app.post("/v1/hops/reset")
    async def hop_figures_reset():
        stage.hops.reset()
        return jsonify({"reset": True})

    @app.get("/v1/link/<link_id>")
    async def link_state(link_id: str):
        _check_open(stage)  # the open that follows would be refused
        return jsonify({"last_seq": stage.links_in.last_seq(link_id), "boot": stage.links_in.boot})

    @app.post("/v1/link")
    async def link():
        link_id, source = request.args.get("link", ""), request.args.get("from", "")
        if not (0 < len(link_id) <= 64 and 0 < len(source) <= 64):
            raise wire.WireError("link, from: both required, each 1..64 characters")
        _check_open(stage)
        stage.links_in.streams += 1
        try:
            taken = await _read_link(stage, link_id, source)
        finally:
            stage.links_in.streams -= 1
        return jsonify({"frames": taken}), 200


def _check_open(stage: LinkDispatcher) -> None:
    """Raise Refused unless a link may open now."""
    if stage.loading:
        raise still_loading()
    if (full := stage.links_in.open_refusal()) is not None:
        raise Refused(503, full, retry_after_s=1)


async def _read_link(stage: LinkDispatcher, link_id: str, source: str) -> int:
    """Deliver a link stream's frames as they arrive; the number taken. Whatever ends this early (the answer
    then comes while the sender still writes) resets the stream (node/transport/h2_early_answer.py), so the
    sender reopens it and resends from the last frame delivered here."""
    reader, taken, counted = frames.FrameReader(stage.hidden_dim), 0, Traffic.of().body_bytes
    try:
        async for chunk in request.body:
            counted[request.path] += len(chunk)
            reader.feed(chunk)
            for seq, sent_at, message in reader.frames():
                stage.take_frame(link_id, source, seq, sent_at, message)
                taken += 1
    except wire.WireError as exc:
        # The frame was not delivered. The link's last delivered frame stays as it was, so the sender resends
        # from the refused one, and drops it alone once it is refused again (streams.LinkStream._drop_refused);
        # forgetting the link would have it resend frames delivered already, delivered twice.
        error_event(log, "link_frame_refused", link=link_id, source=source, error=str(exc),
                    last_seq=stage.links_in.last_seq(link_id))
        raise
    except Exception as exc:
        # Frames up to the last delivered count as taken: the sender resends only those after it.
        error_event(log, "link_stream_failed", link=link_id, source=source,
                    error=f"{type(exc).__name__}: {exc}", last_seq=stage.links_in.last_seq(link_id))
        raise
    return taken
