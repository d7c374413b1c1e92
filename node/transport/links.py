"""Outbound messages of a stage: one ordered link per destination, so that sending never holds up compute.

A stage's compute loop hands each message to `Links.post` and goes on with its next step at once. Every
destination (a registry name such as pp-stage-2, or an asker's URL) has its own FIFO (an Outbox) and one
sender task in the links' nursery, started when the destination is first used:

- A stage's next stage (and the last stage's stage 0) gets a link stream (node/transport/streams.py): frames in one
  long-lived HTTP/2 request body, nobody waiting for an answer. Anything else — and every destination
  when streams are off — gets a POST per message, sent one at a time, each waiting for its 202.
- Order per destination is kept either way. So an EndRequest reaches the next stage after the rows sent
  before it, and before the rows of the request that takes the freed slot.
- While a message is on the wire, later ones queue; the sender then merges what queued into as few
  messages as it can (the activations of several steps into one, their fed-back tokens into one) — the
  slower the link, the larger the batches, so a backlog cannot build up one message at a time.
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

from node.transport.client import PeerError

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


class Outbox:
    """The messages waiting for one destination."""

    def __init__(self):
        self._queue: collections.deque = collections.deque()
        self._wakeup = trio.Event()

    def put(self, message) -> None:
        self._queue.append(message)
        self._wakeup.set()

    def __len__(self) -> int:
        return len(self._queue)

    async def wait(self) -> None:
        while not self._queue:
            self._wakeup = trio.Event()
            await self._wakeup.wait()

    def drain(self) -> list:
        batch = coalesce(list(self._queue))
        self._queue.clear()
        return batch

    async def next_batch(self) -> list:
        await self.wait()
        return self.drain()


class Links:
    """Owns the sender tasks. `deliver(dest, message)` does one POST with its retries, raising PeerError on
    failure; `open_stream(dest)` gives the link stream for a destination, or None for POSTs."""

    def __init__(self, nursery: trio.Nursery, deliver: Callable[[str, object], Awaitable[None]],
                 on_undeliverable: Callable[[Send, str], None], on_reply: Callable[[Reply], Awaitable[None]],
                 open_stream: Callable[[str], object | None] = lambda dest: None):
        self._nursery, self._deliver, self._open_stream = nursery, deliver, open_stream
        self._on_undeliverable, self._on_reply = on_undeliverable, on_reply
        self._outboxes: dict[str, Outbox] = {}
        self.streams: dict[str, object] = {}
        self._replies: trio.MemorySendChannel | None = None

    def post(self, action: Send | Reply) -> None:
        if isinstance(action, Reply):
            self._reply_channel().send_nowait(action)
            return
        outbox = self._outboxes.get(action.dest)
        if outbox is None:
            outbox = self._outboxes[action.dest] = Outbox()
            stream = self._open_stream(action.dest)
            if stream is None:
                self._nursery.start_soon(self._post_sender, action.dest, outbox)
            else:
                self.streams[action.dest] = stream
                self._nursery.start_soon(stream.run, outbox)
        outbox.put(action.message)

    def pending(self) -> dict[str, int]:
        return {dest: len(outbox) for dest, outbox in self._outboxes.items()}

    def lost(self, dest: str, messages: list, error: str) -> None:
        """A link stream could not deliver these."""
        for message in messages:
            self._undeliverable(dest, message, error)

    async def _post_sender(self, dest: str, outbox: Outbox) -> None:
        while True:
            for message in await outbox.next_batch():
                try:
                    await self._deliver(dest, message)
                except PeerError as exc:
                    self._undeliverable(dest, message, str(exc))

    def _undeliverable(self, dest: str, message, error: str) -> None:
        log.warning("undeliverable %s to %s: %s", type(message).__name__, dest, error)
        self._on_undeliverable(Send(dest, message), error)

    def _reply_channel(self) -> trio.MemorySendChannel:
        """Replies go out one after another on their own task: a slow asker delays only other replies."""
        if self._replies is None:
            self._replies, receive = trio.open_memory_channel(float("inf"))
            self._nursery.start_soon(self._reply_sender, receive)
        return self._replies

    async def _reply_sender(self, receive: trio.MemoryReceiveChannel) -> None:
        async for reply in receive:
            await self._on_reply(reply)
