"""Posting a message to a stage by its registry name, with retries: the name is resolved on every try (a
restarted peer has a new address), a retryable failure is tried again after client.Backoff's waits, and
each post's encode and answer times go to the hop figures (node/observe/hops.py)."""
from __future__ import annotations

from typing import Callable

import trio

from node.observe import hops
from node.transport import wire
from node.transport.client import Backoff, PeerClient, PeerError
from node.transport.faults import NONE as NO_FAULTS, Faults


class Sender:
    def __init__(self, client: PeerClient, resolve: Callable[[str], str | None], *, source: str,
                 stats: hops.HopStats, faults: Faults = NO_FAULTS):
        """`resolve(name)`: the address of the member holding `name`, or None; `source`: this stage's name."""
        self.client, self.resolve, self.source, self.stats, self.faults = client, resolve, source, stats, faults

    async def send(self, dest: str, message) -> None:
        """Post `message` to `dest`; raises PeerError once the tries are spent or the failure is final."""
        backoff = Backoff()
        while True:
            addr = self.resolve(dest)  # every attempt: a restarted peer has a new address
            try:
                if addr is None:
                    raise PeerError(dest, "no alive member holds this name")
                await self._post(dest, addr, message)
                return
            except PeerError as exc:
                wait = backoff.failed()
                if not exc.retryable or wait is None:
                    raise
            await trio.sleep(wait)

    async def _post(self, dest: str, addr: str, message) -> None:
        if self.faults.active and dest.startswith("pp-stage-") and await self.faults.before_send():
            raise PeerError(addr, "dropped by fault injection (PP_FAULTS)")
        started = hops.now()
        path, body, content_type = wire.body_of(message)
        sent = hops.now()
        self.stats.record(f"to {dest}", "encode", sent - started)
        await self.client.post(addr, path, body, content_type,
                               headers={wire.SENT_FROM: self.source, wire.SENT_AT: repr(sent)})
        self.stats.record(f"to {dest}", "answer", hops.now() - sent)
