"""Outbound messages of a stage: one ordered link per destination, so that sending never holds up compute.

A stage's compute loop hands each message to `Links.post` and goes on with its next step at once. Every
destination (a registry name such as pp-stage-2, or an asker's URL) has its own FIFO and one sender task
in the links' nursery, started when the destination is first used:

- Order per destination is kept: a sender sends one message at a time and waits for its 202. So an
  EndRequest reaches the next stage after the rows sent before it, and before the rows of the request
  that takes the freed slot.
- While a message is on the wire, later ones queue; the sender then merges what queued into as few
  messages as it can (the activations of several steps into one, their fed-back tokens into one) — the
  slower the link, the larger the batches, so a backlog cannot build up one POST at a time.
- A message that cannot be delivered after the retries goes to `on_undeliverable`, which deals with
  what its failure causes (the actor fails the requests in it).

The queues are not bounded here: each request has at most one decode row in flight and a prompt of
bounded length, and stage 0 bounds the requests in flight, so what can wait on a link is bounded too.
"""
from __future__ import annotations

import collections
import logging
from typing import Awaitable, Callable

import trio

from roles.actions import Reply, Send
from roles.messages import Activation, NextTokens

from .client import PeerError

log = logging.getLogger("pp.links")


def coalesce(messages: list) -> list:
    """Merge runs of activations, and runs of fed-back tokens, into one message each; order is kept."""
    out: list = []
    for m in messages:
        prev = out[-1] if out else None
        if isinstance(m, Activation) and isinstance(prev, Activation):
            out[-1] = Activation.of(prev.split() + m.split())
        elif isinstance(m, NextTokens) and isinstance(prev, NextTokens):
            out[-1] = NextTokens(prev.tokens + m.tokens)
        else:
            out.append(m)
    return out


class Links:
    """Owns the sender tasks; `deliver(dest, message)` does one send with its retries, raising on failure."""

    def __init__(self, nursery: trio.Nursery, deliver: Callable[[str, object], Awaitable[None]],
                 on_undeliverable: Callable[[Send, str], None], on_reply: Callable[[Reply], Awaitable[None]]):
        self._nursery, self._deliver = nursery, deliver
        self._on_undeliverable, self._on_reply = on_undeliverable, on_reply
        self._queues: dict[str, collections.deque] = {}
        self._wakeups: dict[str, trio.Event] = {}
        self._replies: trio.MemorySendChannel | None = None

    def post(self, action: Send | Reply) -> None:
        if isinstance(action, Reply):
            self._reply_channel().send_nowait(action)
            return
        queue = self._queues.get(action.dest)
        if queue is None:
            queue = self._queues[action.dest] = collections.deque()
            self._wakeups[action.dest] = trio.Event()
            self._nursery.start_soon(self._sender, action.dest)
        queue.append(action.message)
        self._wakeups[action.dest].set()

    def pending(self) -> dict[str, int]:
        return {dest: len(q) for dest, q in self._queues.items()}

    async def _sender(self, dest: str) -> None:
        queue = self._queues[dest]
        while True:
            if not queue:
                self._wakeups[dest] = trio.Event()
                await self._wakeups[dest].wait()
            batch = coalesce(list(queue))
            queue.clear()
            for message in batch:
                await self._send(dest, message)

    async def _send(self, dest: str, message) -> None:
        try:
            await self._deliver(dest, message)
        except PeerError as exc:
            log.warning("undeliverable %s to %s: %s", type(message).__name__, dest, exc)
            self._on_undeliverable(Send(dest, message), str(exc))

    def _reply_channel(self) -> trio.MemorySendChannel:
        """Replies go out one after another on their own task: a slow asker delays only other replies."""
        if self._replies is None:
            self._replies, receive = trio.open_memory_channel(float("inf"))
            self._nursery.start_soon(self._reply_sender, receive)
        return self._replies

    async def _reply_sender(self, receive: trio.MemoryReceiveChannel) -> None:
        async for reply in receive:
            await self._on_reply(reply)
