"""The planner (the spec's rung 5, issue 37): each stage's contiguous share of a model's blocks, from what each
node measured of itself, with the embedding and the head charged to the stages that hold them. Pure.

A Llama model's blocks all have one shape, so one calibrated block stands for every block: a stage of k blocks
costs k × its node's `block_s`, plus the head's step on the last stage. The embedding is a row lookup on the
host and costs nothing measurable; its table is charged to stage 0's memory only.

Objectives (named, as the issue asks):
- THROUGHPUT (the default): the slowest stage's time. With many streams in flight every stage works at once,
  and the pipeline moves at its slowest stage's pace.
- LATENCY: the sum of the stages' times, what one stream alone waits per token.
A tie on the objective goes to the other one, and then to the split nearest the spec's (total // N each, the
first total % N one more; by the sum of squared differences in blocks), so equal nodes with no head to weigh
get exactly the spec's split.

Measured block times within SAME_SPEED of the fastest count as one speed (measurement noise on shared machines),
each node keeping its measured head-to-block ratio.

Where any node's figures are missing, every node counts as equal (a block costs 1, the head its weight in
blocks by bytes), so the plan differs from the spec's split only by the head's weight.
"""
from __future__ import annotations

import enum
import math

import attrs

from .partition import layer_range


EPS = 1e-12  # seconds: stage times this close are equal
# Block times within this share of the fastest node's count as one speed. Two nodes on one 2-core VM, each
# measuring itself at once, measured 2.33 and 2.67, 4.30 and 3.09, 3.65 and 3.14 ms a block in three rounds
# (bench.plan, docs/plan-smollm2-equal-machines-noband.json): the vCPUs' steal differs for seconds at a time, and those
# splits (19/11, 15/15, 16/14) followed the noise. A machine 1.4x slower than the fastest is thus planned as an
# equal one (at most ~15% below the best split); the differences the planner is for (a CPU quota, a laptop
# beside a desktop, GPU generations) are 1.5-3x.
SAME_SPEED = 0.4


class Objective(enum.Enum):
    THROUGHPUT = "throughput"
    LATENCY = "latency"


@attrs.frozen
class NodeCost:
    """What a node measured of itself: one block's step and the head's step (seconds, at the bucket it will
    use; None: not measured), and the bytes it may hold for weights and KV (None: unbounded)."""

    block_s: float | None = None
    head_s: float | None = None
    memory_bytes: int | None = None


def _count(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    """A byte or block count from a peer: a non-negative int (bool is no count)."""
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"{type(instance).__name__}.{attribute.name}={value!r}: expected a count >= 0")


def _seconds(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    """A measured time from a peer: finite and non-negative, or None (not measured)."""
    if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value < 0):
        raise ValueError(f"{type(instance).__name__}.{attribute.name}={value!r}: expected finite seconds >= 0")


@attrs.frozen
class ModelCost:
    """What a model asks of a stage: its blocks, the bytes one block needs (weights and its KV), and the
    embedding's and the head's bytes (a tied head shares the embedding's: give 0 for one of them)."""

    blocks: int = attrs.field(validator=_count)
    block_bytes: int = attrs.field(validator=_count)
    embed_bytes: int = attrs.field(default=0, validator=_count)
    head_bytes: int = attrs.field(default=0, validator=_count)


@attrs.frozen
class Calibration:
    """What a node measured of itself before it was given blocks (worker/calibrate.py), as gossip carries it
    (node.membership.gossip.Meta.cost): one block's step and the head's at `rows` decode rows (None: nothing
    to measure, the stub), the bytes it may hold (None: unbounded), and what the model asks of a stage."""

    block_s: float | None = attrs.field(validator=_seconds)
    head_s: float | None = attrs.field(validator=_seconds)
    rows: int = attrs.field(validator=_count)
    memory_bytes: int | None = attrs.field(validator=_count)
    model: ModelCost

    @property
    def node(self) -> NodeCost:
        return NodeCost(self.block_s, self.head_s, self.memory_bytes)


@attrs.frozen
class Split:
    """The split a node loaded its range of: each stage's block count, how it was chosen (`auto`: planned from
    measured figures; `kept`: the running cluster's, by a node that joined it; `equal` or `given`: the flag's),
    and why, in words (node/planning.py)."""

    counts: tuple[int, ...]
    how: str
    reason: str


class PlanError(ValueError):
    """No partition fits: more stages than blocks, or not enough memory."""


def plan(nodes: list[NodeCost], model: ModelCost, objective: Objective = Objective.THROUGHPUT) -> tuple[range, ...]:
    """Each stage's blocks, in order: contiguous ranges covering the model, at least one block each, none
    over its node's memory, at the least cost for `objective` (ties: the other objective, then the spec's
    split). PlanError where no partition fits."""
    n = len(nodes)
    if n < 1 or model.blocks < n:
        raise PlanError(f"{model.blocks} blocks cannot be split over {n} stages (each needs at least one)")
    block_s, head_s = _costs(nodes, model)
    spec = [len(layer_range(model.blocks, i, n)) for i in range(n)] if n >= 2 else [model.blocks]
    most = [_most_blocks(i, nodes[i], model, n) for i in range(n)]
    best = _search(n, model.blocks, block_s, head_s, most, spec, objective)
    if best is None:
        raise PlanError(f"{model.blocks} blocks do not fit the {n} nodes' memory (at most {most} blocks each)")
    ranges, lo = [], 0
    for count in best:
        ranges.append(range(lo, lo + count))
        lo += count
    return tuple(ranges)


