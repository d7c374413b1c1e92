"""What pp-entry's chat page shows of the pipeline (`GET /v1/pipeline`): one entry per stage with the state
gossip gives its node (alive, suspect, dead, loading with its download progress), the blocks it holds, its
compute per token in the last answer, and the median time a message spent on the wire into it (asked of
the stage itself, `GET /v1/hops`, with a short timeout: a stage that does not answer shows none)."""
from __future__ import annotations

import httpx
import trio

from roles.topology import stage_name
from worker.partition import layer_range

from node.api.entry import Entry
from node.membership.gossip import State

HOPS_TIMEOUT_S = 0.5


def stage_state(member) -> str:
    """alive, suspect, dead or left as gossip says; `loading` for an alive node that is not ready yet."""
    if member is None:
        return "missing"
    if member.state is State.ALIVE and not member.meta.ready:
        return "loading"
    return member.state.value


def stages_view(node: Entry, last_ms_per_token: list[float] | None) -> list[dict]:
    """Pure: the stages as gossip and the entry's last answer see them."""
    total = node.worker.info.total_blocks
    members = {m.meta.stage: m for m in sorted(node.swim.members().values(), key=lambda m: m.incarnation)
               if m.meta.stage is not None}  # the latest holder of each stage
    out = []
    for stage in range(node.num_stages):
        member = node.swim.resolve(stage_name(stage)) or members.get(stage)
        layers = layer_range(total, stage, node.num_stages)
        out.append({"stage": stage, "state": stage_state(member), "node": member.id if member else None,
                    "addr": member.addr if member else None, "progress": member.meta.progress if member else None,
                    "blocks": [layers.start, layers.stop],
                    "compute_ms_per_token": (round(last_ms_per_token[stage], 2)
                                             if last_ms_per_token and stage < len(last_ms_per_token) else None),
                    "hop_in_ms": None})
    return out


async def pipeline_view(node: Entry, client: httpx.AsyncClient, token: str) -> dict:
    stages = stages_view(node, node.last_answer.get("stage_ms_per_token"))

    async def hop_into(entry: dict) -> None:
        if entry["stage"] == 0 or entry["addr"] is None or entry["state"] not in ("alive", "suspect"):
            return
        with trio.move_on_after(HOPS_TIMEOUT_S):
            try:
                r = await client.get(entry["addr"] + "/v1/hops", headers={"Authorization": f"Bearer {token}"})
                wire = r.json().get(f"from {stage_name(entry['stage'] - 1)}", {}).get("wire")
            except (httpx.HTTPError, ValueError):
                return
            entry["hop_in_ms"] = round(wire["median_ms"], 2) if wire else None

    async with trio.open_nursery() as nursery:
        for entry in stages:
            nursery.start_soon(hop_into, entry)
    health = node.health()
    return {"stages": stages, "admitting": health.get("admitting"), "running": health.get("slots", {}).get("active"),
            "queued": health.get("queue", {}).get("waiting"), "last_answer": node.last_answer}
