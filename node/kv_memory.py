"""How many KV positions a stage may hold (--kv-cache-memory), and so the cluster's budget. Pure: figures in,
positions out; node/main.py gossips a stage's (Meta.kv_positions), and stage 0 admits by the least of them.

Every stage holds KV for the same positions of the same requests, so a budget in positions is one number for
the whole chain: the least any stage can hold. Stage 0 alone then decides which request waits or is preempted
(roles/kv_budget.py), and no stage's KV outgrows its memory.

The auto budget: half the memory free at boot (MemAvailable), shared by the stages this machine runs, and no
more than every slot's whole context. Half, because a CPU box's KV shares its memory with the OS, the weights,
the interpreter and whatever else the user runs; vLLM takes 90% of a GPU that serves nothing else
(--gpu-memory-utilization), which a desktop or a shared vast.ai box cannot give.
"""
from __future__ import annotations

import attrs

AUTO_SHARE = 0.5  # of MemAvailable at boot, split among the stages of this machine


@attrs.frozen
class KvPositions:
    positions: int  # what this stage can hold: every request's and prefix-cache entry's KV together
    memory_bytes: int  # what they take at most
    how: str  # "given" (--kv-cache-memory), "auto", "slots" (every slot's whole context fits), "context"
    note: str = ""  # why the budget is not what was asked for, where it is not


def stage_positions(memory: int | None, *, kv_bytes: int, slot_positions: int, max_context: int,
                    available: int | None, stages_here: int = 1) -> KvPositions:
    """The positions a stage's KV may hold. `memory`: --kv-cache-memory (None: auto); `kv_bytes`: what
    `slot_positions` (every slot's whole context) would take; `available`: MemAvailable at boot (None:
    unknown); `stages_here`: the stages on this machine. Never fewer than one whole context, so that a lone
    request can always grow to --ctx (vLLM refuses to start instead: here the node says so and goes on)."""
    per = kv_bytes / slot_positions if slot_positions else 0.0
    if per <= 0:
        return KvPositions(slot_positions, kv_bytes, "slots")
    how = "given"
    if memory is None:
        if available is None:
            return KvPositions(slot_positions, kv_bytes, "slots", "the free memory is unknown")
        memory, how = int(available * AUTO_SHARE / max(1, stages_here)), "auto"
    positions = int(memory // per)
    if positions >= slot_positions:
        return KvPositions(slot_positions, kv_bytes, "slots" if how == "auto" else how)
    if positions < max_context:
        return KvPositions(max_context, round(max_context * per), "context",
                           f"{memory} bytes hold {positions} positions, fewer than one context of {max_context}: "
                           f"the budget is one whole context, {round(max_context * per)} bytes")
    return KvPositions(positions, round(positions * per), how)


def chain_positions(figures: list[int | None]) -> int | None:
    """The chain's budget: the least any stage can hold (None: no stage said)."""
    known = [f for f in figures if f is not None]
    return min(known) if known else None
