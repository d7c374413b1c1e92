"""Attention over the KV cache on the CPU device, as hand-written C that a tinygrad kernel calls.

tinygrad 0.14's kernels for a step's attention (gather the slot's keys, scores, mask, softmax, values)
ran at under 1 GFLOP/s here: at 300 cached positions they cost 10 SmolLM2 blocks ~7 ms a row more, as
much as the row's matrices, so prompt rows were dear and a prefill stalled the streams beside it
(issue 25, `bench.stall`). This kernel reads each row's keys and values straight from its slot's cache
rows, up to its own position, in one pass per head: scores, their maximum, exp, the weighted values.

Per row and head, in this order (the same whatever rows share the step): s_l = (q · k_l) · scale for
l <= position; p_l = exp(s_l - max s); out = (Σ p_l v_l) / Σ p_l. exp is a polynomial of our own (the
kernels are freestanding C, without libm): 2^(x log2 e) split into 2^n by the exponent bits and 2^f by
a degree-6 polynomial, relative error ~2e-7, within float-summation tolerance of tinygrad's softmax.
The (row, head) pairs are split over the stage's threads (cpu_threads.py); each pair's arithmetic is the
same on any of them.

A float16 cache (--kv-cache-dtype float16) is read by the same code, each 8 keys or values widened to float32
as they are loaded, so only the stored values differ from float32's. The cache is read as 16-bit integers, not
as a C half type: clang before 15 accepts `_Float16` on x86 only with AVX512-FP16 (Sapphire Rapids and later),
and `__fp16` arithmetic on x86 calls a compiler-rt routine the library may not link (issue 53). The widening
is F16C's vcvtph2ps where the target has it (every x86-64-v3 CPU, Haswell and Zen on), the Arm half type's
fcvtl on aarch64, and integer bit moves elsewhere (x86-64-v2): each gives every float16's exact float32 value,
so every target computes the same bits (tests/test_cpu_targets.py).
"""
from __future__ import annotations

from tinygrad import Tensor

from .cpu_jobs import c_kernel, trampoline

HEAD_DIMS = (32, 64, 96, 128, 256)  # specialised (constant loop bounds); any other multiple of 8 is generic
# a cache's tinygrad dtype: name suffix, C type (a float16 is read as its bits)
CACHE_TYPES = {"float": ("", "float"), "half": ("h", "unsigned short")}
WORK = tuple(f"pp_attention{suffix}_{hd}" for suffix, _ in CACHE_TYPES.values() for hd in HEAD_DIMS) + \
    tuple(f"pp_attention{suffix}" for suffix, _ in CACHE_TYPES.values())
_LOAD = {"float": "__builtin_memcpy(&{dst}, {src}, 32);", "unsigned short": "pp_half8(&{dst}, {src});"}

# 8 float16s (their bits) widened to float32, exactly, by whatever the target has.
HALF8_C = r"""typedef unsigned short v8u16 __attribute__((ext_vector_type(8)));
typedef unsigned int v8u32 __attribute__((ext_vector_type(8)));
static inline void pp_half8(v8f* dst, const unsigned short* src) {
  v8u16 t; __builtin_memcpy(&t, src, 16);
#if defined(__F16C__)
  typedef short v8s __attribute__((__vector_size__(16)));
  *dst = (v8f)__builtin_ia32_vcvtph2ps256((v8s)t);
#elif defined(__aarch64__)
  typedef __fp16 v8h __attribute__((ext_vector_type(8)));
  v8h h; __builtin_memcpy(&h, &t, 16); *dst = __builtin_convertvector(h, v8f);
#else  /* the bits: exponent rebased (15 -> 127), subnormals normalised by one exact subtraction, inf/NaN kept */
  v8u32 h = __builtin_convertvector(t, v8u32), em = h & 0x7fffu, e = em & 0x7c00u, sub = (v8u32)(e == 0u);
  v8u32 bits = (em << 13) + (112u << 23) + ((v8u32)(e == 0x7c00u) & (112u << 23)) + (sub & (1u << 23));
  v8u32 magic = sub & (113u << 23);  /* 2^-14 where subnormal, +0 elsewhere */
  v8f f, m; __builtin_memcpy(&f, &bits, 32); __builtin_memcpy(&m, &magic, 32);
  f -= m; __builtin_memcpy(&bits, &f, 32); bits |= (h & 0x8000u) << 16; __builtin_memcpy(dst, &bits, 32);
#endif
}"""