def partition_of(calibrations: list[Calibration], objective: Objective = Objective.THROUGHPUT) -> tuple[int, ...]:
    """Each stage's block count, planned from every stage's calibration in stage order (the model's cost is
    the first stage's: every node opened the same model). PlanError where none fits, or where the stages
    measured different models."""
    model = calibrations[0].model
    if any(c.model.blocks != model.blocks for c in calibrations):
        raise PlanError(f"the stages opened different models: {sorted({c.model.blocks for c in calibrations})} "
                        f"blocks")
    return tuple(len(r) for r in plan([c.node for c in calibrations], model, objective))


def stage_seconds(calibrations: list[Calibration], counts: tuple[int, ...]) -> list[float | None]:
    """What each stage of `counts` costs a step at its node's figures, the head on the last (None where a
    node measured nothing): the planner's estimate, shown beside the split."""
    out = []
    for i, (c, k) in enumerate(zip(calibrations, counts)):
        last = i == len(counts) - 1
        out.append(None if c.block_s is None or c.head_s is None else k * c.block_s + (c.head_s if last else 0.0))
    return out


def _costs(nodes: list[NodeCost], model: ModelCost) -> tuple[list[float], float | list[float]]:
    """Each node's block seconds and the head's seconds on each; where any figure is missing, equal nodes:
    a block 1, the head its bytes in blocks."""
    if any(c.block_s is None or c.head_s is None for c in nodes):
        head = model.head_bytes / model.block_bytes if model.block_bytes else 0.0
        return [1.0] * len(nodes), [head] * len(nodes)
    return _alike([c.block_s for c in nodes], [c.head_s for c in nodes])


def _alike(block_s: list[float], head_s: list[float]) -> tuple[list[float], list[float]]:
    """Nodes whose block is within SAME_SPEED of the fastest's count as one speed, their mean; each keeps its
    own head-to-block ratio, which varies far less between measurements than the speed does."""
    fastest = min(block_s)
    alike = [b for b in block_s if b <= fastest * (1 + SAME_SPEED)]
    mean = sum(alike) / len(alike)
    out_block = [mean if b <= fastest * (1 + SAME_SPEED) else b for b in block_s]
    return out_block, [h * nb / b if b else h for h, nb, b in zip(head_s, out_block, block_s)]


def _most_blocks(i: int, node: NodeCost, model: ModelCost, n: int) -> int:
    """The most blocks node i can hold beside its embedding (stage 0) or head (the last stage)."""
    if node.memory_bytes is None:
        return model.blocks
    extra = (model.embed_bytes if i == 0 else 0) + (model.head_bytes if i == n - 1 else 0)
    room = node.memory_bytes - extra
    return max(0, min(model.blocks, room // model.block_bytes if model.block_bytes else model.blocks))


def _search(n, total, block_s, head_s, most, spec, objective):
    """The split, by dynamic programming in two steps. THROUGHPUT: the least cap on a stage's time that some
    split meets (searched over every stage time there can be), then, under that cap, the least sum and the
    least distance from the spec's split. LATENCY: the least sum, then the least cap that still allows it, then
    the same. None where no split fits the nodes' memory."""
    def time_of(i: int, k: int) -> float:
        return k * block_s[i] + (head_s[i] if i == n - 1 else 0.0)

    caps = sorted({time_of(i, k) for i in range(n) for k in range(1, most[i] + 1)})
    unbounded = _best(n, total, time_of, most, spec, caps[-1]) if caps else None
    if unbounded is None:
        return None
    floor = unbounded[0][0] if objective is Objective.LATENCY else None

    def meets(cap: float) -> bool:
        best = _best(n, total, time_of, most, spec, cap)
        return best is not None and (floor is None or best[0][0] <= floor + EPS)

    lo, hi = 0, len(caps) - 1  # the least cap that meets: caps[-1] always does
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if meets(caps[mid]) else (mid + 1, hi)
    return _best(n, total, time_of, most, spec, caps[lo])[1]


def _best(n, total, time_of, most, spec, cap):
    """Of the splits whose every stage takes at most `cap`, the one of least (sum of stage times, squared
    distance from the spec's split), as ((sum, distance), counts); None if there is none. Both are sums over the stages, so
    the best split of the first i stages over d blocks is part of the best of them all."""
    best = {0: ((0.0, 0), ())}
    for i in range(n):
        nxt: dict[int, tuple] = {}
        for done, ((summed, dist), counts) in best.items():
            left = total - done
            for k in (range(left, left + 1) if i == n - 1 else range(1, left - (n - 1 - i) + 1)):
                t = time_of(i, k)
                if k > most[i] or t > cap + EPS:
                    continue
                key = (summed + t, dist + (k - spec[i]) ** 2)
                old = nxt.get(done + k)
                if old is None or (round(key[0], 12), key[1]) < (round(old[0][0], 12), old[0][1]):
                    nxt[done + k] = (key, counts + (k,))
        best = nxt
    return best.get(total)
