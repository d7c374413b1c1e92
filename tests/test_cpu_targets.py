"""pp starts on every CPU its users have (issue 53).

- The kernel library's source compiles, with every clang on this machine, for a matrix of x86-64 and aarch64
  CPUs: not only this one. A clang too old to know a CPU's name builds for the same instruction set spelled out
  as features, and the test's id says so; no target is skipped.
- Every build this CPU can run reads a float16 cache as its exact float32 widening (F16C, or integer moves on
  x86-64-v2), subnormals and signed zeros included, and computes what the native build does.
- A target this CPU cannot run, a CPU clang does not know, or a source that does not compile: the stage
  computes on tinygrad's own kernels, says why in one line (the cause and the fix), and answers with the same
  greedy tokens, in process and in a cluster, whose /health and /metrics name the fallback.
"""
import functools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import trio
from tinygrad import Tensor

from cluster import API_KEY, client_http, start_cluster
from node.config.cores import converts_half
from node.config.model import kv_cache_dtype
from node.config.parse import parse_config
from node.config.sources import ConfigError, Sources
from runner.report import kernels_part
from worker.compute import cpu_build, cpu_kernels, cpu_target, cpu_threads
from worker.compute.cpu_attention import attention
from worker.compute.cpu_matvec import matvec
from worker.contract import Kernels
from worker.models import tinygrad_model
from worker.reference import generate_full
from worker.weights.tiny import TinySource

X86 = ("x86-64-v2", "x86-64-v3", "haswell", "skylake-avx512", "icelake-server", "sapphirerapids", "alderlake",
       "znver1", "znver2", "znver3", "znver4")
ARM = ("neoverse-n1", "neoverse-v1", "apple-m1")
MATRIX = [("x86_64", t) for t in X86] + [("aarch64", t) for t in ARM]
# What a clang that predates a CPU's name builds for it: the same instruction set, spelled out (znver4 came with
# clang 16; Debian 12's clang is 14).
SPELLED_OUT = {"znver4": ["-march=znver3", *(f"-m{f}" for f in (
    "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512ifma", "avx512vbmi", "avx512vbmi2",
    "avx512vnni", "avx512bitalg", "avx512vpopcntdq", "avx512bf16", "gfni", "vaes", "vpclmulqdq"))]}
ELF_MACHINE = {"x86_64": 62, "aarch64": 183}
COMPILE = [f for f in cpu_threads.FLAGS if f != "-shared"]


def compilers() -> list[str]:
    """Every clang on PATH, once each (clang is usually a link to one clang-N): the default one first."""
    found, seen = [], set()
    for name in [cpu_build.compiler(), "clang", *(f"clang-{v}" for v in range(14, 31))]:
        path = shutil.which(name)
        if path and (real := Path(path).resolve()) not in seen:
            seen.add(real)
            found.append(name)
    return found


COMPILERS = compilers()


@functools.cache
def source() -> str:
    return cpu_threads.library_source()


@functools.cache
def knows(cc: str, arch: str, target: str) -> bool:
    flags = [*cpu_target.cross_flags(arch, cpu_target.host_arch()), *cpu_target.arch_flags(target, arch)]
    return subprocess.run([cc, *flags, "-E", "-x", "c", "-"], input="", capture_output=True).returncode == 0


def test_this_machine_has_a_clang_to_build_with():
    assert COMPILERS, "no clang on PATH: install.sh installs it (apt install clang)"


@pytest.mark.parametrize("cc", COMPILERS)
@pytest.mark.parametrize("arch, target", MATRIX, ids=[t for _, t in MATRIX])
def test_the_kernel_library_compiles_for_every_cpu_pp_claims(cc, arch, target, tmp_path):
    cross = cpu_target.cross_flags(arch, cpu_target.host_arch())
    flags = cpu_target.arch_flags(target, arch) if knows(cc, arch, target) else SPELLED_OUT.get(target)
    assert flags, f"{cc} does not know {target} and the test has no spelled-out form of it"
    out = tmp_path / "kernels.o"
    done = subprocess.run([cc, *COMPILE, *cross, *flags, "-c", "-x", "c", "-", "-o", str(out)], input=source(),
                          capture_output=True, text=True)
    assert done.returncode == 0, f"{cc} {' '.join(flags)}:\n{done.stderr[-3000:]}"
    header = out.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == ELF_MACHINE[arch]


