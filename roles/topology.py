"""Registry names and who registers and resolves which (docs/design.md, Names). Pure functions."""
from __future__ import annotations

from worker.partition import Role, Shard

ENTRY = "pp-entry"
EXIT = "pp-exit"
ORCHESTRATOR = "pp-orchestrator"


def stage_name(stage: int) -> str:
    return f"pp-stage-{stage}"


def first_names(shard: Shard) -> tuple[str, ...]:
    """Registered as soon as the node has joined, so neighbours can resolve it (docs/design.md, Boot order, step 3)."""
    return (stage_name(shard.index),)


def final_names(shard: Shard) -> tuple[str, ...]:
    """Registered last, once the node is ready and wired (Boot order, step 8): pp-entry means 'send now'."""
    extra = {Role.FIRST: (ENTRY,), Role.LAST: (EXIT,), Role.MIDDLE: ()}[shard.role]
    return (stage_name(shard.index), *extra)


def resolves(shard: Shard) -> tuple[str, ...]:
    """The names a stage sends to (Boot order, step 6); the last stage's feedback edge goes to stage 0."""
    return (stage_name(0),) if shard.last else (stage_name(shard.index + 1),)
