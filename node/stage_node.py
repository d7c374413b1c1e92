"""A stage at run time, whatever its role: admits messages for its actor, runs its batched steps on the
compute thread one after another, and hands what each step produces to the links, which send it without
holding up the next step. What stage 0 does beyond that is its side's (node/entry.py; the others',
node/downstream.py); the link streams' ends are node/stage_links.py's, its reports node/stage_health.py's.
Replies go to whoever asked, or are kept here for an asker behind NAT to fetch (node/transport/replies.py).

A step whose compute raises fails the requests in it, each answered with the stage and the error, and the
stage goes on with the next step: one request's failure is that request's alone, and a process that died of
it would only be replaced and handed the request again. Cancellation and other BaseExceptions still end
the loop."""
from __future__ import annotations

import logging
from typing import Callable, Protocol

import trio

from roles import DEFAULT_MAX_QUEUE, make_actor
from roles.actions import Progress, Refused, Send
from roles.messages import EndRequest, InferenceRequest
from roles.topology import ENTRY, stage_name
from worker.partition import Shard

from node.membership.gossip import State
from node.membership.swim import Swim
from node.observe import hops
from node.observe.figures import StageFigures
from node.observe.log import as_extra, error_event, event
from node.observe.metrics import NodeMetrics
from node.stage_health import health, metrics_snapshot
from node.stage_links import LinkEnds, Peers
from node.transport.client import PeerClient
from node.transport.faults import NONE as NO_FAULTS, Faults
from node.transport.app import still_loading
from node.transport.links import Links
from node.transport.replies import Replies
from node.transport.sends import Sender

log = logging.getLogger("pp.node")
CAPTURE_IDLE_S = 2.0  # no work for this long: the stage may capture a step bucket it has not yet (warm_more)


class StageSide(Protocol):
    """What a stage does for its role beyond the driver's loop: node/entry.py's EntryStage (stage 0) or
    node/downstream.py's DownstreamStage."""

    def local(self, message) -> bool: ...  # took a message meant for this node, not its actor
    def admitted(self, message) -> None: ...
    def progressed(self, progress: Progress) -> None: ...
    def report(self, end: EndRequest) -> None: ...  # a request failed on a link here
    def serving(self) -> bool: ...
    def running(self, actor_health: dict) -> int | None: ...
    def figures(self) -> dict: ...
    async def ready(self, swim: Swim) -> None: ...  # until this stage may say it serves
    async def watch(self, swim: Swim) -> None: ...  # follows the chain's membership until cancelled


def _clocked(fn, *args):
    """On the compute thread: fn's result, and when it started and ended there (for the hop figures)."""
    started = hops.now()
    result = fn(*args)
    return result, started, hops.now()


