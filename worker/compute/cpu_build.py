"""Compiling pp's CPU kernel library (cpu_threads.py's source) into a shared object for a target, once per
machine, or saying in one line why it cannot be: the cause and the fix (issue 53).

The file is kept beside tinygrad's cache, keyed by the source, the compiler's version, the flags and, for a
native build, the CPU, so any change is a new file and never a stale one; a named target's build does not
depend on the CPU, so machines sharing a cache share it.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from tinygrad.helpers import CACHEDB, getenv

from . import cpu_target

class KernelBuildError(RuntimeError):
    """The library cannot be built, or must not be run, here. `cause` and `fix` are each one clause."""

    def __init__(self, cause: str, fix: str):
        super().__init__(f"{cause}; {fix}")
        self.cause, self.fix = cause, fix


class CompilerMissing(RuntimeError):
    """No C compiler at all: tinygrad's CPU backend compiles with the same clang, so nothing can run here."""


def compiler() -> str:
    return getenv("CC", "clang")  # tinygrad's own setting for its compiler: both must be the same clang


def compiler_version(cc: str) -> str:
    """The first line of `cc --version`; CompilerMissing where there is no such program."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise CompilerMissing(f"no C compiler {cc!r} ({exc.__class__.__name__}: {exc}); install clang 14 or later "
                              f"(Debian/Ubuntu: apt install clang), or set CC to one: tinygrad's CPU backend "
                              f"compiles with it too") from None
    return out.splitlines()[0].strip() if out.strip() else cc


def explain(version: str, target: str, stderr: str) -> KernelBuildError:
    """Pure: why a compile of the library for `target` failed, from the compiler's output, and what to do."""
    first = next((line.strip() for line in stderr.splitlines() if "error:" in line), stderr.strip()[:200])
    unknown = "unknown target CPU" in stderr or "not a recognized processor" in stderr
    if unknown and target == cpu_target.NATIVE:
        return KernelBuildError(f"{version} does not know this CPU ({first})",
                                "set PP_CPU_TARGET to the nearest CPU it knows (x86-64-v3, x86-64-v2; on Arm "
                                "neoverse-n1 or generic), or install a newer clang")
    if unknown:
        return KernelBuildError(f"{version} does not know the CPU {target!r} (PP_CPU_TARGET)",
                                "set PP_CPU_TARGET to native or to a CPU `clang --print-supported-cpus` lists")
    return KernelBuildError(f"{version} cannot compile pp's CPU kernels for {target} ({first})",
                            "install clang 14 or later (apt install clang), or set PP_CPU_TARGET=x86-64-v2 "
                            "(aarch64: generic) for the portable code; please report it")


def lacking(cc: str, version: str, target: str, arch: str) -> KernelBuildError | None:
    """Why code built for `target` must not run on this CPU (it may use features the CPU lacks), or None."""
    cpu_flags = cpu_target.host_cpu_flags()
    if target == cpu_target.NATIVE or cpu_flags is None:
        return None
    try:
        macros = cpu_target.target_macros(cc, cpu_target.arch_flags(target, arch))
    except subprocess.CalledProcessError as exc:
        return explain(version, target, exc.stderr)
    missing = cpu_target.missing_features(macros, cpu_flags, arch)
    if not missing:
        return None
    return KernelBuildError(f"PP_CPU_TARGET={target} builds code that may use {', '.join(missing)}, which this CPU "
                            f"lacks", "set PP_CPU_TARGET to native or to an older CPU, e.g. x86-64-v2")


def build(source: str, target: str, flags: tuple[str, ...]) -> Path:
    """The library built from `source` with `flags` for `target` on this machine (cached); KernelBuildError if it
    cannot be."""
    cc, arch = compiler(), cpu_target.host_arch()
    version = compiler_version(cc)
    if arch not in cpu_target.ARCHES:
        raise KernelBuildError(f"pp's CPU kernels are built for x86-64 and aarch64, not {arch}",
                               "nothing to do: tinygrad's own kernels serve")
    if (refused := lacking(cc, version, target, arch)) is not None:
        raise refused
    flags = [*flags, *cpu_target.arch_flags(target, arch)]
    machine = _cpu_name() if target == cpu_target.NATIVE else ""
    key = hashlib.sha256("\0".join((source, version, *flags, machine)).encode()).hexdigest()[:24]
    folder = Path(CACHEDB).parent / "pp-cpu"
    path = folder / f"threads-{key}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # then renamed: concurrent boots never see half a file
        built = Path(tmp) / "lib.so"
        done = subprocess.run([cc, *flags, "-x", "c", "-", "-o", str(built)], input=source, text=True,
                              capture_output=True)
        if done.returncode:
            raise explain(version, target, done.stderr)
        os.replace(built, path)
    return path


def _cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("model name", "Model"))), "")