# --- builds this CPU runs ---------------------------------------------------------------------------------

def runnable() -> list[str]:
    """The targets whose code this CPU runs: native, and on x86 the portable levels it has the features of."""
    arch, flags = cpu_target.host_arch(), cpu_target.host_cpu_flags() or set()
    named = ["x86-64-v2", "x86-64-v3"] if arch == "x86_64" else ["generic"]
    return [cpu_target.NATIVE] + [t for t in named if not cpu_target.missing_features(
        cpu_target.target_macros(cpu_build.compiler(), cpu_target.arch_flags(t, arch)), flags, arch)]


HEADS, KV_HEADS, CONTEXT, SLOTS = 6, 2, 40, 3
ROWS = [(7, 0), (30, 2), (12, 1), (0, 1), (39, 0)]


def half_cache(head_dim: int) -> np.ndarray:
    """A float16 cache with every kind of value: normals, subnormals, both zeros, the largest."""
    rng = np.random.default_rng(head_dim)
    cache = (3 * rng.standard_normal((SLOTS * CONTEXT, 2 * KV_HEADS * head_dim))).astype(np.float16)
    flat = cache.reshape(-1)
    flat[::7] = np.float16(2 ** -24) * rng.integers(-1023, 1024, flat[::7].shape)  # subnormals
    flat[::11] = np.float16(-0.0)
    flat[::13] = np.float16(65504) * np.sign(rng.standard_normal(flat[::13].shape)) / 4096
    return cache


def attend(cache: np.ndarray, head_dim: int, target: str, threads: int = 1) -> np.ndarray:
    q = np.random.default_rng(1).standard_normal((len(ROWS), HEADS * head_dim)).astype(np.float32)
    ints = np.array([[p for p, _ in ROWS], [s for _, s in ROWS], [s * CONTEXT + p for p, s in ROWS]], dtype=np.int32)
    return attention(Tensor(q), Tensor(cache), Tensor(ints), heads=HEADS, kv_heads=KV_HEADS, head_dim=head_dim,
                     max_context=CONTEXT, threads=cpu_threads.shared(threads, target)).numpy()


@pytest.mark.parametrize("head_dim", [16, 64], ids=["a generic head size", "a specialised head size"])
@pytest.mark.parametrize("target", runnable())
def test_a_float16_cache_reads_as_its_exact_float32_widening_on_every_build_this_cpu_runs(target, head_dim):
    cache = half_cache(head_dim)
    half = attend(cache, head_dim, target)
    assert np.array_equal(half.view(np.uint32), attend(cache.astype(np.float32), head_dim, target).view(np.uint32))
    assert np.array_equal(half.view(np.uint32), attend(cache, head_dim, target, threads=2).view(np.uint32))


@pytest.mark.parametrize("target", [t for t in runnable() if t != cpu_target.NATIVE])
def test_a_portable_build_computes_what_the_native_one_does(target):
    # within float rounding, not bits: a build with FMA fuses multiply-adds that one without rounds twice
    cache = half_cache(64)
    np.testing.assert_allclose(attend(cache, 64, target), attend(cache, 64, cpu_target.NATIVE), rtol=1e-5, atol=1e-5)
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((3, 128)).astype(np.float32), rng.standard_normal((40, 128)).astype(np.float32)
    got = [matvec(Tensor(x), "f32", (Tensor(w),), w.shape, cpu_threads.shared(1, t)).numpy()
           for t in (target, cpu_target.NATIVE)]
    np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0], x @ w.T, rtol=1e-4, atol=1e-4)


# --- the decisions, as tables -----------------------------------------------------------------------------

