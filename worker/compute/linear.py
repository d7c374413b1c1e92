"""Weights on the device in their file's precision, and the matmul that widens them as it reads them.

On the CPU, F32, Q8_0 and Q4_1 weights (whose `in` is a multiple of 32) go through hand-written C kernels
(worker/compute/cpu_matvec.py): faster than either form below for every row count measured (issue 25).
Elsewhere, and for F16/BF16, two forms of x @ W.T:
- plain: tinygrad's own matmul over the widened weight.
- split: the reduction over `in` cut into blocks of 32 whose partial sums are kept per lane and added
  at the end, so that a searched (BEAM) kernel keeps many independent accumulators instead of one chain
  of dependent adds while it widens each weight.
Measured with BEAM=2 on the 312 M model, one row (`python -m bench.matmul_form`, docs/benchmarks.md): one
block + the 128k-row head from Q8_0 85 → 24 ms plain → split, from F16 102 → 44 ms, but from F32 51 → 68 ms,
and 4 F32 blocks 18 → 26 ms. So a weight takes the split form only when kernels are searched and it is narrow; untuned, the
plain form is the faster for every kind. Both read each weight once a step and widen it in registers;
their sums differ only in order.
"""
from __future__ import annotations

import attrs
from tinygrad import Tensor, dtypes

from . import cpu_matvec, cpu_threads
from ..weights.packed import BLOCKED, Q8_BLOCK, Packed

SPLIT = Q8_BLOCK  # the lanes of a split reduction: one Q8_0 block, so that its scale applies to one lane group


@attrs.frozen(eq=False)
class DeviceWeight:
    kind: str  # as Packed.kind
    parts: tuple[Tensor, ...]
    shape: tuple[int, int]  # (out, in)
    hand_written: bool = False  # the parts are cpu_matvec's and its C kernel computes x @ W.T


def to_device(packed: Packed, put, *, hand_written: bool) -> DeviceWeight:
    """`put(array) -> Tensor` places each part (in place on the CPU, a copy elsewhere). `hand_written`: pp's CPU
    kernels compute (cpu_kernels.py): an F32, Q8_0 or Q4_1 weight that cpu_matvec handles goes in its layout."""
    if hand_written and cpu_matvec.handles(packed.kind, packed.shape):
        parts = cpu_matvec.device_parts(packed.kind, packed.parts)
        return DeviceWeight(packed.kind, tuple(put(p) for p in parts), packed.shape, hand_written=True)
    return DeviceWeight(packed.kind, tuple(put(p) for p in packed.parts), packed.shape)


def _blocked(w: DeviceWeight) -> Tensor:
    """The weight widened to float32, lazily, as (out, in // SPLIT, SPLIT)."""
    out, inp = w.shape
    if w.kind == "q8_0":
        q, scale = w.parts
        return q.cast(dtypes.float32) * scale.cast(dtypes.float32)
    if w.kind == "q4_1":  # ggml's order: d*q, then + m
        qs, dm = w.parts
        values = (qs & 0x0F).cat(qs.rshift(4), dim=-1).cast(dtypes.float32)
        return values * dm[..., 0:1].cast(dtypes.float32) + dm[..., 1:2].cast(dtypes.float32)
    return _widened(w).reshape(out, inp // SPLIT, SPLIT)


def linear(x: Tensor, w: DeviceWeight, *, searched: bool, threads=None) -> Tensor:
    """x (rows, in) float32 @ W.T -> (rows, out) float32; `searched`: the kernels will be searched (BEAM);
    `threads`: the CPU pool a hand-written weight's kernel runs on (cpu_threads.CpuThreads; None: one thread)."""
    if w.hand_written:
        return cpu_matvec.matvec(x, w.kind, w.parts, w.shape, threads or cpu_threads.shared(1))
    if not searched or w.kind == "f32" or w.shape[1] % SPLIT:
        return plain(x, w)
    return split(x, w)


def plain(x: Tensor, w: DeviceWeight) -> Tensor:
    out, inp = w.shape
    return x @ (_blocked(w).reshape(out, inp) if w.kind in BLOCKED else _widened(w)).T


def split(x: Tensor, w: DeviceWeight) -> Tensor:
    """`in` must be a multiple of SPLIT."""
    inp = w.shape[1]
    return (x.reshape(x.shape[0], 1, inp // SPLIT, SPLIT) * _blocked(w)).sum(-2).sum(-1)


def _widened(w: DeviceWeight) -> Tensor:
    [t] = w.parts
    if w.kind == "f32":
        return t
    if w.kind == "bf16":  # bf16 is the high half of an f32: widening is exact
        return (t.cast(dtypes.uint32) * 65536).bitcast(dtypes.float32)
    return t.cast(dtypes.float32)

