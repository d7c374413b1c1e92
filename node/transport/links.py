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

import attrs
import trio

from roles.actions import Reply, Send
from roles.messages import Activation, NextTokens

from node.transport import frames
from node.transport.client import PeerError

log = logging.getLogger("pp.links")


def coalesce(messages: list, *, max_rows: int = frames.MAX_FRAME_ROWS,
             max_tokens: int = frames.MAX_FRAME_TOKENS) -> list:
    """Merge runs of activations, and runs of fed-back tokens, into as few messages as fit one link frame
    each (at most `max_rows` hidden rows, `max_tokens` tokens: what a receiver takes, frames.frame_limit);
    one larger than that is cut to fit. Order is kept, and so is each request's order of rows. Their bytes
    besides rows (starts, logprobs) are cut to fit where they are encoded once, by the link (frames.bodies)."""
    out: list = []
    for message in messages:
        for m in _fitted(message, max_rows, max_tokens):
            prev = out[-1] if out else None
            if isinstance(m, Activation) and isinstance(prev, Activation) and prev.meta.rows + m.meta.rows <= max_rows:
                out[-1] = Activation.of(prev.split() + m.split())
            elif (isinstance(m, NextTokens) and isinstance(prev, NextTokens)
                  and len(prev.tokens) + len(m.tokens) <= max_tokens):
                out[-1] = NextTokens(prev.tokens + m.tokens)
            else:
                out.append(m)
    return out


def _fitted(message, max_rows: int, max_tokens: int) -> list:
    """`message` as pieces that each fit one frame."""
    if isinstance(message, NextTokens) and len(message.tokens) > max_tokens:
        return [NextTokens(message.tokens[i:i + max_tokens]) for i in range(0, len(message.tokens), max_tokens)]
    if isinstance(message, Activation) and message.meta.rows > max_rows:
        return [Activation.of(rows) for rows in _cut_rows(message, max_rows)]
    return [message]


def _cut_rows(act: Activation, max_rows: int) -> list[list]:
    """An activation's segments in groups of at most `max_rows` rows; a segment that does not fit is cut
    in two at a position (its later part carries no start: it continues the request, as a prompt chunk does)."""
    row_bytes = len(act.hidden) // act.meta.rows
    groups, group, room = [], [], max_rows
    for seg, hidden in act.split():
        while seg.seq_len > room:
            if room:
                group.append((attrs.evolve(seg, seq_len=room), hidden[:room * row_bytes]))
                seg = attrs.evolve(seg, position=seg.position + room, seq_len=seg.seq_len - room, start=None)
                hidden = hidden[room * row_bytes:]
            groups.append(group)
            group, room = [], max_rows
        group.append((seg, hidden))
        room -= seg.seq_len
    return [*groups, group] if group else groups


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
