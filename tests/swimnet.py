"""An in-memory network for Swim tests: per-link drops and latency, unreachable addresses, counted messages
(and CountedId, for counting a handler's work).

Messages cross the "wire" as JSON through one cattrs converter, as they will over HTTP. A request, once
sent, is served even if the caller stops waiting (like an HTTP server that already got the body).
"""
from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import cattrs
import trio

from node.membership.gossip import Ack, Member, Meta, Nack, Ping, PingReq, State, SwimConfig, Sync
from node.membership.swim import Swim, TransportError, WrongTargetError

T_S = 0.1  # protocol period of the test clusters (virtual time)
TEST_CONFIG = SwimConfig(protocol_period_s=T_S, probe_timeout_s=0.03, suspicion_mult=4, sync_interval_s=3.0,
                         sync_timeout_s=0.05, join_backoff_s=0.05, join_backoff_max_s=0.4)

WIRE = cattrs.Converter()


def over_the_wire(msg: Any) -> Any:
    return WIRE.structure(json.loads(json.dumps(WIRE.unstructure(msg))), type(msg))


class SwimNet:
    """Routes requests between Swim instances by address. Serving tasks run in the given nursery."""

    def __init__(self, nursery: trio.Nursery):
        self._nursery = nursery
        self._nodes: dict[str, Swim] = {}
        self.unreachable: set[str] = set()  # no answer that says why (a partition, a dropped host)
        self.gone: set[str] = set()  # connection refused: nothing listens there any more
        self.dropped: set[tuple[str, str]] = set()  # (src, dst): requests src -> dst vanish; the caller times out
        self.latency_s: dict[tuple[str, str], float] = {}  # one-way, per direction
        self.sent: Counter[tuple[str, str, str]] = Counter()  # (src, dst, kind): attempts
        self.answered: Counter[tuple[str, str, str, str]] = Counter()  # (src, dst, kind, reply type)

    def attach(self, addr: str, swim: Swim) -> None:
        self._nodes[addr] = swim

    def transport(self, src: str) -> LinkTransport:
        return LinkTransport(self, src)

    async def deliver(self, src: str, dst: str, kind: str, msg: Any, handle: Callable[[Swim, Any], Awaitable[Any]]
                      ) -> Any:
        self.sent[(src, dst, kind)] += 1
        if dst in self.gone:
            raise TransportError(dst, "connection refused", refused=True)
        if dst in self.unreachable or dst not in self._nodes:
            raise TransportError(dst, "unreachable")
        if (src, dst) in self.dropped:
            await trio.sleep_forever()
        done, box = trio.Event(), {}
        self._nursery.start_soon(self._serve, src, dst, over_the_wire(msg), handle, done, box)
        await done.wait()
        if "error" in box:
            raise box["error"]
        self.answered[(src, dst, kind, type(box["reply"]).__name__)] += 1
        return box["reply"]

    async def _serve(self, src: str, dst: str, msg: Any, handle: Callable[[Swim, Any], Awaitable[Any]],
                     done: trio.Event, box: dict[str, Any]) -> None:
        await trio.sleep(self.latency_s.get((src, dst), 0.0))
        try:
            if dst in self.unreachable:
                raise TransportError(dst, "connection reset")
            try:
                reply = await handle(self._nodes[dst], msg)
            except WrongTargetError as exc:  # the HTTP layer answers 4xx; its client raises TransportError
                raise TransportError(dst, f"refused: {exc}") from exc
            await trio.sleep(self.latency_s.get((dst, src), 0.0))
            if dst in self.unreachable:
                raise TransportError(dst, "connection reset")
            box["reply"] = over_the_wire(reply)
        except TransportError as exc:
            box["error"] = exc
        done.set()


@attrs.frozen
class LinkTransport:
    net: SwimNet
    src: str

    async def ping(self, addr: str, msg: Ping) -> Ack:
        return await self.net.deliver(self.src, addr, "ping", msg, lambda node, m: node.on_ping(m))

    async def ping_req(self, addr: str, msg: PingReq) -> Ack | Nack:
        return await self.net.deliver(self.src, addr, "ping_req", msg, lambda node, m: node.on_ping_req(m))

    async def sync(self, addr: str, msg: Sync) -> Sync:
        async def handle(node: Swim, m: Sync) -> Sync:
            return node.on_sync(m)
        return await self.net.deliver(self.src, addr, "sync", msg, handle)


