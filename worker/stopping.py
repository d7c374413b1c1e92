"""When a generation ends: shared by the last stage and single-process generation so both stop alike."""
from __future__ import annotations


def generation_done(token_id: int, *, generated: int, max_tokens: int, next_position: int, max_context: int,
                    stop_ids: frozenset[int]) -> bool:
    """`generated` counts token_id; `next_position` is where token_id would be fed back."""
    return token_id in stop_ids or generated >= max_tokens or next_position >= max_context
