"""What a person watching a boot sees: each stage's phase as gossip reports it, one line per change, instead of
one "waiting for N stages" line for the whole boot (issue 36). A stage is `listening` once its member is in the
runner's view (it listens, and is loading its slice), `measured` once it gossips what a block and the head cost
it (--layer-partition auto: it waits for stage 0's plan), and `ready` once it says its slice is loaded. Once the
cluster converged, one line says how the blocks were split and what each stage measured (split_line)."""
from __future__ import annotations

import time
from typing import Callable

from node.membership.gossip import State
from node.planning import gossiped_plan


PHASES = ("listening", "measured", "ready")
WHAT = {"listening": "listens and joined gossip; loading its slice",
        "measured": "sized its slice, untimed; waiting for the plan",
        "ready": "loaded its slice"}


def stage_phases(members, num_stages: int) -> dict[int, str]:
    """Pure: each stage's phase from gossip's members ("listening", "ready"); a stage with no live member is
    absent."""
    phases: dict[int, str] = {}
    for m in members:
        stage = m.meta.stage
        if stage is None or not 0 <= stage < num_stages or m.state is not State.ALIVE:
            continue
        phase = "ready" if m.meta.ready else "measured" if m.meta.cost is not None else "listening"
        if stage not in phases or PHASES.index(phase) > PHASES.index(phases[stage]):
            phases[stage] = phase
    return phases


def news(before: dict[int, str], now: dict[int, str]) -> list[tuple[int, str]]:
    """Pure: the stages whose phase changed, in stage order."""
    return [(stage, phase) for stage, phase in sorted(now.items()) if before.get(stage) != phase]


async def report_phases(swim, num_stages: int, progress: Callable[[str], None], started: float) -> None:
    """Print each stage's phase as it changes, until cancelled (the cluster converged)."""
    seen: dict[int, str] = {}
    while True:
        now = await swim.wait_until(lambda s: (p := stage_phases(s.members().values(), num_stages)) != seen and p)
        for stage, phase in news(seen, now):
            progress(f"stage {stage}: {_said(phase, stage, swim)} (+{time.monotonic() - started:.1f} s)")
        seen = now


def _said(phase: str, stage: int, swim) -> str:
    if phase != "measured":
        return WHAT[phase]
    cost = next((m.meta.cost for m in swim.members().values() if m.meta.stage == stage and m.meta.cost), None)
    if cost is None or cost.block_s is None:
        return WHAT[phase]
    return f"measured {cost.block_s * 1000:.2f} ms a block, {cost.head_s * 1000:.2f} ms the head; waiting for the plan"


def split_line(members, num_stages: int) -> str | None:
    """Pure: how the converged cluster split the blocks (each stage's count) and, where its node measured itself,
    ms a block; None where no member gossips a split."""
    live = [m for m in members if m.state is State.ALIVE and m.meta.stage is not None and m.meta.ready]
    plan = gossiped_plan(live, "", num_stages)
    if plan is None:
        return None
    by_stage = {m.meta.stage: m.meta.cost for m in sorted(live, key=lambda m: m.incarnation)}
    parts = []
    for stage, count in enumerate(plan):
        cost = by_stage.get(stage)
        figure = "" if cost is None or cost.block_s is None else f" at {cost.block_s * 1000:.2f} ms"
        parts.append(f"{count}{figure}")
    return "blocks per stage: " + " / ".join(parts)
