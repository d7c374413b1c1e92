"""Which CPU pp's kernel library is built for (PP_CPU_TARGET), the compiler flags that say so, and whether this
machine can run what such a build may contain.

`native` (the default) builds for the machine itself, as tinygrad builds its own kernels. A named target (a
clang CPU name: x86-64-v2, x86-64-v3, znver3, neoverse-n1, ...) builds portable code: a machine can then run the
code paths of an older CPU, and machines of one fleet share one build (the library's file is keyed by the
target, not by the CPU). A build for a CPU with features this one lacks would die of SIGILL at its first step,
so `missing_features` compares what clang says the target may use with what the CPU reports.
"""
from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

NATIVE = "native"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")  # a clang CPU name, or native
ARCHES = ("x86_64", "aarch64")

# What a target's code may use that a CPU must have: clang's predefined macro -> /proc/cpuinfo's flag. The
# kernels are generic vector C, so the compiler may pick any of these.
X86_FEATURES = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2", "__POPCNT__": "popcnt",
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2",
    "__LZCNT__": "abm", "__MOVBE__": "movbe", "__AVX512F__": "avx512f", "__AVX512CD__": "avx512cd",
    "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl",
    "__AVX512IFMA__": "avx512ifma", "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512BITALG__": "avx512_bitalg", "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16", "__AVXVNNI__": "avx_vnni", "__GFNI__": "gfni",
    "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq",
}
ARM_FEATURES = {
    "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "asimdhp", "__ARM_FEATURE_DOTPROD": "asimddp",
    "__ARM_FEATURE_MATMUL_INT8": "i8mm", "__ARM_FEATURE_BF16_VECTOR_ARITHMETIC": "bf16",
    "__ARM_FEATURE_SVE": "sve", "__ARM_FEATURE_SVE2": "sve2", "__ARM_FEATURE_ATOMICS": "atomics",
    "__ARM_FEATURE_CRC32": "crc32", "__ARM_FEATURE_JCVT": "jscvt", "__ARM_FEATURE_FRINT": "frint",
}
FEATURES = {"x86_64": X86_FEATURES, "aarch64": ARM_FEATURES}


def host_arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def check_name(target: str) -> str:
    """`target` if it can be a CPU name; ValueError otherwise (it goes on a compiler's command line)."""
    if not NAME.fullmatch(target):
        raise ValueError(f"{target!r} is not a CPU name: 1-64 letters, digits, '.', '_', '+' or '-' "
                         f"(e.g. native, x86-64-v2, x86-64-v3, znver3, neoverse-n1)")
    return target


def arch_flags(target: str, arch: str) -> list[str]:
    """Pure: the flags that build for `target` on `arch`: on x86 -march names the CPU, on aarch64 -mcpu does
    (-march there names an architecture version)."""
    if arch == "x86_64":
        return [f"-march={target}"]
    if arch == "aarch64":
        return [f"-mcpu={target}"]
    raise ValueError(f"pp's CPU kernels are built for {' and '.join(ARCHES)}, not {arch}")


def cross_flags(arch: str, host: str) -> list[str]:
    """Pure: the flags that make clang, a cross compiler by design, emit code for `arch` from `host`."""
    return [] if arch == host else [f"--target={arch}-linux-gnu"]


def parse_macros(text: str) -> set[str]:
    """Pure: the macro names `clang -E -dM` printed."""
    return {parts[1] for line in text.splitlines() if len(parts := line.split()) >= 2 and parts[0] == "#define"}


def parse_cpu_flags(cpuinfo: str) -> set[str]:
    """Pure: the features /proc/cpuinfo lists for the first CPU (x86's `flags`, aarch64's `Features`)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def missing_features(macros: set[str], cpu_flags: set[str], arch: str) -> list[str]:
    """Pure: the features a build with `macros` may use that a CPU with `cpu_flags` lacks, by cpuinfo's names."""
    return sorted(flag for macro, flag in FEATURES.get(arch, {}).items() if macro in macros and flag not in cpu_flags)


def target_macros(compiler: str, flags: list[str]) -> set[str]:
    """What `compiler` predefines when it builds with `flags`; CalledProcessError if it refuses them."""
    out = subprocess.run([compiler, *flags, "-E", "-dM", "-x", "c", "-"], input="", capture_output=True, text=True,
                         check=True)
    return parse_macros(out.stdout)


def host_cpu_flags() -> set[str] | None:
    """This CPU's features, or None where /proc/cpuinfo cannot say (not Linux)."""
    try:
        flags = parse_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None
    return flags or None
