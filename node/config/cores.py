"""How many cores a node computes on: every core its process may use, unless told (--threads, PP_THREADS);
and a fair share of them when several nodes share one machine (ppsmoke --seed)."""
from __future__ import annotations

import os

from worker.config import MAX_THREADS

__all__ = ["MAX_THREADS", "available_cores", "fair_share"]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, as llama.cpp and vLLM count them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS
        return os.cpu_count() or 1


def fair_share(cores: int, nodes: int) -> int:
    """Threads for each of `nodes` nodes on a machine of `cores` cores, so that together they do not ask
    for more cores than there are: at least one each."""
    return max(1, cores // max(1, nodes))
