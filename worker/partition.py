"""Which blocks each stage owns, and which role it plays. Pure functions."""
from __future__ import annotations

import enum


class Role(enum.Enum):
    FIRST = "first"    # tokenizer, embedding, first block range; receives prompts and fed-back tokens
    MIDDLE = "middle"  # a block range only
    LAST = "last"      # last block range, final norm, head, sampler, detokenizer


def check_stage(stage: int, num_stages: int) -> None:
    if num_stages < 2:
        raise ValueError(
            f"NUM_STAGES={num_stages}: a pipeline needs at least 2 stages; "
            "for one process use single-process generation: "
            "python -m worker --model ... (worker.reference.generate_full)")
    if not 0 <= stage < num_stages:
        raise ValueError(f"STAGE={stage} is outside 0..{num_stages - 1}")


def role_of(stage: int, num_stages: int) -> Role:
    check_stage(stage, num_stages)
    if stage == 0:
        return Role.FIRST
    return Role.LAST if stage == num_stages - 1 else Role.MIDDLE


def layer_range(total_blocks: int, stage: int, num_stages: int) -> range:
    """Blocks [lo, hi) of `stage`: total // N each, the first total % N stages take one more."""
    check_stage(stage, num_stages)
    if total_blocks < num_stages:
        raise ValueError(f"{total_blocks} blocks cannot be split over {num_stages} stages (each needs at least one)")
    base, extra = divmod(total_blocks, num_stages)
    lo = stage * base + min(stage, extra)
    return range(lo, lo + base + (1 if stage < extra else 0))
