"""What a person watching a boot sees: each stage's phase as gossip reports it, one line per change, instead of
one "waiting for N stages" line for the whole boot (issue 36). A stage is `listening` once its member is in the
runner's view (it listens, and is loading its slice), and `ready` once it says its slice is loaded."""
from __future__ import annotations

import time
from typing import Callable

from node.membership.gossip import State


def stage_phases(members, num_stages: int) -> dict[int, str]:
    """Pure: each stage's phase from gossip's members ("listening", "ready"); a stage with no live member is
    absent."""
    phases: dict[int, str] = {}
    for m in members:
        stage = m.meta.stage
        if stage is None or not 0 <= stage < num_stages or m.state is not State.ALIVE:
            continue
        phase = "ready" if m.meta.ready else "listening"
        if phases.get(stage) != "ready":
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
            what = "loaded its slice" if phase == "ready" else "listens and joined gossip; loading its slice"
            progress(f"stage {stage}: {what} (+{time.monotonic() - started:.1f} s)")
        seen = now
