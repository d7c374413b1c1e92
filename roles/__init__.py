"""Stage actors, one role per file: what a stage does with each message. No I/O here: an actor
admits a message (in the event loop) and processes it with the worker (on the compute thread),
returning the messages to send; the node does the sending."""
from __future__ import annotations

from worker.partition import Role, role_of

from .first import FirstActor
from .last import LastActor
from .middle import MiddleActor


def make_actor(stage: int, num_stages: int):
    kind = {Role.FIRST: FirstActor, Role.MIDDLE: MiddleActor, Role.LAST: LastActor}[role_of(stage, num_stages)]
    return kind(stage, num_stages)
