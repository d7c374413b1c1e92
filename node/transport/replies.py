"""Replies to whoever asked: posted to the asker's reply_to, or, where it names none (the asker is behind NAT)
or cannot be reached, kept here (the last KEPT_RESPONSES) for the asker to long-poll with
`GET /v1/response/<id>` (node/transport/pipeline_routes.py)."""
from __future__ import annotations

import logging

import trio

from roles.actions import Reply

from node.observe.log import error_event
from node.transport import wire
from node.transport.client import PeerClient, PeerError

log = logging.getLogger("pp.node")

KEPT_RESPONSES = 64


class Replies:
    def __init__(self, client: PeerClient):
        self.client = client
        self.kept: dict[str, wire.InferenceResponse] = {}
        self._changed = trio.Event()

    async def send(self, reply: Reply) -> None:
        response = reply.response
        if reply.reply_to is None:
            self.keep(response)
            return
        try:
            await self.client.send(reply.reply_to, response)
        except PeerError as exc:
            self.keep(response)
            error_event(log, "reply_failed", request_id=response.request_id, error=str(exc))

    def keep(self, response: wire.InferenceResponse) -> None:
        self.kept[response.request_id] = response
        while len(self.kept) > KEPT_RESPONSES:
            del self.kept[next(iter(self.kept))]
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, request_id: str, wait_s: float) -> wire.InferenceResponse | None:
        """A kept response, waiting up to wait_s for it to arrive (a long poll)."""
        with trio.move_on_after(wait_s):
            while request_id not in self.kept:
                await self._changed.wait()
        return self.kept.get(request_id)
