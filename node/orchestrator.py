"""The runner's side of a cluster: a gossip member registered as pp-orchestrator that waits for the
stages to converge, submits prompts to pp-entry and receives the responses. A stage that dies while
a request is in flight ends the wait at once instead of at the response timeout."""
from __future__ import annotations

import random
import time
import uuid

import trio

from roles import topology
from roles.actions import Refused

from . import wire
from .app import make_app, serve_app
from .client import HttpTransport, PeerClient
from .gossip import TERMINAL, Member, Meta, SwimConfig
from .swim import Swim


class StageDied(RuntimeError):
    def __init__(self, member: Member):
        super().__init__(f"stage {member.meta.stage} ({member.id} at {member.addr}) is {member.state.value}")
        self.member = member


class Orchestrator:
    hidden_dim = None  # takes no activations

    def __init__(self, client: PeerClient, node_id: str):
        self.client, self.node_id = client, node_id
        self.swim: Swim | None = None
        self.url: str | None = None
        self._pending: dict[str, trio.MemorySendChannel] = {}

    def deliver(self, message) -> None:
        if not isinstance(message, wire.InferenceResponse):
            raise Refused(409, f"the orchestrator does not accept {type(message).__name__} messages")
        channel = self._pending.get(message.request_id)
        if channel is None:
            raise Refused(404, f"no request {message.request_id!r} is waiting here")
        try:
            channel.send_nowait(message)
        except trio.WouldBlock:  # a retried delivery of an answer already taken
            pass

    def health(self) -> dict:
        return {"ok": True, "node": self.node_id, "role": "orchestrator"}

    def stages(self) -> list[Member]:
        return [m for m in self.swim.members().values() if m.meta.stage is not None]

    async def converge(self, num_stages: int) -> Member:
        """Wait until gossip reports num_stages alive stages and pp-entry resolves; returns the entry."""
        def done(swim: Swim):
            alive = [m for m in swim.alive() if m.meta.stage is not None]
            return len(alive) >= num_stages and swim.resolve(topology.ENTRY)
        return await self.swim.wait_until(done)

    async def submit(self, request: wire.InferenceRequest) -> wire.InferenceResponse:
        """Send to pp-entry and wait for the response; raises StageDied if a stage dies meanwhile."""
        entry = self.swim.resolve(topology.ENTRY)
        if entry is None:
            raise RuntimeError("no alive member holds pp-entry")
        watched = {m.id for m in self.stages()}
        send, receive = trio.open_memory_channel(1)
        self._pending[request.request_id] = send
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, watched)
                await self.client.send(entry.addr, request)
                response = await receive.receive()
                nursery.cancel_scope.cancel()
            return response
        finally:
            del self._pending[request.request_id]

    async def _watch(self, member_ids: set[str]) -> None:
        def dead(swim: Swim):
            return next((m for m in swim.members().values() if m.id in member_ids and m.state in TERMINAL), None)
        raise StageDied(await self.swim.wait_until(dead))


def new_request(prompt: str, *, reply_to: str | None, **kw) -> wire.InferenceRequest:
    return wire.InferenceRequest(uuid.uuid4().hex, prompt, reply_to=reply_to, **kw)


async def run_orchestrator(token: str, *, host: str = "127.0.0.1", port: int = 0, seeds: tuple[str, ...] = (),
                           swim_config: SwimConfig = SwimConfig(), max_body_bytes: int = 1 << 20,
                           task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the orchestrator (gossip seed, response endpoint) until cancelled; reports it when up."""
    async with PeerClient(token) as client, trio.open_nursery() as nursery:
        orch = Orchestrator(client, node_id=f"orchestrator-{uuid.uuid4().hex[:8]}")
        app = make_app(orch, token=token, max_body_bytes=max_body_bytes)
        port = await nursery.start(serve_app, app, host, port)
        orch.url = f"http://{host}:{port}"
        me = Member(orch.node_id, orch.url, time.time_ns() // 1_000_000, meta=Meta(names=(topology.ORCHESTRATOR,)))
        orch.swim = Swim(me, swim_config, HttpTransport(client), random.Random(), seeds)
        await nursery.start(orch.swim.run)
        task_status.started(orch)
