"""The runner's side of a cluster: a gossip member registered as pp-orchestrator that waits for the
stages to converge, submits prompts to pp-entry and receives the responses. A stage that dies while
a request is in flight ends the wait at once instead of at the response timeout.

Two shapes: reachable (local runs: it serves HTTP, is the gossip seed, and stages POST the response
to it), or an observer behind NAT (vast.ai from a laptop: it only opens connections — it introduces
the members to each other and long-polls the stages for the response)."""
from __future__ import annotations

import functools
import random
import time
import uuid

import attrs
import trio

from roles import topology
from roles.actions import Refused

from node.groups import unwrapped
from node.config.network import SCHEME
from node.membership.gossip import TERMINAL, Member, Meta, SwimConfig
from node.membership.swim import Swim
from node.transport import wire
from node.transport.app import make_app, serve_app
from node.transport.client import HttpTransport, PeerClient, PeerError, gossip_client
from node.transport.tls import ClusterTls, renew_certificates

POLL_WAIT_S = 20.0


class StageDied(RuntimeError):
    def __init__(self, member: Member):
        super().__init__(f"stage {member.meta.stage} ({member.id} at {member.addr}) is {member.state.value}")
        self.member = member


class Orchestrator:
    loading, hidden_dim = True, None  # takes no activations: answers them as a stage not yet loaded would

    def __init__(self, client: PeerClient, poll_client: PeerClient, node_id: str, *, url: str | None):
        self.client, self.poll_client, self.node_id = client, poll_client, node_id
        self.url = url  # None: nobody can reach us
        self.swim: Swim | None = None
        self.tls: ClusterTls | None = None  # the runner's certificate and the cluster's CA (run_orchestrator)
        self._pending: dict[str, trio.MemorySendChannel] = {}

    def deliver(self, message, *, source: str | None = None, sent_at: float | None = None) -> None:
        if not isinstance(message, wire.InferenceResponse):
            raise Refused(409, f"the orchestrator does not accept {type(message).__name__} messages")
        channel = self._pending.get(message.request_id)
        if channel is None:
            raise Refused(404, f"no request {message.request_id!r} is waiting here")
        try:
            channel.send_nowait(message)
        except trio.WouldBlock:  # a retried delivery of an answer already taken
            pass

    async def wait_response(self, request_id: str, wait_s: float):
        return None  # responses come to us; we keep none for others

    serving = True  # /health: the runner has no model to wait for

    def health(self) -> dict:
        return {"ok": True, "node": self.node_id, "role": "orchestrator"}

    def stages(self) -> list[Member]:
        return [m for m in self.swim.members().values() if m.meta.stage is not None]

    async def introduce(self, addr: str, *, retry_s: float = 1.0) -> None:
        """Sync with a member until it answers (it may still be starting)."""
        while not await self.swim.join(addr):
            await trio.sleep(retry_s)

    async def converge(self, num_stages: int) -> Member:
        """Wait until gossip reports num_stages alive stages and pp-entry resolves; returns the entry."""
        def done(swim: Swim):
            alive = [m for m in swim.alive() if m.meta.stage is not None]
            return len(alive) >= num_stages and swim.resolve(topology.ENTRY)
        return await self.swim.wait_until(done)

    async def submit(self, prompt: str, *, request_id: str | None = None,
                     **request_fields) -> wire.InferenceResponse:
        """Send to pp-entry and wait for the response; raises StageDied if a stage dies meanwhile, and
        PeerError if the entry refuses the request (a 429 when its queue is full)."""
        entry = self._entry()
        request = wire.InferenceRequest(request_id or uuid.uuid4().hex, prompt, reply_to=self.url, **request_fields)
        stages = self.stages()
        send, receive = trio.open_memory_channel(1)
        self._pending[request.request_id] = send
        try:
            with unwrapped(StageDied, PeerError):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch, {m.id for m in stages})
                    if self.url is None:
                        for member in stages:  # any stage may hold it: the exit, or one that failed
                            nursery.start_soon(self._poll, member.addr, request.request_id, send)
                    await self.client.send(entry.addr, request)
                    response = await receive.receive()
                    nursery.cancel_scope.cancel()
            return response
        finally:
            del self._pending[request.request_id]

    async def cancel(self, request_id: str) -> None:
        """Ask pp-entry to stop a request and free its slots on every stage."""
        await self.client.send(self._entry().addr, wire.CancelRequest(request_id))

    def _entry(self) -> Member:
        entry = self.swim.resolve(topology.ENTRY)
        if entry is None:
            raise RuntimeError("no alive member holds pp-entry")
        return entry

    async def watch(self) -> None:
        """Until a stage of the cluster as it is now dies: then raise StageDied naming it."""
        await self._watch({m.id for m in self.stages()})

    async def _watch(self, member_ids: set[str]) -> None:
        def dead(swim: Swim):
            return next((m for m in swim.members().values() if m.id in member_ids and m.state in TERMINAL), None)
        raise StageDied(await self.swim.wait_until(dead))

    async def _poll(self, addr: str, request_id: str, send: trio.MemorySendChannel) -> None:
        # long polls are cancelled when another answers first: HTTP/1.1 (see client.gossip_client)
        while True:
            try:
                r = await self.poll_client.get(addr, f"/v1/response/{request_id}?wait={POLL_WAIT_S:g}")
            except PeerError as exc:
                if not exc.retryable:
                    raise
                await trio.sleep(1.0)  # a dead stage is the watcher's to report
                continue
            if r.status_code == 200:
                try:
                    send.send_nowait(wire.decode(wire.InferenceResponse, r.content))
                except trio.WouldBlock:
                    pass
                return


@attrs.frozen
class Reach:
    """Where the orchestrator listens, or None for an observer behind NAT."""
    host: str = "127.0.0.1"
    port: int = 0


async def run_orchestrator(token: str, *, reach: Reach | None = Reach(), seeds: tuple[str, ...] = (),
                           swim_config: SwimConfig = SwimConfig(), max_body_bytes: int = 1 << 20,
                           task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the orchestrator until cancelled; reports it once up."""
    node_id = f"orchestrator-{uuid.uuid4().hex[:8]}"
    tls = ClusterTls(token, node_id)
    async with PeerClient(tls) as client, gossip_client(tls) as gossip, trio.open_nursery() as nursery:
        orch = Orchestrator(client, gossip, node_id, url=None)
        orch.tls = tls
        if reach is not None:
            app = make_app(orch, token=token, max_body_bytes=max_body_bytes)
            port = await nursery.start(functools.partial(serve_app, app, reach.host, reach.port,
                                                         tls=tls.server_context()))
            orch.url = f"{SCHEME}://{reach.host}:{port}"
        nursery.start_soon(renew_certificates, tls)
        meta = Meta(names=(topology.ORCHESTRATOR,), observer=reach is None)
        me = Member(orch.node_id, orch.url or f"{SCHEME}://unreachable.invalid", time.time_ns() // 1_000_000, meta=meta)
        orch.swim = Swim(me, swim_config, HttpTransport(gossip), random.Random(), seeds)
        await nursery.start(orch.swim.run)
        task_status.started(orch)
