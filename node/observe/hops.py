"""Where a hop's time goes, measured on both ends of each link: the figures `bench.pipeline` prints.

A hop is one message from a stage to the next (or from the last stage back to stage 0). Its parts:

- encode: the sender turns the message into bytes (sender's side);
- wire: from the sender's send to the receiver's handler (needs one clock on both ends, see below);
- queue: from arrival until the step that takes it starts (the stage was busy, or the message waited
  for the event loop);
- to_thread, compute, back: the step's hand-off to the compute thread, the step itself, the hand-off
  back to trio;
- answer: the sender's wait for the receiver's answer (per-message POSTs only; a stream has none).

Each node records its outbound parts under the destination and its inbound parts under the source, as
samples in a bounded window; `summary()` gives median and p99 per part.

Clocks: `now()` is time.monotonic, CLOCK_MONOTONIC on Linux, which all processes on one machine share,
so a wire time computed from the sender's stamp is exact between local processes. Between machines the
two clocks are unrelated and the wire figure means nothing; every other part is measured on one clock.
"""
from __future__ import annotations

import collections
import statistics
import time

WINDOW = 4096  # samples kept per part: the recent past, not the boot's compile steps forever
PARTS = ("encode", "wire", "queue", "to_thread", "compute", "back", "answer")

now = time.monotonic
OTHER = "from other"  # the one label of every sender that is not a stage of this chain


def source_link(source: str, known: frozenset[str] | set[str]) -> str:
    """The link an inbound hop is recorded under: "from <stage>" for a stage of the chain, else OTHER. A
    sender names itself (a header, a link's `from`), so a label per name would grow /metrics and /v1/hops
    with every name a peer makes up."""
    return f"from {source}" if source in known else OTHER


class HopStats:
    def __init__(self, window: int = WINDOW, observe=lambda link, part, seconds: None):
        """`observe(link, part, seconds)` also hears every sample (the node's Prometheus histogram)."""
        self._window, self._observe = window, observe
        self._samples: dict[tuple[str, str], collections.deque] = {}

    def record(self, link: str, part: str, seconds: float) -> None:
        """One sample of `part` on `link` (a peer's name, e.g. "from pp-stage-1" or "to pp-entry")."""
        if part not in PARTS:
            raise ValueError(f"unknown hop part {part!r}; one of {PARTS}")
        key = (link, part)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = collections.deque(maxlen=self._window)
        samples.append(seconds * 1000.0)
        self._observe(link, part, seconds)

    def reset(self) -> None:
        self._samples.clear()

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """{link: {part: {"n", "median_ms", "p99_ms"}}}."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (link, part), samples in sorted(self._samples.items()):
            if samples:
                out.setdefault(link, {})[part] = {"n": len(samples), "median_ms": statistics.median(samples),
                                                  "p99_ms": percentile(samples, 99)}
        return out


def percentile(samples, p: float) -> float:
    """The nearest-rank percentile: the smallest sample with at least p% of the samples at or below it."""
    ordered = sorted(samples)
    rank = max(1, -(-len(ordered) * p // 100))  # ceil without floats
    return ordered[int(rank) - 1]
