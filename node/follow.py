"""Stage 0's requests followed for an asker (the OpenAI API), each API request's events in one bounded Inbox.

An asker that reads no further (an HTTP/2 client that grants no window, a stalled socket) must not make stage 0
buffer the rest of its answer: once its inbox is full, the request's next events wait in a stash of at most the
few already on their way, and its rows are held (FirstActor.held), so no more of its tokens are computed. The
asker's next read moves the stash on and, once it is empty, lets the rows run again. What an asker leaves unread
is so bounded at FOLLOW_EVENTS an engine request, plus hypercorn's own window-sized buffer (node/transport/h2_flow.py);
a reader stalled for good is cut by the send timeout there, which cancels its requests."""
from __future__ import annotations

import collections
from collections.abc import Callable

import trio

from node.transport.replies import KEPT_RESPONSES

FOLLOW_EVENTS = 4  # events (a token each, with its logprobs) one engine request may leave unread before it waits


class Inbox:
    """The events of one API request's engine requests (its choices), in the order each request made them; the
    asker reads them with `async for` until every request it followed is closed."""

    def __init__(self, caught_up: Callable[[str], None]):
        # unbounded for trio, bounded here: FOLLOW_EVENTS for each request followed (put, _move_on)
        self._send, self._receive = trio.open_memory_channel(float("inf"))
        self._stash: dict[str, collections.deque] = {}  # per request: its events that found the buffer full
        self._open: set[str] = set()
        self._caught_up = caught_up

    def open(self, request_id: str) -> None:
        self._open.add(request_id)

    def put(self, request_id: str, event) -> bool:
        """Pass an event on; False when it had to wait (the asker is behind: the request should too)."""
        stash = self._stash.get(request_id)
        if stash is None and self._room():
            self._send.send_nowait(event)
            return True
        self._stash.setdefault(request_id, collections.deque()).append(event)
        return False

    def close(self, request_id: str) -> None:
        """The request is followed no more: what it left unsent is dropped; the last one closes the inbox."""
        self._open.discard(request_id)
        self._stash.pop(request_id, None)
        if not self._open:
            self._send.close()

    def _room(self) -> bool:
        return self._send.statistics().current_buffer_used < FOLLOW_EVENTS * len(self._open)

    @property
    def unread(self) -> int:
        """Events held for the asker: in the buffer and stashed."""
        return self._send.statistics().current_buffer_used + sum(map(len, self._stash.values()))

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            event = await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        self._move_on()
        return event

    def _move_on(self) -> None:
        """The asker made room: stashed events go on in order, and a request whose stash empties runs again."""
        for request_id, stash in list(self._stash.items()):
            while stash:
                if not self._room():
                    return
                self._send.send_nowait(stash.popleft())
            del self._stash[request_id]
            self._caught_up(request_id)


class Followers:
    """Which requests stage 0 follows for an asker, and into which inbox; `held` is the set of requests whose
    rows wait for their asker (the first actor's), `wake` tells the stage there may be a step again."""

    def __init__(self, held: Callable[[], set[str]], wake: Callable[[], None]):
        self._held, self._wake = held, wake
        self._inboxes: dict[str, Inbox] = {}
        self._unfollowed: collections.OrderedDict[str, None] = collections.OrderedDict()  # their late replies

    def follow(self, request_id: str, into: Inbox | None = None) -> Inbox:
        """Follow a request into `into`, or a new inbox; returns the inbox."""
        inbox = into if into is not None else Inbox(self._caught_up)
        inbox.open(request_id)
        self._inboxes[request_id] = inbox
        return inbox

    def unfollow(self, request_id: str) -> None:
        inbox = self._inboxes.pop(request_id, None)
        if inbox is None:
            return
        inbox.close(request_id)
        self._held().discard(request_id)
        self._unfollowed[request_id] = None
        while len(self._unfollowed) > KEPT_RESPONSES:
            self._unfollowed.popitem(last=False)

    def following(self, request_id: str) -> bool:
        return request_id in self._inboxes

    def was_followed(self, request_id: str) -> bool:
        """Followed until lately: its asker has had its answer (or gone), and its late replies are dropped."""
        return request_id in self._unfollowed

    def send(self, request_id: str, event) -> None:
        """An event of a followed request for its asker; if the asker is behind, the request's rows wait."""
        inbox = self._inboxes.get(request_id)
        if inbox is not None and not inbox.put(request_id, event):
            self._held().add(request_id)

    def figures(self) -> dict:
        """API requests whose asker is still being answered; those of them waiting for their asker to read; the
        events held for them."""
        held = self._held()
        inboxes = {id(i): i for i in self._inboxes.values()}.values()
        return {"followed": len(self._inboxes), "behind": sum(rid in held for rid in self._inboxes),
                "unread_events": sum(i.unread for i in inboxes)}

    def _caught_up(self, request_id: str) -> None:
        if request_id in self._held():
            self._held().discard(request_id)
            self._wake()
