"""Which kernels a stage's steps compute with: pp's hand-written C on the CPU (cpu_matvec.py, cpu_attention.py
on cpu_threads.py's pool), or tinygrad's own, off the CPU and wherever pp's library cannot be built (issue 53).

A node must not die because its kernels will not compile: an old clang, a CPU clang does not know, a
PP_CPU_TARGET this CPU cannot run. It then computes on tinygrad's kernels, on one core and slower, and says so
(`Kernels.fallback`, shown by /health, /metrics and ppsmoke's stats line; the node logs it at load). Both compute
the same model: the same greedy tokens, logits within float-summation tolerance (tests/test_cpu_targets.py).
Only a missing compiler is fatal (cpu_build.CompilerMissing): tinygrad's CPU backend compiles with it too.
"""
from __future__ import annotations

import functools

from tinygrad import Device

from . import cpu_build, cpu_threads
from .cpu_target import NATIVE  # noqa: F401 (the default target, for callers)
from ..contract import Kernels


@functools.cache
def open_kernels(threads: int, target: str = NATIVE) -> tuple[Kernels, cpu_threads.CpuThreads | None]:
    """What this process's steps compute with, and the pool pp's kernels run on (None: tinygrad's kernels).
    One answer per (threads, target) per process: the stages and slices of one process share it."""
    if not Device.DEFAULT.startswith("CPU"):
        return Kernels("tinygrad", device=Device.DEFAULT), None
    try:
        pool = cpu_threads.shared(threads, target)
    except cpu_build.KernelBuildError as exc:
        return Kernels("tinygrad", device=Device.DEFAULT, target=target, threads=1, fallback=str(exc)), None
    return Kernels("c", device=Device.DEFAULT, target=target, threads=threads), pool
