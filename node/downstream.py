"""The side of every stage after the first (StageSide, node/stage_node.py): what it does differently from
stage 0 is little. A request that fails on a link is reported to stage 0, and when another member takes over
stage 0, the requests of the one before are gone with it, so their slots here are freed."""
from __future__ import annotations

import logging

from roles.actions import Send
from roles.messages import EndRequest
from roles.topology import stage_name

from node.observe.log import event

log = logging.getLogger("pp.node")


class DownstreamStage:
    def __init__(self, node):
        self.node = node

    def local(self, message) -> bool:
        return False  # every message here is the actor's

    def admitted(self, message) -> None:
        pass

    def progressed(self, progress) -> None:
        pass  # only stage 0 follows requests

    def report(self, end: EndRequest) -> None:
        self.node.links.post(Send(stage_name(0), end))

    def serving(self) -> bool:
        return True

    def running(self, actor_health: dict):
        return None  # requests run at stage 0's count

    def figures(self) -> dict:
        return {"followed": 0}

    async def ready(self, swim) -> None:
        pass

    async def watch(self, swim) -> None:
        """When another member takes over stage 0, free the slots of the requests of the one before."""
        owner = None
        while True:
            entry = await swim.wait_until(
                lambda s: (m := s.resolve(stage_name(0))) is not None and m.meta.ready and m.id != owner and m)
            if owner is not None:
                self.node.actor.entries.forget_except(entry.id)
                self.node.wake()
                event(log, "entry_replaced", old=owner, new=entry.id)
            owner = entry.id
