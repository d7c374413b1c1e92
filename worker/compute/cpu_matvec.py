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

The C is a tinygrad CUSTOM op (its renderer pastes the text in with the buffers' names), one kernel per
(kind, rows, out, in), compiled and cached like any other kernel (worker/compute/kernel_cache.py).
Scales are float32 on the device (`device_parts`): freestanding C on x86 has no portable float16 load.
"""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor, UOp, dtypes
from tinygrad.uop.ops import KernelInfo, Ops

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


def source(kind: str, rows: int, out: int, inp: int) -> str:
    """The kernel body: y (rows, out) = x (rows, inp) @ W.T, W as quant bytes and float32 scales.

    Rows go in tiles of up to TILE, so that a decoded block serves them all from registers; every row's
    sums are formed in the same order whatever tile it is in."""
    nb, qbytes, ns = inp // BLOCK, _QBYTES[kind], _SCALES[kind]
    affine = kind == "q4_1"
    tiles = [(r, min(TILE, rows - r)) for r in range(0, rows, TILE)]
    lines = ["{", _HEAD, "float* y = @0; const float* x = @1; const unsigned char* q = (const unsigned char*)@2;"]
    if ns:
        lines.append("const float* scale = @3;")
    if affine:  # Σx of every row's blocks, for Q4_1's min term
        lines.append(f"float xs[{rows * nb}];")
        lines.append(f"for (int b = 0; b < {rows}; b++) for (int k = 0; k < {nb}; k++) {{ float s = 0;"
                     f" for (int j = 0; j < 32; j++) s += x[b*{inp} + k*32 + j]; xs[b*{nb} + k] = s; }}")
    lines.append(f"for (int o = 0; o < {out}; o++) {{")
    lines.append(f"  const unsigned char* qo = q + (long)o*{nb * qbytes};" +
                 (f" const float* so = scale + (long)o*{nb * ns};" if ns else ""))
    for first, n in tiles:
        rs = range(first, first + n)
        lines.append("  {")
        lines.append("    " + " ".join(f"v8f a{r} = 0; float m{r} = 0;" for r in rs))
        lines.append(f"    for (int k = 0; k < {nb}; k++) {{")
        lines.append(f"      const unsigned char* qb = qo + k*{qbytes};" + (f" const float* sc = so + k*{ns};" if ns else ""))
        lines.append("      " + _DECODE[kind])
        for r in rs:
            lines.append(f"      {{ const float* xb = x + {r * inp} + k*32; v8f x0, x1, x2, x3;")
            lines.append("        __builtin_memcpy(&x0, xb, 32); __builtin_memcpy(&x1, xb + 8, 32);"
                         " __builtin_memcpy(&x2, xb + 16, 32); __builtin_memcpy(&x3, xb + 24, 32);")
            lines.append("        v8f p = c0*x0 + c1*x1 + c2*x2 + c3*x3;")
            lines.append(f"        a{r} += sc[0] * p;" if ns else f"        a{r} += p;")
            if affine:
                lines.append(f"        m{r} += sc[1] * xs[{r * nb} + k];")
            lines.append("      }")
        lines.append("    }")
        for r in rs:
            lines.append(f"    {{ v8f t = a{r}; y[{r * out} + o] = "
                         f"((t[0]+t[1]) + (t[2]+t[3])) + ((t[4]+t[5]) + (t[6]+t[7])) + m{r}; }}")
        lines.append("  }")
    lines.append("}")
    lines.append("}")
    return custom_text("\n".join(lines), 4 if ns else 3)


def custom_text(body: str, buffers: int) -> str:
    """C as a CUSTOM op's text: tinygrad formats it with the buffers' names, so C's braces are doubled
    and @i becomes argument i."""
    text = body.replace("{", "{{").replace("}", "}}")
    for i in range(buffers):
        text = text.replace(f"@{i}", f"{{{i}}}")
    return text


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


def _raw(u: UOp) -> UOp:
    while u.op is Ops.RESHAPE:  # the C indexes flat buffers itself
        u = u.src[0]
    return u


def c_kernel(name: str, text: str, out_shape: tuple[int, ...], *inputs: Tensor) -> Tensor:
    """A float32 tensor of `out_shape` written by the C `text` (custom_text), given `inputs` as @1, @2, ..."""
    def kernel(*buffers: UOp) -> UOp:
        body = UOp(Ops.CUSTOM, dtypes.void, tuple(_raw(u) for u in buffers), text)
        return body.sink(arg=KernelInfo(name=name, opts_to_apply=()))
    return Tensor.empty(*out_shape).custom_kernel(*inputs, fxn=kernel)[0]


def matvec(x: Tensor, kind: str, parts: tuple[Tensor, ...], shape: tuple[int, int]) -> Tensor:
    """x (rows, in) float32 → (rows, out) float32 through the C kernel for `kind`."""
    rows, (out, inp) = x.shape[0], shape
    return c_kernel(f"{kind}_mv_{rows}_{out}_{inp}", source(kind, rows, out, inp), (rows, out), x.contiguous(), *parts)
