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
    """1, 2, 4, 8, 16, ... up to max_batch (which need not be a power of two). Each bucket is a graph to
    capture at boot. A bucket of 2 matters for a step of one decode and one prompt row (a small chunked
    prefill): with the hand-written CPU kernels 2 rows cost 1.2x one row through 10 SmolLM2 blocks and 4 rows
    1.7x (`python -m bench.kernels --mixed`, issue 25); tinygrad's own kernels once made 2 rows dearer than 4,
    and there was no bucket of 2."""
    sizes, b = [1], 2
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return tuple(s for s in sizes if s < max_batch) + (max_batch,)


def default_max_batch(max_seqs: int) -> int:
    """Rows per step: room for a decode row of every slot plus as many prompt rows again, rounded up to
    a power of two, so a prompt always advances while every other sequence decodes."""
    return 1 << (2 * max_seqs - 1).bit_length()


def split_rows(rows: int, cost: dict[int, float]) -> list[int]:
    """Cut a step of `rows` rows into graph calls, each padded up to the smallest bucket that holds it,
    at the least total cost; `cost` is the time of one call per bucket. Returns the calls' row counts.

    Buckets are not priced in proportion to their rows: on a CPU a call of 16 rows cost 2.2 calls of 8
    (one `small` block), so 12 rows go faster as 8 + 4 than padded to 16, while on `tiny` one call of
    16 beats two of 8."""
    buckets = sorted(cost)
    best, choice = [0.0] * (rows + 1), [0] * (rows + 1)
    for n in range(1, rows + 1):
        best[n], choice[n] = min((cost[b] + best[n - min(b, n)], min(b, n)) for b in buckets)
    calls = []
    while rows:
        calls.append(choice[rows])
        rows -= choice[rows]
    return calls


def unmeasured_cost(buckets: tuple[int, ...]) -> dict[int, float]:
    """Before buckets are timed: fewest calls first, then the smaller bucket."""
    return {b: 1.0 + b / 1e6 for b in buckets}