class StageNode:
    def __init__(self, shard: Shard, client: PeerClient, *, side: Callable[[StageNode], StageSide], node_id: str,
                 max_queue: int = DEFAULT_MAX_QUEUE, link_streams: bool = True, faults: Faults = NO_FAULTS,
                 prompt_rows: int | None = None, model_name: str, prefix_cache: bool = True):
        self.shard, self.node_id, self.name = shard, node_id, stage_name(shard.index)
        self.split = None  # the worker.plan.Split the loaded range is of (attach)
        self.actor_settings = dict(max_queue=max_queue, node_id=node_id, prompt_rows=prompt_rows,
                                   prefix_cache=prefix_cache)  # roles.make_actor's; prefix_cache: stage 0's
        self.client, self.faults = client, faults
        self.metrics = NodeMetrics(lambda: metrics_snapshot(self), model_name=model_name)  # the API's model name
        self.hops = hops.HopStats(observe=lambda link, part, s: self.metrics.hop.labels(link, part).observe(s))
        self.figures = StageFigures(self.metrics)
        self.peers = Peers(lambda: self.swim)
        self.sender = Sender(client, self.peers.addr_of, source=self.name, stats=self.hops, faults=faults)
        self.replies = Replies(client)
        self.link_ends = LinkEnds(self, enabled=link_streams)
        self.links_in = self.link_ends.receiver
        self._arrivals: list[tuple[str, float]] = []  # (hop link, when) of messages no step has taken yet
        self._stage_names = frozenset(stage_name(i) for i in range(shard.count))  # the senders hops are kept for
        self.side = side(self)
        self.swim: Swim | None = None
        self.url: str | None = None  # advertised; the entry's own API requests name it as their reply_to
        self.worker = self.actor = self.links = None  # the actor is made with the worker: its size comes from the slice
        self.warming = self._chain_up = False  # warming: step buckets left to capture (/health says so)
        self.kv_budget: int | None = None  # KV positions this stage may hold (node/kv_memory.py), once loaded
        self._work = trio.Event()

    @property
    def loading(self) -> bool:
        """The one test of "still loading": until the worker is attached and the links are open, every message
        for the model is refused with the app's still_loading()."""
        return self.actor is None or self.links is None

    @property
    def serving(self) -> bool:
        """/health's 200: loaded, and on stage 0 a whole chain behind it that admits requests (/health's `ready`
        and `admitting`, once the chain has been seen whole); a stage that is missing or still loading is a 503
        there, as while this one loads."""
        return not self.loading and self.side.serving()

    @property
    def hidden_dim(self) -> int | None:
        return None if self.worker is None else self.worker.info.hidden_dim

    def listening(self, url: str) -> None:
        self.url = url

    def joined(self, swim: Swim) -> None:
        """Membership runs: links resolve their peers through it, and reply targets are checked against it."""
        self.swim = swim

    def attach(self, worker, *, capacity: int | None = None, split=None) -> None:
        """The worker is loaded: from now on messages are admitted. `capacity`: see roles.make_actor. `split`:
        the worker.plan.Split its range is of, and why (the pipeline view shows it)."""
        self.shard = worker.info.shard  # sized: its blocks are known now
        self.split = split
        self.actor = make_actor(worker, capacity=capacity, **self.actor_settings)
        self.worker, self.warming = worker, True  # after a lazy warm_up, the other buckets wait their capture

    def deliver(self, message, *, source: str | None = None, sent_at: float | None = None) -> None:
        """Admit a message from the network for the next steps, or refuse it (raises Refused). A message
        from a stage names it (`source`) and when it was sent, on the sender's clock (node/observe/hops.py)."""
        if source is not None:
            arrived, link = hops.now(), hops.source_link(source, self._stage_names)
            if sent_at is not None:
                self.hops.record(link, "wire", arrived - sent_at)
            self._arrivals.append((link, arrived))
        if self.loading:
            raise still_loading()
        if self.side.local(message):
            return
        if isinstance(message, InferenceRequest) and message.reply_to is not None:
            view = self.swim.members().values() if self.swim is not None else ()
            known = [m.addr for m in view if m.state in (State.ALIVE, State.SUSPECT)]
            if (error := reply_target_error(message.reply_to, [*known, self.url])) is not None:
                raise Refused(400, error)
        for action in self.actor.admit(message):
            self.post(action)
        self.side.admitted(message)
        self.wake()

    def take_frame(self, link_id: str, source: str, seq: int, sent_at: float, message) -> None:
        """A frame of a link stream (node/stage_links.py's LinkEnds.take_frame)."""
        self.link_ends.take_frame(link_id, source, seq, sent_at, message)

    def post(self, action) -> None:
        """An actor's action: progress for stage 0's followers, anything else to the links."""
        if isinstance(action, Progress):
            self.side.progressed(action)
        else:
            self.links.post(action)

    def wake(self) -> None:
        """There may be a step to plan."""
        self._work.set()

    def health(self) -> dict:
        return health(self)

    async def run(self, compute, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Open the links, follow the chain's membership, report started, then compute steps until
        cancelled."""
        async with trio.open_nursery() as nursery:
            self.links = Links(nursery, self.sender.send, self._undeliverable, self.replies.send,
                               self.link_ends.open_stream)
            if self.swim is not None:
                nursery.start_soon(self.side.watch, self.swim)
                nursery.start_soon(self._watch_chain_up, self.swim)
            task_status.started()
            await self._compute_loop(compute)

    async def _compute_loop(self, compute) -> None:
        while True:
            step = self.actor.plan()
            if step is None:
                await self._idle(compute)
                continue
            started = hops.now()
            for link, arrived in self._arrivals:
                self.hops.record(link, "queue", started - arrived)
            self._arrivals.clear()
            try:
                outcome, ran_from, ran_to = await compute.call(_clocked, self.actor.run, step, self.worker)
            except trio.ClosedResourceError:
                raise  # the compute thread is gone: the node is stopping
            except Exception as exc:  # noqa: BLE001 - the job's own error, whatever it is: its requests fail
                self._step_failed(step, exc)
                continue
            resumed = hops.now()
            for part, seconds in (("to_thread", ran_from - started), ("compute", ran_to - ran_from),
                                  ("back", resumed - ran_to)):
                self.hops.record("step", part, seconds)
            if self.figures.stepped(sum(u.rows for u in step.units), ran_to - ran_from, resumed - started):
                event(log, "first_steps", steps=[list(s) for s in self.figures.first_steps])
            for action in self.actor.finish(step, outcome):
                self.post(action)
            if self.warming and self.worker.wants_capture:  # under steady load: never idle long enough
                self.warming = await self._warm_more(compute)

    async def _idle(self, compute) -> None:
        """Nothing to compute: wait for work. Once the chain serves, a stage with step buckets left to capture
        (a lazy warm_up) captures one whenever CAPTURE_IDLE_S pass without work: not while the chain boots,
        whose stages share the machine, nor between the steps of a request being answered, nor while requests
        hold slots here: rows that stop coming for them mean a stage is missing, whose replacement boots
        (perhaps on this machine) and a replay follows, which a capture would only delay."""
        if self.warming and self._chain_up and not self.worker.slots_in_use:
            with trio.move_on_after(CAPTURE_IDLE_S):
                await self._work.wait()
            if not self._work.is_set():
                self.warming = await self._warm_more(compute)
                return
        else:
            await self._work.wait()
        self._work = trio.Event()

    async def _watch_chain_up(self, swim: Swim) -> None:
        """pp-entry resolves: every stage is ready, and the chain serves."""
        await swim.wait_until(lambda s: s.resolve(ENTRY) is not None)
        self._chain_up = True
        self.wake()

    async def _warm_more(self, compute) -> bool:
        """Capture one more step bucket (worker/compute/warm.py); whether any is left."""
        try:
            captured = await compute.call(self.worker.warm_more)
        except trio.ClosedResourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - steps go on in the buckets already captured
            log.error("capture_failed", exc_info=exc)
            return False
        if captured is not None:
            event(log, "captured", bucket=captured[0], seconds=round(captured[1], 3))
        return captured is not None

    def _step_failed(self, step, exc: Exception) -> None:
        error = f"compute failed: {type(exc).__name__}: {exc}"
        requests = list(dict.fromkeys(u.request_id for u in step.units))
        log.error("step_failed", exc_info=exc, extra=as_extra(stage=self.shard.index, requests=requests, error=error))
        for action in self.actor.step_failed(step, error):
            self.post(action)

    def _undeliverable(self, send: Send, error: str) -> None:
        error_event(log, "send_failed", dest=send.dest, kind=type(send.message).__name__, error=error)
        for action in self.actor.undeliverable(send, error):
            self.post(action)

    async def wait_response(self, request_id: str, wait_s: float):
        """A kept response, waiting up to wait_s for it to arrive (a long poll)."""
        return await self.replies.wait(request_id, wait_s)


def reply_target_error(reply_to: str, known: list[str | None]) -> str | None:
    """Why a request may not name `reply_to` (or None): responses go only to the cluster's own members and
    its orchestrator, never to an address a caller makes up (the exit node would POST wherever it is told)."""
    if reply_to.rstrip("/") in {addr.rstrip("/") for addr in known if addr}:
        return None
    return f"reply_to: {reply_to[:100]!r} is not the advertised address of a member of this cluster"
