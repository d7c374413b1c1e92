"""Matrix × rows for F32, Q8_0 and Q4_1 weights on the CPU device, as hand-written C inside a tinygrad kernel.

tinygrad 0.14's own kernels for a packed weight widen it one scalar at a time: on this project's 2-core
box one 1536x576 matvec took 1.57 ms from Q4_1, 0.99 from Q8_0 and 0.94 from F32 untuned, against 0.32, 0.34
and 0.44 here (`python -m bench.kernels`, docs/benchmarks.md, issue 25). These kernels decode each block of 32 weights once into four 8-lane float vectors, with the
compiler's vector extensions (clang builds them, as every tinygrad CPU kernel, with -march=native), and
multiply them into every row of the step before moving on, so a batched step reads the weights once.

Arithmetic, per row and output (the same whatever the rows beside it, so batched equals solo exactly):
- F32: y = Σ_blocks (w · x), the block's 32 products summed as four 8-lane vectors, lane by lane.
- Q8_0: y = Σ_blocks d · (q · x), the block's 32 products summed as four 8-lane vectors, lane by lane.
- Q4_1: y = Σ_blocks (d · (q · x) + m · Σx): ggml's d·q + m folded into the dot product; against the
  widened weights it differs only in rounding (float-summation tolerance, tests/test_cpu_matvec.py).
The activations stay float32: llama.cpp quantizes them to 8 bits for integer dot products, which would
change the answers.

The C is compiled once per machine into cpu_threads.py's library (`work_source`: one function per kind, a
tile function per row count up to TILE); the step's tinygrad kernel (a CUSTOM op, one per (kind, rows, out,
in)) is a trampoline that hands it the job, split by output over the stage's threads (cpu_jobs.py).
Scales are float32 on the device (`device_parts`): C on x86 has no portable float16 load.
"""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor

from .cpu_jobs import c_kernel, trampoline

KINDS = frozenset({"f32", "q8_0", "q4_1"})
BLOCK = 32

_HEAD = r"""typedef float v8f __attribute__((ext_vector_type(8)));
typedef unsigned char v16u __attribute__((ext_vector_type(16)));
typedef signed char v32s __attribute__((ext_vector_type(32)));"""

# Four 8-lane vectors of one block's weights, c0..c3 (values 0-7, 8-15, 16-23, 24-31), from its bytes.
_DECODE = {
    "f32": r"""const float* wb = (const float*)qb; v8f c0, c1, c2, c3;
      __builtin_memcpy(&c0, wb, 32); __builtin_memcpy(&c1, wb + 8, 32);
      __builtin_memcpy(&c2, wb + 16, 32); __builtin_memcpy(&c3, wb + 24, 32);""",
    "q4_1": r"""v16u v; __builtin_memcpy(&v, qb, 16);
      v16u lo = v & (unsigned char)15, hi = v >> 4;
      v8f c0 = __builtin_convertvector(__builtin_shufflevector(lo, lo, 0,1,2,3,4,5,6,7), v8f);
      v8f c1 = __builtin_convertvector(__builtin_shufflevector(lo, lo, 8,9,10,11,12,13,14,15), v8f);
      v8f c2 = __builtin_convertvector(__builtin_shufflevector(hi, hi, 0,1,2,3,4,5,6,7), v8f);
      v8f c3 = __builtin_convertvector(__builtin_shufflevector(hi, hi, 8,9,10,11,12,13,14,15), v8f);""",
    "q8_0": r"""v32s v; __builtin_memcpy(&v, qb, 32);
      v8f c0 = __builtin_convertvector(__builtin_shufflevector(v, v, 0,1,2,3,4,5,6,7), v8f);
      v8f c1 = __builtin_convertvector(__builtin_shufflevector(v, v, 8,9,10,11,12,13,14,15), v8f);
      v8f c2 = __builtin_convertvector(__builtin_shufflevector(v, v, 16,17,18,19,20,21,22,23), v8f);
      v8f c3 = __builtin_convertvector(__builtin_shufflevector(v, v, 24,25,26,27,28,29,30,31), v8f);""",
}
_QBYTES = {"f32": 128, "q4_1": 16, "q8_0": 32}  # weight bytes per block
_SCALES = {"f32": 0, "q4_1": 2, "q8_0": 1}  # float32 scales per block on the device: d (and m)


TILE = 8  # rows that share one decoded block in registers: 8 accumulators of 8 lanes, plus the block's 4
WORK = tuple(f"pp_mv_{kind}" for kind in sorted(KINDS))  # the library's work functions (cpu_threads.py)


