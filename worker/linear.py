"""Weights on the device in their file's precision, and the matmul that widens them as it reads them.

Two forms of x @ W.T, picked by the model for the whole graph:
- plain: tinygrad's own matmul over the widened weight; its hand-picked kernels are the faster form
  when kernels are not searched.
- split: the reduction over `in` cut into blocks of 32 whose partial sums are kept per lane and added
  at the end. A searched (BEAM) kernel then keeps many independent accumulators instead of one chain of
  dependent adds; measured on one (2816 × 1024) weight, one row, BEAM=2: f32 0.98 → 0.75 ms, f16
  2.2 → 0.58 ms, Q8_0 1.13 → 0.55 ms. Without search the same form is slower (f32 1.25 → 2.1 ms).
Both read each weight once per step and widen it in registers; the sums differ from each other only in
their order.
"""
from __future__ import annotations

import attrs
from tinygrad import Tensor, dtypes

from .packed import Q8_BLOCK, Packed

SPLIT = Q8_BLOCK  # the lanes of a split reduction: one Q8_0 block, so that its scale applies to one lane group


@attrs.frozen(eq=False)
class DeviceWeight:
    kind: str  # as Packed.kind
    parts: tuple[Tensor, ...]
    shape: tuple[int, int]  # (out, in)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def to_device(packed: Packed, put) -> DeviceWeight:
    """`put(array) -> Tensor` places each part (in place on the CPU, a copy elsewhere)."""
    return DeviceWeight(packed.kind, tuple(put(p) for p in packed.parts), packed.shape)


def blocked(w: DeviceWeight) -> Tensor:
    """The weight widened to float32, lazily, as (out, in // SPLIT, SPLIT)."""
    out, inp = w.shape
    if w.kind == "q8_0":
        q, scale = w.parts
        return q.cast(dtypes.float32) * scale.cast(dtypes.float32)
    return _widened(w).reshape(out, inp // SPLIT, SPLIT)


def linear(x: Tensor, w: DeviceWeight, *, split: bool) -> Tensor:
    """x (rows, in) float32 @ W.T -> (rows, out) float32."""
    out, inp = w.shape
    if not split or inp % SPLIT:
        full = blocked(w).reshape(out, inp) if w.kind == "q8_0" else _widened(w)
        return x @ full.T
    rows = x.shape[0]
    return (x.reshape(rows, 1, inp // SPLIT, SPLIT) * blocked(w)).sum(-2).sum(-1)


def _widened(w: DeviceWeight) -> Tensor:
    [t] = w.parts
    if w.kind == "f32":
        return t
    if w.kind == "bf16":  # bf16 is the high half of an f32: widening is exact
        return (t.cast(dtypes.uint32) * 65536).bitcast(dtypes.float32)
    return t.cast(dtypes.float32)

