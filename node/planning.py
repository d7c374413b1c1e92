"""How a node learns its blocks at boot with `--layer-partition auto` (issue 37), in two steps: it measures itself
(worker/calibrate.py) and gossips the figures (Meta.cost); then stage 0, once every stage's figures are in its
view, plans the split (worker/plan.py) and gossips it (Meta.plan), and every other stage loads its range of it.
Each node gossips the split it loaded, so a node that boots into a running cluster (a replacement) keeps it and
takes the range of the stage it replaces, without measuring itself first: a new plan would reload every stage
that lives and drop the KV of the requests they hold, and measuring would lengthen the lost stage's gap. It says
so (Split.reason).

Nodes that share a machine's cores (Meta.machine) would time their contention if each timed itself while the
others boot: the lowest stage on a machine times it for all of them, and where every stage shares one machine
(ppsmoke --seed) none is timed at all (`measurer`).

The decisions are pure functions of the view (table tests: tests/test_planning.py); `agree` waits on gossip."""
from __future__ import annotations

from collections.abc import Iterable

from worker.plan import Calibration, Objective, PlanError, Split, partition_of, stage_seconds

from node.membership.gossip import TERMINAL, Member
from node.membership.swim import Swim


def gossiped_plan(members: Iterable[Member], me: str, num_stages: int) -> tuple[int, ...] | None:
    """Pure: the cluster's split, from stage 0 alone: its live holder's, unless that is `me`; where none is (stage
    0 itself is being replaced), the one every other live stage holder loaded, if they agree. A member that holds
    no stage (an observer, or a forged member gossiping a plan: issue 54) is never asked."""
    holders = {s: h for s, h in _holders(members, num_stages).items() if h.id != me}
    plans = {s: h.meta.plan for s, h in holders.items() if len(h.meta.plan) == num_stages}
    if 0 in holders:
        return plans.get(0)
    return next(iter(plans.values())) if plans and len(set(plans.values())) == 1 else None


def overlapping(plan: tuple[int, ...], members: Iterable[Member], me: str, stage: int) -> str | None:
    """Pure: why a replacement of `stage` must not load its range of `plan`: a live neighbour loaded another split,
    so the ranges would overlap or leave blocks out (every block computed once, in order, or the answer is
    wrong); None where no neighbour says otherwise."""
    holders = {s: h for s, h in _holders(members, len(plan)).items() if h.id != me}
    for s in (stage - 1, stage + 1):
        theirs = holders[s].meta.plan if s in holders else ()
        if len(theirs) == len(plan) and theirs != plan:
            return (f"the split {','.join(map(str, plan))} gives stage {stage} blocks that its live neighbour, stage "
                    f"{s}, did not leave it (it loaded {','.join(map(str, theirs))})")
    return None


def gossiped_kernels(members: Iterable[Member], num_stages: int) -> tuple[str | None, ...]:
    """Pure: what each stage's live holder computes with, as it gossips it (None: not said yet)."""
    holders = _holders(members, num_stages)
    return tuple(holders[i].meta.kernels if i in holders else None for i in range(num_stages))


def _holders(members: Iterable[Member], num_stages: int) -> dict[int, Member]:
    """Pure: each stage's live holder (the latest incarnation where several hold it); the runner holds none."""
    found: dict[int, Member] = {}
    for m in members:
        stage = m.meta.stage
        if m.state in TERMINAL or m.meta.observer or stage is None or not 0 <= stage < num_stages:
            continue
        if stage not in found or m.incarnation > found[stage].incarnation:
            found[stage] = m
    return found


def gossiped_costs(members: Iterable[Member], num_stages: int) -> list[Calibration] | None:
    """Pure: each stage's figures, in stage order, from the live members that hold it (the latest incarnation
    where several do), or None until every stage has some."""
    found = _holders((m for m in members if m.meta.cost is not None), num_stages)
    if len(found) < num_stages:
        return None
    return [found[s].meta.cost for s in range(num_stages)]


def stage_machines(members: Iterable[Member], num_stages: int) -> list[str | None] | None:
    """Pure: each stage's machine (Meta.machine; None: unknown, its own) from its live holder, or None until
    every stage has one."""
    found = _holders(members, num_stages)
    return None if len(found) < num_stages else [found[s].meta.machine for s in range(num_stages)]


