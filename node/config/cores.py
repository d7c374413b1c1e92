"""How many cores a node computes on: every core its process may use, unless told (--threads, PP_THREADS);
a fair share of them when several nodes share one machine (ppsmoke --seed); and which machine's cores they
are (--machine-id, PP_MACHINE_ID), so that the planner knows which nodes share them."""
from __future__ import annotations

import hashlib
import os
import re
import socket

from worker.config import MAX_THREADS

__all__ = ["MACHINE_ID", "MAX_THREADS", "available_cores", "converts_half", "fair_share", "machine_id"]

MACHINE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # --machine-id, and what gossip accepts as one


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, as llama.cpp and vLLM count them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS
        return os.cpu_count() or 1


def converts_half(arch: str, cpu_flags: set[str] | None) -> bool:
    """Pure: whether a CPU converts float16 in hardware, as tinygrad's kernels need for a float16 KV cache: on
    x86 only with F16C (every x86-64-v3 CPU; not the x86-64-v2 level); aarch64 always; unknown flags: assumed."""
    return arch != "x86_64" or cpu_flags is None or "f16c" in cpu_flags


def fair_share(cores: int, nodes: int) -> int:
    """Threads for each of `nodes` nodes on a machine of `cores` cores, so that together they do not ask
    for more cores than there are: at least one each."""
    return max(1, cores // max(1, nodes))


def machine_id() -> str:
    """Which pool of cores this process computes on, as 16 hex digits: the kernel's boot id (one a machine and
    boot), the CPU cgroups the process is in (a container or a CPU quota is a pool of its own) and its CPU
    affinity. Nodes with the same id share their cores, so timing each of them while they all boot would time
    their contention, not their speed (node/planning.py)."""
    parts = [_read("/proc/sys/kernel/random/boot_id") or socket.gethostname()]
    for line in _read("/proc/self/cgroup").splitlines():  # "hierarchy:controllers:path"; v2 is "0::path"
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if not controllers or {"cpu", "cpuacct", "cpuset"} & set(controllers.split(",")):
            parts.append(f"{controllers}:{path}")
    try:
        parts.append(",".join(map(str, sorted(os.sched_getaffinity(0)))))
    except AttributeError:  # no affinity on this OS
        parts.append(str(os.cpu_count()))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
