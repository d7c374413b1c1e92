"""A stage at run time: admits messages for its actor, pumps them through the compute thread in order,
and delivers what the actor returns — sends to the next name in the chain, replies to whoever asked."""
from __future__ import annotations

import logging
import resource

import trio

from roles import make_actor
from roles.actions import Refused, Reply, Send, error_reply

from . import wire
from .client import PeerClient, PeerError
from .log import error_event
from .swim import Swim

log = logging.getLogger("pp.node")

INBOX_SIZE = 256
SEND_ATTEMPTS = 4
FIRST_RETRY_S = 0.1
KEPT_RESPONSES = 64


class StageNode:
    def __init__(self, stage: int, num_stages: int, client: PeerClient, *, node_id: str):
        self.stage, self.num_stages, self.node_id = stage, num_stages, node_id
        self.actor = make_actor(stage, num_stages)
        self.client = client
        self.swim: Swim | None = None
        self.worker = None
        # replies with nowhere to go (the asker is behind NAT): kept for GET /v1/response/<id>
        self.kept: dict[str, wire.InferenceResponse] = {}
        self._kept_changed = trio.Event()
        self._inbox, self._outbox = trio.open_memory_channel(INBOX_SIZE)

    @property
    def hidden_dim(self) -> int | None:
        return None if self.worker is None else self.worker.info.hidden_dim

    def deliver(self, message) -> None:
        """Admit a message from the network and queue it for the compute thread, or refuse it."""
        if self.worker is None:
            raise Refused(503, f"stage {self.stage} is still loading its weights")
        self.actor.admit(message)
        try:
            self._inbox.send_nowait(message)
        except trio.WouldBlock:
            raise Refused(503, f"stage {self.stage} inbox is full ({INBOX_SIZE} messages)") from None

    def health(self) -> dict:
        info = self.worker.info if self.worker is not None else None
        return {"ok": True, "node": self.node_id, "stage": self.stage, "role": self.actor.role.value,
                "ready": info is not None, "layers": [info.layers.start, info.layers.stop] if info else None,
                "weight_bytes": info.weight_bytes if info else None,
                # ru_maxrss is KiB on Linux
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    async def pump(self, compute) -> None:
        """Process messages one at a time, in arrival order, until cancelled."""
        async for message in self._outbox:
            actions = await compute.call(self.actor.process, message, self.worker)
            for action in actions:
                await self._act(action)

    async def _act(self, action) -> None:
        if isinstance(action, Reply):
            await self._reply(action)
            return
        try:
            await self._send(action)
        except PeerError as exc:
            m = action.message
            rid, reply_to = (m.meta.request_id, m.meta.reply_to) if isinstance(m, wire.Activation) else (
                m.request_id, m.reply_to)
            error_event(log, "send_failed", dest=action.dest, request_id=rid, error=str(exc))
            await self._reply(error_reply(self.stage, rid, reply_to, RuntimeError(
                f"could not deliver {type(m).__name__} to {action.dest}: {exc}")))

    async def _send(self, send: Send) -> None:
        delay = FIRST_RETRY_S
        for attempt in range(1, SEND_ATTEMPTS + 1):
            member = self.swim.resolve(send.dest)  # every attempt: a restarted peer has a new address
            try:
                if member is None:
                    raise PeerError(send.dest, "no alive member holds this name")
                await self.client.send(member.addr, send.message)
                return
            except PeerError as exc:
                if not exc.retryable or attempt == SEND_ATTEMPTS:
                    raise
            await trio.sleep(delay)
            delay *= 3

    async def _reply(self, reply: Reply) -> None:
        response = reply.response
        if reply.reply_to is None:
            self._keep(response)
            return
        try:
            await self.client.send(reply.reply_to, response)
        except PeerError as exc:
            self._keep(response)
            error_event(log, "reply_failed", request_id=response.request_id, error=str(exc))

    def _keep(self, response: wire.InferenceResponse) -> None:
        self.kept[response.request_id] = response
        while len(self.kept) > KEPT_RESPONSES:
            del self.kept[next(iter(self.kept))]
        self._kept_changed.set()
        self._kept_changed = trio.Event()

    async def wait_response(self, request_id: str, wait_s: float) -> wire.InferenceResponse | None:
        """A kept response, waiting up to wait_s for it to arrive (a long poll)."""
        with trio.move_on_after(wait_s):
            while request_id not in self.kept:
                await self._kept_changed.wait()
        return self.kept.get(request_id)
