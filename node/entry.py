"""Stage 0's extras, in one object beside the stage driver (node/stage_node.py): the vocabulary the API and
the first actor share, the requests followed for the API (open_local, close_local), and the chain it watches,
pausing admission while a stage is missing and sizing admission by the chain's fewest slots. It is what
node/api/entry.py's Entry describes: the serving surface sees stage 0 through it and nothing else."""
from __future__ import annotations

import logging

from roles import topology
from roles.actions import Progress, Refused
from roles.first import prompt_tokens, settled_chain
from roles.messages import CancelRequest, EndRequest, InferenceRequest, InferenceResponse

from node.follow import Followers, Inbox
from node.kv_memory import chain_positions
from node.membership.gossip import State
from node.observe.log import as_extra, event

log = logging.getLogger("pp.node")


class EntryStage:
    """`node` is stage 0's StageNode; this object is its side (StageSide) and the API's Entry."""

    def __init__(self, node):
        self.node = node
        # requests followed here (the OpenAI API); an asker that reads no further holds its rows
        self.followers = Followers(lambda: node.actor.held if node.actor is not None else set(), node.wake)
        self._settled: tuple[str, ...] = ()  # the actor's settled chain, as last told to gossip

    # -- the API's Entry -----------------------------------------------------------------------
    @property
    def loading(self) -> bool:
        return self.node.loading

    @property
    def vocabulary(self):
        """Text to tokens and back, shared with the first actor; None while loading."""
        worker = self.node.worker
        return None if worker is None else worker.vocabulary

    @property
    def max_seqs(self) -> int | None:
        worker = self.node.worker
        return None if worker is None else worker.info.max_seqs

    @property
    def split(self):
        return self.node.split

    @property
    def url(self) -> str | None:
        return self.node.url

    @property
    def swim(self):
        return self.node.swim

    @property
    def last_answer(self) -> dict:
        return self.node.figures.last_answer

    def health(self) -> dict:
        return self.node.health()

    def open_local(self, request: InferenceRequest, into: Inbox | None = None) -> Inbox:
        """Admit a request made here (the OpenAI API) and follow it: the inbox it returns (`into`, or a new
        one) gets each Progress of it, then the last stage's InferenceResponse, until close_local. Raises
        Refused as StageNode.deliver does."""
        inbox = self.followers.follow(request.request_id, into)
        try:
            self.node.deliver(request)
        except BaseException:
            self.followers.unfollow(request.request_id)
            raise
        return inbox

    def close_local(self, request_id: str, *, cancel: bool) -> None:
        """Stop following a request; with `cancel`, also end it (its asker went away) and free its slots."""
        self.followers.unfollow(request_id)
        if cancel and self.node.actor is not None:
            self.node.deliver(CancelRequest(request_id))

    # -- the driver's side ---------------------------------------------------------------------
    def local(self, message) -> bool:
        """Takes the final answer of a request followed here (and the figures of one whose asker has had its
        answer); anything else is the actor's."""
        if not isinstance(message, InferenceResponse):
            return False
        if self.followers.following(message.request_id):
            self.followers.send(message.request_id, message)
        elif not self.followers.was_followed(message.request_id):
            return False
        self.node.figures.answered(message)
        return True

    def admitted(self, message) -> None:
        if isinstance(message, InferenceRequest):
            self.node.figures.admitted(message.request_id, prompt_tokens(self.node.actor, message.request_id))
        # after every message, not every token: fed-back tokens end a replay, a report of lost rows starts one
        self._settled = tell_settled(self.swim, self.node.actor, self._settled)

    def progressed(self, progress: Progress) -> None:
        self.node.figures.progressed(progress)
        self.followers.send(progress.request_id, progress)

    def report(self, end: EndRequest) -> None:
        """A request failed on a link here: the actor ends it everywhere."""
        try:
            self.node.deliver(end)
        except Refused:
            pass
        except Exception as exc:  # noqa: BLE001 - ending one request must not stop the others ending
            log.error("link_failure_not_ended", exc_info=exc, extra=as_extra(request=end.request_id))

    def serving(self) -> bool:
        """A whole chain stands behind this stage, and the actor admits requests."""
        return bool(self.node.actor.chain) and not self.node.actor.paused

    def running(self, actor_health: dict):
        return actor_health.get("slots", {}).get("active")

    def figures(self) -> dict:
        return self.followers.figures()

    async def ready(self, swim) -> None:
        """Once every stage is ready: admit no more requests at once than the chain's fewest slots, and no more KV
    than the least any stage can hold (roles/kv_budget.py)."""
        count = self.node.shard.count
        await swim.wait_until(lambda s: all(m is not None and m.meta.ready for m in _holders(s, range(count))))
        self.node.actor.capacity = chain_capacity(swim, count) or self.node.worker.info.max_seqs
        holders = [m for m in _holders(swim, range(count)) if m is not None]
        self.node.actor.kv.budget = chain_positions([m.meta.kv_positions for m in holders])

    async def watch(self, swim) -> None:
        """Tell the actor who holds the rest of the chain, on every change (it pauses while a stage is missing
        and replays its requests through a replacement)."""
        node, seen = self.node, None
        while True:
            view = await swim.wait_until(lambda s: (v := chain_view(s, node.shard.count)) != seen and v)
            seen = view
            chain, standing = view
            replays = node.actor.health()["replays"]
            for action in node.actor.set_chain(chain, standing=standing):
                node.post(action)
            self._settled = tell_settled(swim, node.actor, self._settled)
            node.wake()
            event(log, "chain", members=list(chain) if chain else None, standing=standing,
                  admitting=not node.actor.paused, replayed=node.actor.health()["replays"] - replays)


def tell_settled(swim, actor, told: tuple[str, ...]) -> tuple[str, ...]:
    """Gossip stage 0's chain once its replays are over (Meta.settled, roles.first.settled_chain) where that
    changed from `told`; returns what gossip holds now."""
    now = settled_chain(actor)
    if now == told or swim is None:
        return told
    swim.update_meta(settled=now)
    return now


def _holders(swim, stages):
    return [swim.resolve(topology.stage_name(i)) for i in stages]


def chain_view(swim, num_stages: int) -> tuple[tuple[str, ...] | None, bool]:
    """Stage 0's view of stages 1..: the ids of the ready members holding them (None while one is missing
    or still loading), and whether all of them are alive (none suspected)."""
    members = _holders(swim, range(1, num_stages))
    if any(m is None or not m.meta.ready for m in members):
        return None, False
    return tuple(m.id for m in members), all(m.state is State.ALIVE for m in members)


def chain_capacity(swim, num_stages: int) -> int | None:
    """The fewest sequence slots any stage of the chain has: stage 0 admits no more requests at once."""
    slots = [m.meta.max_seqs for m in _holders(swim, range(num_stages))
             if m is not None and m.meta.max_seqs is not None]
    return min(slots) if slots else None
