"""Registry names and who registers and resolves which (docs/design.md, Names). Pure functions."""
from __future__ import annotations

from worker.partition import Role, role_of

ENTRY = "pp-entry"
EXIT = "pp-exit"
ORCHESTRATOR = "pp-orchestrator"


def stage_name(stage: int) -> str:
    return f"pp-stage-{stage}"


def first_names(stage: int, num_stages: int) -> tuple[str, ...]:
    """Registered as soon as the node has joined, so neighbours can resolve it (docs/design.md, Boot order, step 3)."""
    return (stage_name(stage),)


def final_names(stage: int, num_stages: int) -> tuple[str, ...]:
    """Registered last, once the node is ready and wired (Boot order, step 8): pp-entry means 'send now'."""
    role = role_of(stage, num_stages)
    extra = {Role.FIRST: (ENTRY,), Role.LAST: (EXIT,), Role.MIDDLE: ()}[role]
    return (stage_name(stage), *extra)


def resolves(stage: int, num_stages: int) -> tuple[str, ...]:
    """The names a stage sends to (Boot order, step 6); the last stage's feedback edge goes to stage 0."""
    role = role_of(stage, num_stages)
    if role is Role.LAST:
        return (stage_name(0),)
    return (stage_name(stage + 1),)