def _work(name: str, head_dim: str, elem: str = "float") -> str:
    """C: items lo..hi-1 of the (row, head) pairs; job p = y, q, cache, ints; n = rows, heads, kv_heads,
    head_dim, max_context; f = scale. `elem`: the cache's C type (float, or unsigned short: float16 bits)."""
    load_k, load_v = _LOAD[elem].format(dst="kv", src="k + 8*i"), _LOAD[elem].format(dst="vv", src="v + 8*i")
    return f"""void {name}(const struct pp_job* j, long lo, long hi) {{
  float* y = j->p[0]; const float* q = j->p[1]; const {elem}* cache = j->p[2]; const int* ints = j->p[3];
  long rows = j->n[0], heads = j->n[1], kv_heads = j->n[2], max_context = j->n[4];
  const long head_dim = {head_dim}, vec = head_dim / 8, group = heads / kv_heads, width = 2 * kv_heads * head_dim;
  const float scale = j->f[0];
  float s[max_context];
  for (long item = lo; item < hi; item++) {{
    long b = item / heads, h = item % heads, g = h / group;
    int pos = ints[b], slot = ints[rows + b];
    const {elem}* base = cache + (long)slot * max_context * width;
    const float* qh = q + b * heads * head_dim + h * head_dim;
    v8f qv[vec]; for (long i = 0; i < vec; i++) __builtin_memcpy(&qv[i], qh + 8*i, 32);
    float m = -3.0e38f;
    for (int l = 0; l <= pos; l++) {{
      const {elem}* k = base + (long)l * width + g * head_dim;
      v8f acc = 0; for (long i = 0; i < vec; i++) {{ v8f kv; {load_k} acc += qv[i] * kv; }}
      float d = (((acc[0]+acc[1]) + (acc[2]+acc[3])) + ((acc[4]+acc[5]) + (acc[6]+acc[7]))) * scale;
      s[l] = d; if (d > m) m = d;
    }}
    float total = 0; v8f o[vec]; for (long i = 0; i < vec; i++) o[i] = 0;
    for (int l = 0; l <= pos; l++) {{
      float x = s[l] - m, p = 0.0f;
      if (x > -87.0f) {{  /* exp(x) = 2^n 2^f, f in [-1/2, 1/2] */
        float e = x * 1.44269504088896341f, n = __builtin_floorf(e + 0.5f), f = e - n;
        float t = 1.535336188319500e-4f;
        t = t * f + 1.339887440266574e-3f; t = t * f + 9.618437357674640e-3f; t = t * f + 5.550332471162809e-2f;
        t = t * f + 2.402264791363012e-1f; t = t * f + 6.931472028550421e-1f; t = t * f + 1.0f;
        union {{ float f; int i; }} u; u.i = ((int)n + 127) << 23; p = t * u.f;
      }}
      total += p;
      const {elem}* v = base + (long)l * width + kv_heads * head_dim + g * head_dim;
      for (long i = 0; i < vec; i++) {{ v8f vv; {load_v} o[i] += p * vv; }}
    }}
    float inv = 1.0f / total;
    float* yh = y + b * heads * head_dim + h * head_dim;
    for (long i = 0; i < vec; i++) {{ v8f r = o[i] * inv; __builtin_memcpy(yh + 8*i, &r, 32); }}
  }}
}}"""


def work_source() -> str:
    """The library's attention kernels (cpu_threads.py): for each cache dtype, one per common head size and a
    generic one."""
    out = [HALF8_C]
    for suffix, elem in CACHE_TYPES.values():
        out += [_work(f"pp_attention{suffix}_{hd}", str(hd), elem) for hd in HEAD_DIMS]
        out.append(_work(f"pp_attention{suffix}", "j->n[3]", elem))
    return "\n".join(out)


def attention(q: Tensor, cache: Tensor, ints: Tensor, *, heads: int, kv_heads: int, head_dim: int,
              max_context: int, threads) -> Tensor:
    """q (rows, heads·head_dim) float32 → (rows, heads·head_dim): each row attends to its slot's cached
    positions 0..its own (ints: position, slot, cache row per row), the (row, head) pairs split over
    `threads` (cpu_threads.CpuThreads). The cache is float32 or float16."""
    if head_dim % 8:
        raise ValueError(f"head_dim {head_dim} is not a multiple of 8")
    rows, suffix = q.shape[0], CACHE_TYPES[cache.dtype.name][0]
    work = f"pp_attention{suffix}_{head_dim}" if head_dim in HEAD_DIMS else f"pp_attention{suffix}"
    text = trampoline(threads.slot(work), 4, (rows, heads, kv_heads, head_dim, max_context), rows * heads,
                      (1.0 / head_dim ** 0.5,))
    return c_kernel(f"attention{suffix}_{rows}_{heads}_{kv_heads}_{head_dim}", text, (rows, heads * head_dim),
                    q.contiguous(), cache, ints, threads.table)
