"""What a batched step is made of, independent of the backend: segments of sequences in slots, and the
batch sizes (buckets) a slice compiles its step for. No tinygrad here, so the stub can share it."""
from __future__ import annotations

import attrs

DEFAULT_MAX_SEQS = 8


@attrs.frozen
class Segment:
    """One sequence's rows in a step: `length` consecutive tokens of `slot` from `position` on."""

    slot: int
    position: int
    length: int


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_batch (which need not be a power of two)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


def default_max_batch(max_seqs: int) -> int:
    """Rows per step: room for a decode row of every slot plus as many prompt rows again, rounded up to
    a power of two, so a prompt always advances while every other sequence decodes."""
    return 1 << (2 * max_seqs - 1).bit_length()
