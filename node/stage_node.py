"""A stage at run time: admits messages for its actor, runs its batched steps on the compute thread one
after another, and hands what each step produces to the links, which send it without holding up the
next step. Replies go to whoever asked, or are kept here for an asker behind NAT to fetch
(node/transport/replies.py); the node's figures are node/observe/figures.py's.

A step whose compute raises fails the requests in it, each answered with the stage and the error, and the
stage goes on with the next step: one request's failure is that request's alone, and a process that died of
it would only be replaced and handed the request again. Cancellation and other BaseExceptions still end
the loop."""
from __future__ import annotations

import collections
import logging
import resource

import trio

from roles import DEFAULT_MAX_QUEUE, make_actor
from roles.actions import Progress, Refused, Send, failure
from roles.topology import stage_name
from worker.partition import role_of

from node.membership.gossip import State
from node.membership.swim import Swim
from node.observe import hops
from node.observe.figures import StageFigures
from node.observe.log import as_extra, error_event, event
from node.observe.metrics import NodeMetrics
from node.transport import wire
from node.transport.client import PeerClient
from node.transport.faults import NONE as NO_FAULTS, Faults
from node.transport.app import still_loading
from node.transport.links import Links
from node.transport.replies import KEPT_RESPONSES, Replies
from node.transport.sends import Sender
from node.transport.streams import LinkReceiver, LinkStream

log = logging.getLogger("pp.node")


def _clocked(fn, *args):
    """On the compute thread: fn's result, and when it started and ended there (for the hop figures)."""
    started = hops.now()
    result = fn(*args)
    return result, started, hops.now()