@pytest.mark.parametrize("macros, flags, arch, missing", [
    ({"__AVX2__", "__FMA__", "__F16C__"}, {"avx2", "fma", "f16c", "sse4_2"}, "x86_64", []),
    ({"__AVX2__", "__AVX512F__", "__AVX512FP16__"}, {"avx2", "avx512f"}, "x86_64", ["avx512_fp16"]),
    ({"__SSE4_2__", "__AVX__", "__linux__"}, {"sse4_2"}, "x86_64", ["avx"]),
    ({"__ARM_FEATURE_SVE", "__ARM_FEATURE_DOTPROD"}, {"asimd", "asimddp"}, "aarch64", ["sve"]),
    ({"__AVX2__"}, set(), "riscv64", []),  # an arch without a table: nothing known to be missing
], ids=["a CPU with all of them", "no AVX512-FP16", "no AVX", "Arm without SVE", "unknown arch"])
def test_a_target_may_use_only_what_the_cpu_has(macros, flags, arch, missing):
    assert cpu_target.missing_features(macros, flags, arch) == missing


def test_cpuinfo_and_clang_macros_are_read_as_sets():
    assert cpu_target.parse_cpu_flags("processor\t: 0\nflags\t\t: fpu sse avx2\n\nflags : other") == {"fpu", "sse", "avx2"}
    assert cpu_target.parse_cpu_flags("processor : 0\nFeatures : fp asimd fphp\n") == {"fp", "asimd", "fphp"}
    assert cpu_target.parse_macros("#define __AVX2__ 1\n#define __x86_64 1\nnoise\n") == {"__AVX2__", "__x86_64"}


@pytest.mark.parametrize("target, arch, flags", [
    ("native", "x86_64", ["-march=native"]), ("x86-64-v2", "x86_64", ["-march=x86-64-v2"]),
    ("native", "aarch64", ["-mcpu=native"]), ("neoverse-n1", "aarch64", ["-mcpu=neoverse-n1"])])
def test_x86_names_its_cpu_with_march_and_arm_with_mcpu(target, arch, flags):
    assert cpu_target.arch_flags(target, arch) == flags
    assert cpu_target.cross_flags(arch, arch) == [] and cpu_target.cross_flags("aarch64", "x86_64") == [
        "--target=aarch64-linux-gnu"]


@pytest.mark.parametrize("bad", ["", "-march=native", "x86 64", "a;rm -rf", "x" * 65])
def test_a_target_that_is_no_cpu_name_is_refused_before_it_reaches_a_command_line(bad):
    with pytest.raises(ValueError, match="is not a CPU name"):
        cpu_target.check_name(bad)


@pytest.mark.parametrize("target, stderr, cause, fix", [
    ("native", "error: unknown target CPU 'foo'\nnote: valid target CPU values are: ...", "does not know this CPU",
     "PP_CPU_TARGET to the nearest CPU it knows"),
    ("znver9", "error: unknown target CPU 'znver9'", "does not know the CPU 'znver9' (PP_CPU_TARGET)",
     "--print-supported-cpus"),
    ("native", "<stdin>:1198:9: error: _Float16 is not supported on this target\n1 error generated.",
     "cannot compile pp's CPU kernels for native (<stdin>:1198:9: error: _Float16 is not supported on this target)",
     "install clang 14 or later"),
], ids=["native on a CPU clang does not know", "a target clang does not know", "any other compile error"])
def test_a_failed_build_is_explained_with_its_cause_and_fix(target, stderr, cause, fix):
    error = cpu_build.explain("Debian clang version 14.0.6", target, stderr)
    assert cause in error.cause and fix in error.fix and "\n" not in str(error)


# per host arch: a CPU's cpuinfo flags, a target it can run, one it cannot, and a feature that one needs
OLD_CPU = {"x86_64": ({"sse2", "pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16"}, "x86-64-v2", "x86-64-v3", "avx2"),
           "aarch64": ({"fp", "asimd"}, "generic", "neoverse-v1", "sve")}