def stages_on(members: Iterable[Member], num_stages: int, machine: str | None) -> int:
    """Pure: how many stages' live holders compute on `machine` (Meta.machine), this node's among them: at
    least 1 (None: its own machine, shared with no one it knows of)."""
    if machine is None:
        return 1
    return max(1, sum(m.meta.machine == machine for m in _holders(members, num_stages).values()))


def measurer(machines: list[str | None], stage: int) -> int | None:
    """Pure: the stage that times `stage`'s machine: the lowest stage on it, since nodes that share cores,
    timed at once, would time their contention, not their speed; None where every stage shares it: they are
    one speed by construction, and nothing needs timing (the head is weighed by its bytes)."""
    mine = machines[stage]
    if mine is None:
        return stage
    if all(m == mine for m in machines):
        return None
    return min(i for i, m in enumerate(machines) if m == mine)


def measured_by(members: Iterable[Member], stage: int, num_stages: int) -> Calibration | None:
    """Pure: the figures `stage`'s live holder gossips, or None until it has measured."""
    found = _holders((m for m in members if m.meta.cost is not None), num_stages)
    return found[stage].meta.cost if stage in found else None


def planned(costs: list[Calibration], objective: Objective = Objective.THROUGHPUT, *,
            one_machine: bool = False) -> Split:
    """Pure: stage 0's decision from every stage's figures (`one_machine`: every stage shares one machine, and
    none was timed). PlanError where no split fits."""
    counts = partition_of(costs, objective)
    if one_machine:
        return Split(counts, "auto", f"every stage shares one machine's cores, so they count as one speed: "
                                     f"the even split, less the head's weight in blocks by bytes: {describe(costs, counts)}")
    return Split(counts, "auto", f"planned for {objective.value} from each stage's measured step: "
                                 f"{describe(costs, counts)}")


def kept(plan: tuple[int, ...], stage: int) -> Split:
    """Pure: a node that replaces a stage of a running cluster keeps its split, without measuring itself first
    (a lost stage's gap is what counts then: issue 36)."""
    return Split(plan, "kept", f"kept the running cluster's split and took stage {stage}'s blocks: a new plan "
                               f"would reload the {len(plan) - 1} stages that live and drop the KV of every "
                               f"request they hold")


def describe(costs: list[Calibration], counts: tuple[int, ...]) -> str:
    """Pure: each stage's blocks, ms a block and estimated ms a step, in one line."""
    parts = []
    for i, (c, k, s) in enumerate(zip(costs, counts, stage_seconds(costs, counts))):
        block = "unmeasured" if c.block_s is None else f"{c.block_s * 1000:.2f} ms/block"
        head = f" + head {c.head_s * 1000:.2f} ms" if i == len(counts) - 1 and c.head_s is not None else ""
        parts.append(f"stage {i}: {k} blocks at {block}{head}" + ("" if s is None else f" = {s * 1000:.1f} ms"))
    return "; ".join(parts)


def held(swim: Swim, stage: int, num_stages: int, *, replacing: bool) -> Split | None:
    """The running cluster's split, kept, where this node replaces a stage of it (gossip holds the stage's
    gone holder, and stage 0's split); else None: the node measures itself and agrees (agree). PlanError where
    a live neighbour loaded another split: the node refuses to load a range that overlaps it."""
    view = swim.members().values()
    plan = gossiped_plan(view, swim.me.id, num_stages) if replacing else None
    if plan is None:
        return None
    if (why := overlapping(plan, view, swim.me.id, stage)) is not None:
        raise PlanError(why)
    return kept(plan, stage)


async def agree(swim: Swim, stage: int, num_stages: int, calibration: Calibration,
                objective: Objective = Objective.THROUGHPUT, *, one_machine: bool = False) -> Split:
    """Gossip this node's figures, then wait for the split: stage 0's plan, or, on stage 0, its own once every
    stage's figures are in (or a split another live member gossips: stage 0 itself was replaced meanwhile).
    Gossips the split it returns."""
    swim.update_meta(cost=calibration)

    def ready(s: Swim):
        view = s.members().values()
        held = gossiped_plan(view, s.me.id, num_stages)
        if held is not None:
            return "held", held
        costs = gossiped_costs(view, num_stages) if stage == 0 else None
        return ("costs", costs) if costs is not None else None

    kind, found = await swim.wait_until(ready)
    split = planned(found, objective, one_machine=one_machine) if kind == "costs" else \
        Split(found, "auto", "planned by stage 0, " + ("every stage on one machine, none timed" if one_machine
                                                       else "from each stage's measured step"))
    swim.update_meta(plan=split.counts)
    return split