class StageNode:
    def __init__(self, stage: int, num_stages: int, client: PeerClient, *, node_id: str,
                 max_queue: int = DEFAULT_MAX_QUEUE, link_streams: bool = True, faults: Faults = NO_FAULTS,
                 prompt_rows: int | None = None, model_name: str, prefix_cache: bool = True):
        self.stage, self.num_stages, self.node_id = stage, num_stages, node_id
        self.prompt_rows = prompt_rows  # the chunked prefill size (roles/schedule.py)
        self.prefix_cache = prefix_cache  # stage 0 (roles/prefix.py)
        self.client, self.max_queue, self.link_streams, self.faults = client, max_queue, link_streams, faults
        self.name = stage_name(stage)
        self.metrics = NodeMetrics(self._metrics_snapshot, model_name=model_name)  # the API's name for the model
        self.hops = hops.HopStats(observe=lambda link, part, s: self.metrics.hop.labels(link, part).observe(s))
        self.figures = StageFigures(self.metrics)
        self.sender = Sender(client, self._addr_of, source=self.name, stats=self.hops, faults=faults)
        self.replies = Replies(client)
        self.links_in = LinkReceiver()
        self._arrivals: list[tuple[str, float]] = []  # (hop link, when) of messages no step has taken yet
        self._stage_names = frozenset(stage_name(i) for i in range(num_stages))  # the senders hops are kept for
        self.swim: Swim | None = None
        self.worker = None
        self.actor = None  # made with the worker: its size comes from the slice
        self.links: Links | None = None
        self._work = trio.Event()
        self.url: str | None = None  # advertised; the entry's own API requests name it as their reply_to
        self._local: dict[str, trio.MemorySendChannel] = {}  # requests followed here (the OpenAI API)
        self._unfollowed: collections.OrderedDict[str, None] = collections.OrderedDict()  # their late replies

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
        if self.loading:
            return False
        return self.stage != 0 or (bool(self.actor.chain) and not self.actor.paused)

    @property
    def last_answer(self) -> dict:
        """Stage 0: figures of the last answer followed here (the chat page shows them)."""
        return self.figures.last_answer

    @property
    def hidden_dim(self) -> int | None:
        return None if self.worker is None else self.worker.info.hidden_dim

    def attach(self, worker, *, capacity: int | None = None) -> None:
        """The worker is loaded: from now on messages are admitted. `capacity`: see roles.make_actor."""
        self.actor = make_actor(self.stage, self.num_stages, worker, capacity=capacity, max_queue=self.max_queue,
                                node_id=self.node_id, prompt_rows=self.prompt_rows, prefix_cache=self.prefix_cache)
        self.worker = worker

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
        if isinstance(message, wire.InferenceResponse) and message.request_id in self._local:
            self._local[message.request_id].send_nowait(message)  # the final figures of one followed here
            self.figures.answered(message)
            return
        if isinstance(message, wire.InferenceResponse) and message.request_id in self._unfollowed:
            self.figures.answered(message)  # the figures of a request whose asker has had its answer
            return
        if isinstance(message, wire.InferenceRequest) and message.reply_to is not None:
            view = self.swim.members().values() if self.swim is not None else ()
            known = [m.addr for m in view if m.state in (State.ALIVE, State.SUSPECT)]
            if (error := reply_target_error(message.reply_to, [*known, self.url])) is not None:
                raise Refused(400, error)
        for action in self.actor.admit(message):
            self._post(action)
        if isinstance(message, wire.InferenceRequest) and self.stage == 0:
            self.figures.admitted(message.request_id, self.actor.prompt_tokens(message.request_id))
        self._work.set()

    def _metrics_snapshot(self) -> dict:
        view = self.swim.members().values() if self.swim is not None else ()
        health = self.actor.health() if self.actor is not None else {}
        return {"running": health.get("slots", {}).get("active") if self.stage == 0 else None,
                "queued": health.get("queue", {}).get("waiting"), "prefix_cache": health.get("prefix_cache"),
                **self._memory(),
                "members": collections.Counter(m.state.value for m in view)}

    def _memory(self) -> dict:
        """The memory figures of /health and of the metrics' gauges: weights, KV caches, slots held, peak RSS."""
        info = self.worker.info if self.worker is not None else None
        return {"weight_bytes": info.weight_bytes if info else None, "kv_bytes": info.kv_bytes if info else None,
                "slots_in_use": self.worker.slots_in_use if self.worker is not None else None,
                "slots_kept": self.worker.kept_count if self.worker is not None else None,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # ru_maxrss is KiB

    def open_local(self, request: wire.InferenceRequest,
                   into: trio.MemorySendChannel | None = None) -> trio.MemoryReceiveChannel | None:
        """Admit a request made here (the OpenAI API) and follow it: the channel gets each Progress of it,
        then the last stage's InferenceResponse (or `into` does, a send channel this node closes with
        close_local). Raises Refused as `deliver` does."""
        send, receive = (into, None) if into is not None else trio.open_memory_channel(float("inf"))
        self._local[request.request_id] = send
        try:
            self.deliver(request)
        except BaseException:
            del self._local[request.request_id]
            send.close()
            raise
        return receive

    def close_local(self, request_id: str, *, cancel: bool) -> None:
        """Stop following a request; with `cancel`, also end it (its asker went away) and free its slots."""
        send = self._local.pop(request_id, None)
        if send is not None:
            send.close()
            self._unfollowed[request_id] = None
            while len(self._unfollowed) > KEPT_RESPONSES:
                self._unfollowed.popitem(last=False)
        if cancel and self.actor is not None:
            self.deliver(wire.CancelRequest(request_id))

    def take_frame(self, link_id: str, source: str, seq: int, sent_at: float, message) -> None:
        """A frame of a link stream: delivered once (a resent one is skipped). A refusal cannot be answered
        on the stream, so this stage reports the failure of the frame's requests to stage 0 itself. So it
        does when taking the message raises anything else: a fault here is the frame's requests' alone (the
        actors fail one request of a message on their own where they can), and the link goes on; the frame
        counts as delivered, so it is never resent."""
        if not self.links_in.fresh(link_id, seq):
            return
        self.links_in.delivered(link_id, seq)
        try:
            self.deliver(message, source=source, sent_at=sent_at)
        except Refused as exc:
            self._refused_on_link(source, message, f"refused {type(message).__name__} from {source}: {exc.message}")
        except Exception as exc:  # noqa: BLE001 - whatever it is: its requests fail, the link and the rest go on
            log.error("link_message_failed", exc_info=exc, extra=as_extra(source=source, seq=seq))
            self._refused_on_link(source, message, f"could not take {type(message).__name__} from {source}: "
                                                   f"{type(exc).__name__}: {exc}")

    def _refused_on_link(self, source: str, message, error: str) -> None:
        kind = type(message).__name__
        error_event(log, "link_message_refused", source=source, kind=kind, error=error)
        if isinstance(message, wire.Activation):
            lives = [(s.request_id, s.generation) for s in message.meta.segments]
        elif isinstance(message, wire.NextTokens):
            lives = [(t.request_id, t.generation) for t in message.tokens]
        else:
            return  # an end or a failure report: nothing further to end
        for rid, generation in dict.fromkeys(lives):
            end = failure(rid, self.stage, error, generation)
            if self.stage == 0:
                try:
                    self.deliver(end)
                except Refused:
                    pass
                except Exception as exc:  # noqa: BLE001 - ending one request must not stop the others ending
                    log.error("link_failure_not_ended", exc_info=exc, extra=as_extra(request=rid))
            else:
                self.links.post(Send(stage_name(0), end))

    def _post(self, action) -> None:
        if isinstance(action, Progress):
            self.figures.progressed(action)
            follower = self._local.get(action.request_id)
            if follower is not None:
                follower.send_nowait(action)
            return
        self.links.post(action)

    def health(self) -> dict:
        info = self.worker.info if self.worker is not None else None
        return {"ok": True, "node": self.node_id, "stage": self.stage, "role": self._role(),
                "ready": info is not None, "layers": [info.layers.start, info.layers.stop] if info else None,
                "max_seqs": info.max_seqs if info else None, "max_batch": info.max_batch if info else None,
                **self._memory(),
                "followed": len(self._local),  # stage 0: API requests whose asker is still being answered
                **self.figures.health(),
                **(self.actor.health() if self.actor else {}),
                "links": self.links.pending() if self.links else {},
                "link_streams": {d: s.opened for d, s in self.links.streams.items()} if self.links else {}}

    def _role(self) -> str:
        return role_of(self.stage, self.num_stages).value

    async def run(self, compute, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Open the links, follow the chain's membership, report started, then compute steps until
        cancelled."""
        async with trio.open_nursery() as nursery:
            self.links = Links(nursery, self.sender.send, self._undeliverable, self.replies.send, self._open_stream)
            if self.swim is not None:
                nursery.start_soon(self._follow_chain if self.stage == 0 else self._follow_entry)
            task_status.started()
            await self._compute_loop(compute)

    async def _follow_chain(self) -> None:
        """Stage 0: tell the actor who holds the rest of the chain, on every change (it pauses while a stage
        is missing and replays its requests through a replacement)."""
        seen = None
        while True:
            view = await self.swim.wait_until(lambda s: (v := chain_view(s, self.num_stages)) != seen and v)
            seen = view
            chain, standing = view
            replays = self.actor.health()["replays"]
            for action in self.actor.set_chain(chain, standing=standing):
                self._post(action)
            self._work.set()
            event(log, "chain", members=list(chain) if chain else None, standing=standing,
                  admitting=not self.actor.paused, replayed=self.actor.health()["replays"] - replays)

    async def _follow_entry(self) -> None:
        """Stages 1..: when another member takes over stage 0, the requests of the one before are gone with
        it: free their slots here."""
        owner = None
        while True:
            entry = await self.swim.wait_until(
                lambda s: (m := s.resolve(stage_name(0))) is not None and m.meta.ready and m.id != owner and m)
            if owner is not None:
                self.actor.entries.forget_except(entry.id)
                self._work.set()
                event(log, "entry_replaced", old=owner, new=entry.id)
            owner = entry.id

    async def _compute_loop(self, compute) -> None:
        while True:
            step = self.actor.plan()
            if step is None:
                await self._work.wait()
                self._work = trio.Event()
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
            self.figures.stepped(sum(u.rows for u in step.units), ran_to - ran_from, resumed - started)
            for action in self.actor.finish(step, outcome):
                self._post(action)

    def _step_failed(self, step, exc: Exception) -> None:
        error = f"compute failed: {type(exc).__name__}: {exc}"
        requests = list(dict.fromkeys(u.request_id for u in step.units))
        log.error("step_failed", exc_info=exc, extra=as_extra(stage=self.stage, requests=requests, error=error))
        for action in self.actor.step_failed(step, error):
            self._post(action)

    def _open_stream(self, dest: str) -> LinkStream | None:
        """The next stage (the last stage: stage 0) gets a link stream; askers get POSTs."""
        if not (self.link_streams and dest.startswith("pp-stage-")):
            return None
        return LinkStream(dest, source=self.name, resolve=self._addr_of, client=self.client.http, stats=self.hops,
                          on_lost=lambda messages, error: self.links.lost(dest, messages, error),
                          still_live=self._still_live, faults=self.faults, moved=self._moved,
                          on_refused=lambda message, error: self._refused_on_link(self.name, message, error))

    def _addr_of(self, name: str) -> str | None:
        """The address of the member holding `name` (a registry name), or None."""
        member = self.swim.resolve(name)
        return None if member is None else member.addr

    async def _moved(self, name: str, addr: str) -> None:
        """Until the member at `addr` no longer holds `name` (declared dead, or replaced)."""
        await self.swim.wait_until(lambda s: (m := s.resolve(name)) is None or m.addr != addr)

    def _still_live(self, message):
        """The part of a message that concerns requests still live here, or None."""
        if isinstance(message, wire.Activation):
            rows = [(s, h) for s, h in message.split() if self.actor.is_live(s.request_id, s.generation)]
            return wire.Activation.of(rows) if rows else None
        if isinstance(message, wire.NextTokens):
            tokens = tuple(t for t in message.tokens if self.actor.is_live(t.request_id, t.generation))
            return wire.NextTokens(tokens) if tokens else None
        return None  # an end, or a failure report: the new peer never knew the request

    def _undeliverable(self, send: Send, error: str) -> None:
        error_event(log, "send_failed", dest=send.dest, kind=type(send.message).__name__, error=error)
        for action in self.actor.undeliverable(send, error):
            self._post(action)

    async def wait_response(self, request_id: str, wait_s: float) -> wire.InferenceResponse | None:
        """A kept response, waiting up to wait_s for it to arrive (a long poll)."""
        return await self.replies.wait(request_id, wait_s)


def chain_view(swim: Swim, num_stages: int) -> tuple[tuple[str, ...] | None, bool]:
    """Stage 0's view of stages 1..: the ids of the ready members holding them (None while one is missing
    or still loading), and whether all of them are alive (none suspected)."""
    members = [swim.resolve(stage_name(i)) for i in range(1, num_stages)]
    if any(m is None or not m.meta.ready for m in members):
        return None, False
    return tuple(m.id for m in members), all(m.state is State.ALIVE for m in members)


def reply_target_error(reply_to: str, known: list[str | None]) -> str | None:
    """Why a request may not name `reply_to` (or None): responses go only to the cluster's own members and
    its orchestrator, never to an address a caller makes up (the exit node would POST wherever it is told)."""
    if reply_to.rstrip("/") in {addr.rstrip("/") for addr in known if addr}:
        return None
    return f"reply_to: {reply_to[:100]!r} is not the advertised address of a member of this cluster"
