"""What an actor asks the node to do, and how it refuses a message."""
from __future__ import annotations

import time
from contextlib import contextmanager

import attrs

from node.wire import Activation, InferenceResponse, NextToken


class Refused(Exception):
    """A message this stage does not take; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@attrs.frozen
class Send:
    dest: str  # a registry name, e.g. "pp-stage-1"
    message: Activation | NextToken


@attrs.frozen
class Reply:
    reply_to: str | None  # base URL of whoever asked; None: keep it on this node for the asker to fetch
    response: InferenceResponse


def wrong_role(stage: int, role, message) -> Refused:
    kind = type(message).__name__
    return Refused(409, f"stage {stage} ({role.value}) does not accept {kind} messages")


def error_reply(stage: int, request_id: str, reply_to: str | None, exc: Exception) -> Reply:
    return Reply(reply_to, InferenceResponse(request_id, error=f"stage {stage}: {exc}", failed_stage=stage))


@contextmanager
def timed(into: list):
    """Append the elapsed milliseconds of the block to `into`."""
    start = time.perf_counter()
    yield
    into.append((time.perf_counter() - start) * 1000.0)


def admit_activation(current: str | None, msg, stage: int, role) -> str:
    """Middle and last stages: a prefill starts (and supersedes) a request; a decode step must
    continue the current one. Returns the request now current."""
    if not isinstance(msg, Activation):
        raise wrong_role(stage, role, msg)
    rid = msg.meta.request_id
    if not msg.meta.is_prefill and rid != current:
        raise Refused(404, f"unknown request {rid!r} at stage {stage} (never started here, or superseded)")
    return rid