def _tile(kind: str, n: int) -> list[str]:
    """C: output o of rows first..first+n-1, from the weight row's blocks (qo, so); each row's sum is formed
    in the same order whatever tile, range or thread it is in."""
    qbytes, ns, affine = _QBYTES[kind], _SCALES[kind], kind == "q4_1"
    rs = range(n)
    lines = [f"static inline void {kind}_tile{n}(float* y, const float* x, const unsigned char* qo, const float* so,"
             " const float* xs, long first, long o, long out, long inp, long nb) {",
             "  " + " ".join(f"v8f a{r} = 0; float m{r} = 0;" for r in rs),
             "  for (long k = 0; k < nb; k++) {",
             f"    const unsigned char* qb = qo + k*{qbytes};" + (f" const float* sc = so + k*{ns};" if ns else ""),
             "    " + _DECODE[kind]]
    for r in rs:
        lines.append(f"    {{ const float* xb = x + (first + {r})*inp + k*32; v8f x0, x1, x2, x3;")
        lines.append("      __builtin_memcpy(&x0, xb, 32); __builtin_memcpy(&x1, xb + 8, 32);"
                     " __builtin_memcpy(&x2, xb + 16, 32); __builtin_memcpy(&x3, xb + 24, 32);")
        lines.append("      v8f p = c0*x0 + c1*x1 + c2*x2 + c3*x3;")
        lines.append(f"      a{r} += sc[0] * p;" if ns else f"      a{r} += p;")
        if affine:
            lines.append(f"      m{r} += sc[1] * xs[(first + {r})*nb + k];")
        lines.append("    }")
    lines.append("  }")
    for r in rs:
        lines.append(f"  {{ v8f t = a{r}; y[(first + {r})*out + o] = "
                     f"((t[0]+t[1]) + (t[2]+t[3])) + ((t[4]+t[5]) + (t[6]+t[7])) + m{r}; }}")
    lines.append("}")
    return lines


def _work(kind: str) -> list[str]:
    """C: pp_mv_<kind>, outputs lo..hi-1 of y (rows, out) = x (rows, inp) @ W.T; job p = y, x, q, scale and
    n = rows, out, inp."""
    ns, affine = _SCALES[kind], kind == "q4_1"
    lines = [f"void pp_mv_{kind}(const struct pp_job* j, long lo, long hi) {{",
             "  float* y = j->p[0]; const float* x = j->p[1]; const unsigned char* q = j->p[2];",
             "  const float* scale = j->p[3]; long rows = j->n[0], out = j->n[1], inp = j->n[2], nb = inp / 32;",
             "  float* xs = 0;"]
    if affine:  # Σx of every row's blocks, for Q4_1's min term
        lines += ["  float sums[rows * nb]; xs = sums;",
                  "  for (long b = 0; b < rows; b++) for (long k = 0; k < nb; k++) { float s = 0;",
                  "    for (int i = 0; i < 32; i++) s += x[b*inp + k*32 + i]; xs[b*nb + k] = s; }"]
    lines += ["  for (long o = lo; o < hi; o++) {",
              f"    const unsigned char* qo = q + o*nb*{_QBYTES[kind]};" + (f" const float* so = scale + o*nb*{ns};"
                                                                          if ns else " const float* so = scale;"),
              "    for (long first = 0; first < rows; first += 8) {",
              "      switch (rows - first < 8 ? rows - first : 8) {"]
    lines += [f"        case {n}: {kind}_tile{n}(y, x, qo, so, xs, first, o, out, inp, nb); break;"
              for n in range(1, TILE + 1)]
    lines += ["      }", "    }", "  }", "}"]
    return lines


def work_source() -> str:
    """The library's matrix kernels (cpu_threads.py), every kind and tile size."""
    lines = [_HEAD]
    for kind in sorted(KINDS):
        for n in range(1, TILE + 1):
            lines += _tile(kind, n)
        lines += _work(kind)
    return "\n".join(lines)


def device_parts(kind: str, parts: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """A weight's parts as these kernels read them: f32 as it is; Q8_0 and Q4_1 as quant bytes (out, blocks,
    bytes) in uint8 and float32 scales (out, blocks, d[, m]), exact widenings of the file's float16."""
    if kind == "f32":
        return parts
    q, scale = parts
    return q.view(np.uint8), scale.astype(np.float32)


def handles(kind: str, shape: tuple[int, int]) -> bool:
    """Whether a weight of this kind and (out, in) goes through these kernels."""
    return kind in KINDS and shape[1] % BLOCK == 0


def matvec(x: Tensor, kind: str, parts: tuple[Tensor, ...], shape: tuple[int, int], threads) -> Tensor:
    """x (rows, in) float32 → (rows, out) float32 through the C kernel for `kind`, on `threads`
    (cpu_threads.CpuThreads)."""
    rows, (out, inp) = x.shape[0], shape
    text = trampoline(threads.slot(f"pp_mv_{kind}"), 1 + 1 + len(parts), (rows, out, inp), out)
    return c_kernel(f"{kind}_mv_{rows}_{out}_{inp}", text, (rows, out), x.contiguous(), *parts, threads.table)
