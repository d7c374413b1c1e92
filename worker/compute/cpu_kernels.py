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

from . import cpu_build, cpu_target, cpu_threads
from .cpu_target import NATIVE
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


def main(argv: list[str] | None = None) -> int:
    """`python -m worker.compute.cpu_kernels [TARGET ...]`: what a stage on this machine computes with for each
    target (default native): pp's kernels, built now (and kept for the nodes), or tinygrad's, with the cause and
    the fix. Exit 1 where any target falls back or nothing can compile (install.sh and the Dockerfile run it)."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m worker.compute.cpu_kernels", description=main.__doc__)
    parser.add_argument("targets", nargs="*", default=[NATIVE], metavar="TARGET", help="native or a clang CPU name")
    args = parser.parse_args(argv)
    failed = False
    for target in args.targets:
        try:
            kernels, _ = open_kernels(1, cpu_target.check_name(target))
        except (ValueError, cpu_build.CompilerMissing) as exc:
            print(f"{target}: {exc}")
            failed = True
            continue
        print(f"{target}: {kernels.label}" + (f": {kernels.fallback}" if kernels.fallback else ""))
        failed |= kernels.fallback is not None
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
