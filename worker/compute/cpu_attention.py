"""Attention over the KV cache on the CPU device, as hand-written C inside a tinygrad kernel.

tinygrad 0.14's kernels for a step's attention (gather the slot's keys, scores, mask, softmax, values)
ran at under 1 GFLOP/s here: at 300 cached positions they cost 10 SmolLM2 blocks ~7 ms a row more, as
much as the row's matrices, so prompt rows were dear and a prefill stalled the streams beside it
(issue 25, `bench.stall`). This kernel reads each row's keys and values straight from its slot's cache
rows, up to its own position, in one pass per head: scores, their maximum, exp, the weighted values.

Per row and head, in this order (the same whatever rows share the step): s_l = (q · k_l) · scale for
l <= position; p_l = exp(s_l - max s); out = (Σ p_l v_l) / Σ p_l. exp is a polynomial of our own (the
kernels are freestanding C, without libm): 2^(x log2 e) split into 2^n by the exponent bits and 2^f by
a degree-6 polynomial, relative error ~2e-7, within float-summation tolerance of tinygrad's softmax.
"""
from __future__ import annotations

from tinygrad import Tensor

from .cpu_matvec import c_kernel, custom_text

def source(rows: int, heads: int, kv_heads: int, head_dim: int, max_context: int) -> str:
    """y (rows, heads·head_dim) from q (rows, heads·head_dim), the cache (slots·max_context, 2·kv_heads·head_dim)
    and the step's ints (3, rows): position, slot, cache row."""
    if head_dim % 8:
        raise ValueError(f"head_dim {head_dim} is not a multiple of 8")
    vec, group, width = head_dim // 8, heads // kv_heads, 2 * kv_heads * head_dim
    scale = 1.0 / head_dim ** 0.5
    body = f"""{{
typedef float v8f __attribute__((ext_vector_type(8)));
float* y = @0; const float* q = @1; const float* cache = @2; const int* ints = @3;
float s[{max_context}];
for (int b = 0; b < {rows}; b++) {{
  int pos = ints[b], slot = ints[{rows} + b];
  const float* base = cache + (long)slot * {max_context} * {width};
  for (int h = 0; h < {heads}; h++) {{
    int g = h / {group};
    const float* qh = q + (long)b * {heads * head_dim} + h * {head_dim};
    v8f qv[{vec}]; for (int i = 0; i < {vec}; i++) __builtin_memcpy(&qv[i], qh + 8*i, 32);
    float m = -3.0e38f;
    for (int l = 0; l <= pos; l++) {{
      const float* k = base + (long)l * {width} + g * {head_dim};
      v8f acc = 0; for (int i = 0; i < {vec}; i++) {{ v8f kv; __builtin_memcpy(&kv, k + 8*i, 32); acc += qv[i] * kv; }}
      float d = (((acc[0]+acc[1]) + (acc[2]+acc[3])) + ((acc[4]+acc[5]) + (acc[6]+acc[7]))) * {scale!r}f;
      s[l] = d; if (d > m) m = d;
    }}
    float total = 0; v8f o[{vec}]; for (int i = 0; i < {vec}; i++) o[i] = 0;
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
      const float* v = base + (long)l * {width} + {kv_heads * head_dim} + g * {head_dim};
      for (int i = 0; i < {vec}; i++) {{ v8f vv; __builtin_memcpy(&vv, v + 8*i, 32); o[i] += p * vv; }}
    }}
    float inv = 1.0f / total;
    float* yh = y + (long)b * {heads * head_dim} + h * {head_dim};
    for (int i = 0; i < {vec}; i++) {{ v8f r = o[i] * inv; __builtin_memcpy(yh + 8*i, &r, 32); }}
  }}
}}
}}"""
    return custom_text(body, 4)


def attention(q: Tensor, cache: Tensor, ints: Tensor, *, heads: int, kv_heads: int, head_dim: int,
              max_context: int) -> Tensor:
    """q (rows, heads·head_dim) float32 → (rows, heads·head_dim): each row attends to its slot's cached
    positions 0..its own (ints: position, slot, cache row per row)."""
    rows = q.shape[0]
    return c_kernel(f"attention_{rows}_{heads}_{kv_heads}_{head_dim}", source(rows, heads, kv_heads, head_dim, max_context),
                    (rows, heads * head_dim), q.contiguous(), cache, ints)
