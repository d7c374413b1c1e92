"""What pp-entry's chat page shows of the pipeline (`GET /v1/pipeline`): one entry per stage with the state
gossip gives its node (alive, suspect, dead, loading with its download progress), the blocks it holds and what
its node measured of itself to plan them (ms a block, the head's, memory), its compute per token in the last answer, and the median time a message spent on the wire into it (asked of
the stage itself, `GET /v1/hops`, with a short timeout: a stage that does not answer shows none).

The asks are HopFigures': at most one gathering at a time, shared by the views that come meanwhile and kept for
HOPS_FRESH_S, so a key holder's flood of views makes no more internal traffic than one viewer; and they go
through an HTTP/1.1 client of their own (node/transport/client.py's http1_client), never the pipeline's HTTP/2
one: an ask cut off by its timeout there would wedge the connection the link stream uses."""
from __future__ import annotations

import httpx
import trio

from roles.topology import stage_name

from node.api.entry import Entry
from node.membership.gossip import State

HOPS_TIMEOUT_S = 0.5  # an ask for a stage's hop figures; a stage slower than that shows none
HOPS_FRESH_S = 1.0  # hop figures gathered this recently serve every view


def stage_state(member) -> str:
    """alive, suspect, dead or left as gossip says; `loading` for an alive node that is not ready yet."""
    if member is None:
        return "missing"
    if member.state is State.ALIVE and not member.meta.ready:
        return "loading"
    return member.state.value


def stages_view(node: Entry, last_ms_per_token: list[float] | None) -> list[dict]:
    """Pure: the stages as gossip and the entry's last answer see them."""
    counts = node.split.counts
    members = {m.meta.stage: m for m in sorted(node.swim.members().values(), key=lambda m: m.incarnation)
               if m.meta.stage is not None}  # the latest holder of each stage
    out = []
    for stage in range(len(counts)):
        member = node.swim.resolve(stage_name(stage)) or members.get(stage)
        layers = range(sum(counts[:stage]), sum(counts[:stage + 1]))
        out.append({"stage": stage, "state": stage_state(member), "node": member.id if member else None,
                    "addr": member.addr if member else None, "progress": member.meta.progress if member else None,
                    "blocks": [layers.start, layers.stop], **measured(member, len(layers), stage == len(counts) - 1),
                    "compute_ms_per_token": (round(last_ms_per_token[stage], 2)
                                             if last_ms_per_token and stage < len(last_ms_per_token) else None),
                    "hop_in_ms": None})
    return out


def measured(member, blocks: int, last: bool) -> dict:
    """Pure: what the stage's node measured of itself at boot (--layer-partition auto; node/planning.py): ms a
    block and the head's (the last stage's), the memory it said it may fill, and the step that makes for its
    blocks; None where it measured nothing."""
    cost = member.meta.cost if member is not None else None
    if cost is None or cost.block_s is None:
        return {"block_ms": None, "head_ms": None, "memory_bytes": cost.memory_bytes if cost else None,
                "planned_step_ms": None}
    step = blocks * cost.block_s + (cost.head_s if last else 0.0)
    return {"block_ms": round(cost.block_s * 1000, 3), "head_ms": round(cost.head_s * 1000, 3) if last else None,
            "memory_bytes": cost.memory_bytes, "planned_step_ms": round(step * 1000, 2)}


def split_view(split) -> dict:
    """Pure: the split the chain runs, how it was chosen and why."""
    return {"counts": list(split.counts), "how": split.how, "reason": split.reason}


def askable(entry: dict) -> bool:
    """Pure: whether the view asks this stage for its hop figures (the hop into it; stage 0 has none)."""
    return entry["stage"] != 0 and entry["addr"] is not None and entry["state"] in ("alive", "suspect")


def fresh(gathered: tuple[float, tuple] | None, asked: tuple, now: float) -> bool:
    """Pure: whether figures gathered (at, of which stages) still serve a view that would ask `asked` now."""
    return gathered is not None and gathered[1] == asked and now - gathered[0] < HOPS_FRESH_S


class HopFigures:
    """The median wire time into each stage, asked of the stages: one gathering at a time, shared and kept
    for HOPS_FRESH_S. `client` must be one whose requests may be cancelled (HTTP/1.1; see the module doc)."""

    def __init__(self, client: httpx.AsyncClient):
        self._client = client  # a member's: its certificate opens /v1/hops
        self._gathered: tuple[float, tuple] | None = None  # (when, of which (stage, addr)) of self._figures
        self._figures: dict[int, float | None] = {}
        self._gathering: trio.Event | None = None

    async def of(self, stages: list[dict]) -> dict[int, float | None]:
        """stage -> the median ms its messages spent on the wire into it, for the askable `stages`."""
        asked, began = tuple((e["stage"], e["addr"]) for e in stages if askable(e)), trio.current_time()
        if fresh(self._gathered, asked, began):
            return self._figures
        while self._gathering is not None:  # another view is gathering: take what it gathers, if of these stages
            await self._gathering.wait()
            if self._gathered is not None and self._gathered[1] == asked and self._gathered[0] >= began:
                return self._figures
        self._gathering = done = trio.Event()
        try:  # if this view is cancelled half way, a waiting one gathers next
            figures = await self._gather(asked)
            self._gathered, self._figures = (trio.current_time(), asked), figures
        finally:
            self._gathering = None
            done.set()
        return figures

    async def _gather(self, asked: tuple) -> dict[int, float | None]:
        figures: dict[int, float | None] = {}

        async def ask(stage: int, addr: str) -> None:
            try:
                r = await self._client.get(addr + "/v1/hops")
                wire = r.json().get(f"from {stage_name(stage - 1)}", {}).get("wire")
            except (httpx.HTTPError, ValueError, AttributeError):
                return
            figures[stage] = round(wire["median_ms"], 2) if wire else None

        with trio.move_on_after(HOPS_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for stage, addr in asked:
                    nursery.start_soon(ask, stage, addr)
        return figures


async def pipeline_view(node: Entry, hops: HopFigures) -> dict:
    stages = stages_view(node, node.last_answer.get("stage_ms_per_token"))
    figures = await hops.of(stages)
    for entry in stages:
        entry["hop_in_ms"] = figures.get(entry["stage"])
    health = node.health()
    return {"stages": stages, "split": split_view(node.split), "admitting": health.get("admitting"), "running": health.get("slots", {}).get("active"),
            "queued": health.get("queue", {}).get("waiting"), "last_answer": node.last_answer}