def test_a_target_this_cpu_lacks_features_for_is_refused_before_its_code_can_run(monkeypatch):
    flags, runs, cannot, feature = OLD_CPU[cpu_target.host_arch()]
    monkeypatch.setattr(cpu_target, "host_cpu_flags", lambda: flags)
    cc = cpu_build.compiler()
    version = cpu_build.compiler_version(cc)
    error = cpu_build.lacking(cc, version, cannot, cpu_target.host_arch())
    assert error is not None and feature in error.cause and "this CPU lacks" in error.cause
    assert cpu_build.lacking(cc, version, runs, cpu_target.host_arch()) is None


@pytest.mark.parametrize("kernels, label", [
    (Kernels("c", device="CPU", target="native", threads=2), "c/native"),
    (Kernels("c", device="CPU", target="x86-64-v2"), "c/x86-64-v2"),
    (Kernels("tinygrad", device="CUDA"), "tinygrad/CUDA"),
    (Kernels("tinygrad", device="CPU", target="native", fallback="cause; fix"), "tinygrad/CPU (fallback)"),
    (Kernels("stub"), "stub")])
def test_a_stage_s_kernels_have_a_short_label(kernels, label):
    assert kernels.label == label


@pytest.mark.parametrize("kernels, part", [
    ((), ""), (("c/native",) * 3, " | kernels: c/native"),
    (("c/native", "tinygrad/CPU (fallback)", None), " | kernels per stage: c/native / tinygrad/CPU (fallback) / ?")])
def test_the_stats_line_names_the_kernels_once_or_per_stage(kernels, part):
    assert kernels_part(kernels) == part


def test_pp_cpu_target_is_read_once_and_a_bad_one_is_refused(tmp_path, capsys):
    env = {"PP_CLUSTER_TOKEN": "t" * 32, "STAGE": "0", "NUM_STAGES": "2"}
    assert parse_config(env, [], home=tmp_path).cpu_target == "native"
    assert parse_config({**env, "PP_CPU_TARGET": "x86-64-v2"}, [], home=tmp_path).cpu_target == "x86-64-v2"
    assert parse_config(env, ["--cpu-target", "znver3"], home=tmp_path).cpu_target == "znver3"
    with pytest.raises(SystemExit):
        parse_config({**env, "PP_CPU_TARGET": "x86 64"}, [], home=tmp_path)
    assert "PP_CPU_TARGET='x86 64': 'x86 64' is not a CPU name" in capsys.readouterr().err


@pytest.mark.parametrize("arch, flags, converts", [
    ("x86_64", {"avx2", "f16c"}, True), ("x86_64", {"sse4_2", "popcnt"}, False), ("x86_64", None, True),
    ("aarch64", {"fp", "asimd"}, True)], ids=["x86 with F16C", "x86-64-v2 without", "flags unknown", "aarch64"])
def test_float16_is_converted_in_hardware_on_x86_only_with_f16c(arch, flags, converts):
    assert converts_half(arch, flags) is converts


def test_without_f16c_the_kv_cache_defaults_to_float32_and_float16_is_refused():
    def dtype(value, converts):
        return kv_cache_dtype(Sources({"kv_cache_dtype": value}, {}, {"--kv-cache-dtype": "PP_KV_CACHE_DTYPE"}),
                              converts_half=converts)
    assert dtype(None, True) == "float16" and dtype(None, False) == "float32" and dtype("float32", False) == "float32"
    with pytest.raises(ConfigError, match="this CPU has no F16C"):
        dtype("float16", False)


# --- the fallback: tinygrad's own kernels ----------------------------------------------------------------

UNKNOWN = "pp-no-such-cpu"


def test_a_cpu_clang_does_not_know_leaves_the_stage_on_tinygrad_s_kernels_saying_why():
    kernels, pool = cpu_kernels.open_kernels(1, UNKNOWN)
    assert pool is None and kernels.name == "tinygrad" and kernels.device == "CPU" and kernels.target == UNKNOWN
    assert f"does not know the CPU '{UNKNOWN}'" in kernels.fallback and "set PP_CPU_TARGET" in kernels.fallback


