"""What a link's messages concern, asked of any actor: which request lives a message carries rows or tokens
of, and the part of it still live at the sender. The node asks these when a link moves to a new peer (only
what is still live is resent) and when a frame is refused (its requests fail). Pure functions."""
from __future__ import annotations

from typing import Callable

from .actions import failure, lost
from .messages import Activation, EndRequest, NextTokens

Live = Callable[[str, int], bool]  # an actor's is_live(request_id, generation)


def lives_of(message) -> list[tuple[str, int]]:
    """The (request id, generation) lives a link message carries, each once, in order; none for an end or a
    failure report, which concern no rows."""
    if isinstance(message, Activation):
        lives = [(s.request_id, s.generation) for s in message.meta.segments]
    elif isinstance(message, NextTokens):
        lives = [(t.request_id, t.generation) for t in message.tokens]
    else:
        return []
    return list(dict.fromkeys(lives))


def still_live(message, is_live: Live):
    """The part of a message that concerns requests still live here, or None: rows and tokens of ended or
    replayed lives are not resent, nor ends and failure reports (a new peer never knew their request)."""
    if isinstance(message, Activation):
        rows = [(s, h) for s, h in message.split() if is_live(s.request_id, s.generation)]
        return Activation.of(rows) if rows else None
    if isinstance(message, NextTokens):
        tokens = tuple(t for t in message.tokens if is_live(t.request_id, t.generation))
        return NextTokens(tokens) if tokens else None
    return None


def refused_frame_ends(message, stage: int, error: str, *, unknown: bool = False) -> list[EndRequest]:
    """A frame this stage could not take: the failure of each request it carried, for stage 0 to end; where
    the frame was refused as `unknown` here (rows of a request this stage never started: it is new in the
    chain, and the frame left before the sender knew its holder was replaced), each request is lost here
    instead, for stage 0 to replay (at most MAX_REPLAYS times, roles/first.py)."""
    if unknown:
        return [lost(rid, stage, generation, error) for rid, generation in lives_of(message)]
    return [failure(rid, stage, error, generation) for rid, generation in lives_of(message)]
