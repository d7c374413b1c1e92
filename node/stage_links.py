"""A stage's ends of its link streams: it opens the stream to the next stage (the last stage's goes to stage
0), and takes the frames that arrive on the streams of the stage before, each once. Which part of a message
is still worth resending and what a refused frame ends are the roles' to say (roles/liveness.py)."""
from __future__ import annotations

import logging
from typing import Callable

from roles.actions import UNKNOWN_REQUEST, Refused
from roles.liveness import refused_frame_ends, still_live

from node.observe.log import as_extra, error_event
from node.transport.streams import LinkReceiver, LinkStream

log = logging.getLogger("pp.node")


class LinkEnds:
    """`node` is the StageNode these links belong to: its deliver, actor, links, side and peers."""

    def __init__(self, node, *, enabled: bool):
        self.node, self.enabled = node, enabled
        self.receiver = LinkReceiver()

    def open_stream(self, dest: str) -> LinkStream | None:
        """The next stage (the last stage: stage 0) gets a link stream; askers get POSTs."""
        node = self.node
        if not (self.enabled and dest.startswith("pp-stage-")):
            return None
        return LinkStream(dest, source=node.name, resolve=node.peers.addr_of, client=node.client.http,
                          stats=node.hops, on_lost=lambda messages, error: node.links.lost(dest, messages, error),
                          still_live=lambda message: still_live(message, node.actor.is_live), faults=node.faults,
                          moved=node.peers.moved,
                          on_refused=lambda message, error: self.refused(node.name, message, error))

    def take_frame(self, link_id: str, source: str, seq: int, sent_at: float, message) -> None:
        """A frame of a link stream: delivered once (a resent one is skipped). A refusal cannot be answered
        on the stream, so this stage reports the failure of the frame's requests to stage 0 itself. So it
        does when taking the message raises anything else: a fault here is the frame's requests' alone (the
        actors fail one request of a message on their own where they can), and the link goes on; the frame
        counts as delivered, so it is never resent."""
        if not self.receiver.fresh(link_id, seq):
            return
        self.receiver.delivered(link_id, seq)
        try:
            self.node.deliver(message, source=source, sent_at=sent_at)
        except Refused as exc:
            self.refused(source, message, f"refused {type(message).__name__} from {source}: {exc.message}",
                         unknown=exc.status == UNKNOWN_REQUEST)
        except Exception as exc:  # noqa: BLE001 - whatever it is: its requests fail, the link and the rest go on
            log.error("link_message_failed", exc_info=exc, extra=as_extra(source=source, seq=seq))
            self.refused(source, message, f"could not take {type(message).__name__} from {source}: "
                                          f"{type(exc).__name__}: {exc}")

    def refused(self, source: str, message, error: str, *, unknown: bool = False) -> None:
        """A frame no stage will take: its requests end at stage 0 (are replayed, where they were `unknown`)."""
        error_event(log, "link_message_refused", source=source, kind=type(message).__name__, error=error)
        for end in refused_frame_ends(message, self.node.shard.index, error, unknown=unknown):
            self.node.side.report(end)


class Peers:
    """Where the chain's names are, as membership says: what a link resolves before each send."""

    def __init__(self, swim: Callable[[], object]):
        self._swim = swim

    def addr_of(self, name: str) -> str | None:
        """The address of the member holding `name` (a registry name), or None."""
        member = self._swim().resolve(name)
        return None if member is None else member.addr

    async def moved(self, name: str, addr: str) -> None:
        """Until the member at `addr` no longer holds `name` (declared dead, or replaced)."""
        await self._swim().wait_until(lambda s: (m := s.resolve(name)) is None or m.addr != addr)