def test_a_source_that_does_not_compile_leaves_the_stage_on_tinygrad_s_kernels(monkeypatch):
    monkeypatch.setattr(cpu_threads, "library_source", lambda: "#error forced by the test\n")
    monkeypatch.setattr(cpu_threads, "_LIBRARIES", {})
    monkeypatch.setattr(cpu_threads, "shared", cpu_threads.shared.__wrapped__)  # no pool of an earlier build
    kernels, pool = cpu_kernels.open_kernels.__wrapped__(1, OLD_CPU[cpu_target.host_arch()][1])
    assert pool is None and kernels.name == "tinygrad"
    assert "cannot compile pp's CPU kernels" in kernels.fallback and "forced by the test" in kernels.fallback


def test_tinygrad_s_kernels_give_the_c_kernels_greedy_tokens_on_tiny():
    ids = tinygrad_model(TinySource()).tokenizer().encode_chat("Say hello")
    c, fallback = (generate_full(tinygrad_model(TinySource(), cpu_target=t), ids, 16) for t in ("native", UNKNOWN))
    assert fallback.token_ids == c.token_ids
    np.testing.assert_allclose(np.stack(fallback.logits), np.stack(c.logits), rtol=0, atol=1e-3)


async def test_a_cluster_whose_kernels_cannot_be_built_answers_and_names_the_fallback(nursery, tmp_path):
    orch, urls, _ = await start_cluster(nursery, 2, tmp_path, model="tiny", cpu_target=UNKNOWN)
    with trio.fail_after(120):
        response = await orch.submit("Say hello", max_tokens=12)
    model = tinygrad_model(TinySource())
    assert list(response.token_ids) == generate_full(model, model.tokenizer().encode_chat("Say hello"), 12).token_ids
    async with client_http(headers={"Authorization": f"Bearer {API_KEY}"}) as client:  # every stage speaks TLS
        for url in urls:
            kernels = (await client.get(url + "/health")).json()["kernels"]
            assert kernels["name"] == "tinygrad" and f"does not know the CPU '{UNKNOWN}'" in kernels["fallback"]
            metrics = (await client.get(url + "/metrics")).text
            assert (f'pp_kernels_info{{device="CPU",fallback="1",kernels="tinygrad",model_name="tiny",'
                    f'target="{UNKNOWN}"}} 1.0') in metrics, metrics
    nursery.cancel_scope.cancel()


def test_without_a_compiler_nothing_falls_back_and_the_error_names_the_fix(monkeypatch):
    """tinygrad's CPU backend compiles with the same clang: with none there is nothing to fall back on, so the
    load fails with one line naming the cause and the fix (ppnode exits 1 with it as model_load_failed)."""
    monkeypatch.setattr(cpu_build, "compiler", lambda: "/nonexistent/clang")
    monkeypatch.setattr(cpu_threads, "_LIBRARIES", {})
    monkeypatch.setattr(cpu_threads, "shared", cpu_threads.shared.__wrapped__)
    with pytest.raises(cpu_build.CompilerMissing) as info:
        cpu_kernels.open_kernels.__wrapped__(1, cpu_target.NATIVE)
    assert "no C compiler '/nonexistent/clang'" in str(info.value) and "apt install clang" in str(info.value)
    assert "\n" not in str(info.value)


def test_every_label_a_stage_can_have_is_one_gossip_carries():
    from node.membership.gossip import Meta
    for kernels in (Kernels("c", device="CPU", target="a" * 64), Kernels("c", device="CPU", target="neoverse-n1+crypto"),
                    Kernels("tinygrad", device="CPU", target="x" * 64, fallback="cause; fix"),
                    Kernels("tinygrad", device="CUDA")):
        assert Meta(kernels=kernels.label).kernels == kernels.label
    with pytest.raises(ValueError, match="Meta.kernels"):
        Meta(kernels="c/\\nnative")