class Unplugged:
    """A transport for members whose tests never let them send."""

    async def ping(self, addr: str, msg: Ping) -> Ack:
        raise AssertionError(f"unexpected ping to {addr}")

    async def ping_req(self, addr: str, msg: PingReq) -> Ack | Nack:
        raise AssertionError(f"unexpected ping-req to {addr}")

    async def sync(self, addr: str, msg: Sync) -> Sync:
        raise AssertionError(f"unexpected sync with {addr}")


@attrs.frozen
class Node:
    swim: Swim
    addr: str
    scope: trio.CancelScope


class CountedId(str):
    """A member id that counts every comparison and hash made of it: a handler's work, counted per id rather
    than timed."""
    ops = 0

    def __eq__(self, other: object) -> bool:
        CountedId.ops += 1
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        CountedId.ops += 1
        return str.__ne__(self, other)

    def __hash__(self) -> int:
        CountedId.ops += 1
        return str.__hash__(self)


def addr_of(node_id: str) -> str:
    return f"http://{node_id}.test:8000"


async def start_node(nursery: trio.Nursery, net: SwimNet, node_id: str, *, seeds: list[str],
                     incarnation: int = 1, meta: Meta = Meta(), reachable: bool = True,
                     config: SwimConfig = TEST_CONFIG, yield_when_dead: bool = False) -> Node:
    """Start a member in its own cancel scope (cancel it to kill the process); returns once it has joined."""
    addr = addr_of(node_id)
    member = Member(node_id, addr, incarnation, State.ALIVE, meta)
    swim = Swim(member, config, net.transport(addr), random.Random(f"{node_id}/{incarnation}"), seeds,
                yield_when_dead=yield_when_dead)
    net.attach(addr, swim)
    if reachable:
        net.unreachable.discard(addr)
    else:
        net.unreachable.add(addr)
    scope = await nursery.start(_run_in_scope, swim)
    return Node(swim, addr, scope)


async def _run_in_scope(swim: Swim, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(swim.run)
            task_status.started(scope)


async def start_cluster(nursery: trio.Nursery, net: SwimNet, n: int) -> list[Node]:
    """n members n0..n{n-1}; n0 starts alone, the others join through it."""
    first = await start_node(nursery, net, "n0", seeds=[])
    return [first] + [await start_node(nursery, net, f"n{i}", seeds=[first.addr]) for i in range(1, n)]


def kill(net: SwimNet, node: Node, *, refused: bool = False) -> None:
    """The node stops; `refused`: its host refuses connections to it (its process exited), else no answer comes."""
    (net.gone if refused else net.unreachable).add(node.addr)
    node.scope.cancel()


def all_alive(ids: list[str]) -> Callable[[Swim], bool]:
    def check(swim: Swim) -> bool:
        view = swim.members()
        return all(i in view and view[i].state is State.ALIVE for i in ids)
    return check


def record_when(nursery: trio.Nursery, nodes: list[Node], predicate: Callable[[Swim], Any]) -> list[str]:
    """Ids of the nodes in whose view predicate has held at some moment (watchers live until the test ends)."""
    seen: list[str] = []

    async def watch(node: Node) -> None:
        await node.swim.wait_until(predicate)
        seen.append(node.swim.me.id)
    for node in nodes:
        nursery.start_soon(watch, node)
    return seen


def state_of(member_id: str, swim: Swim) -> State | None:
    record = swim.members().get(member_id)
    return None if record is None else record.state


async def wait_everywhere(nodes: list[Node], predicate: Callable[[Swim], Any]) -> None:
    """Wait until predicate holds in every node's view (each waits on its own change events)."""
    async with trio.open_nursery() as nursery:
        for node in nodes:
            nursery.start_soon(node.swim.wait_until, predicate)
