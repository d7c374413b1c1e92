"""Weights in their file's precision on the host: what a loader hands a slice when it keeps them narrow.

A matrix read from an F16 or BF16 tensor stays 2 bytes a weight, a Q8_0 one 34 bytes a block of 32
(an f16 scale and 32 int8s) and a Q4_1 one 20 (f16 scale and min, 32 nibbles) instead of 4 bytes a weight widened at load: decode reads every weight once
a step, so fewer bytes is speed (docs/benchmarks.md). The kernels widen each weight as they read it
(worker/compute/linear.py), and a widened weight is exactly the value the f32 path would hold: f16 and bf16
widen exactly, and a Q8_0 weight is int8 × f16 scale, which an f32 holds exactly.

Each array is page-aligned so that the CPU device computes on it in place. Rows are (out_features, ...)
in Hugging Face order, like the f32 arrays of weights.py.
"""
from __future__ import annotations

import attrs
import numpy as np

from ..files import ALIGN, aligned_empty

Q8_BLOCK = 32  # weights per Q8_0 block
Q8_BLOCK_BYTES = 2 + Q8_BLOCK  # f16 scale, then 32 int8
Q4_1_BLOCK_BYTES = 4 + Q8_BLOCK // 2  # f16 d and m, then 16 bytes of nibbles
BLOCKED = {"q8_0": Q8_BLOCK, "q4_1": Q8_BLOCK}  # kinds stored in blocks: weights per block


@attrs.frozen(eq=False)
class Packed:
    """One weight matrix (out, in). kind and parts:
    - "f32": (w float32 (out, in),)
    - "f16": (w float16 (out, in),)
    - "bf16": (bits uint16 (out, in),): numpy has no bfloat16; the bits are the high half of an f32
    - "q8_0": (q int8 (out, in // 32, 32), scale float16 (out, in // 32, 1))
    - "q4_1": (qs uint8 (out, in // 32, 16), dm float16 (out, in // 32, 2)): byte j of a block holds value j
      in its low nibble and value 16 + j in its high one; a value is d*q + m (worker/weights/quants.py)
    """

    kind: str
    parts: tuple[np.ndarray, ...]

    @property
    def shape(self) -> tuple[int, int]:
        first = self.parts[0]
        if self.kind in BLOCKED:
            return first.shape[0], first.shape[1] * BLOCKED[self.kind]
        return first.shape

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` widened to float32 (embedding lookups on the host)."""
        if self.kind == "q8_0":
            q, scale = self.parts
            return (q[ids].astype(np.float32) * scale[ids].astype(np.float32)).reshape(len(ids), -1)
        if self.kind == "q4_1":  # ggml's order: d*q, then + m (bit-exact with worker/weights/quants.py)
            qs, dm = self.parts[0][ids], self.parts[1][ids].astype(np.float32)
            values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
            return (values * dm[..., :1] + dm[..., 1:]).reshape(len(ids), -1)
        return widen(self.kind, self.parts[0][ids])

    def widened(self) -> np.ndarray:
        """The whole matrix as float32 (what the f32 path would have loaded)."""
        return self.rows(np.arange(self.shape[0]))


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 (as its uint16 bits) is the high half of an f32, so widening is exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def widen(kind: str, array: np.ndarray) -> np.ndarray:
    return bf16_to_f32(array) if kind == "bf16" else array.astype(np.float32)


def aligned(array: np.ndarray) -> np.ndarray:
    """A page-aligned contiguous copy of `array` (one copy: the caller's is dropped)."""
    out = aligned_empty(array.nbytes).view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def dense(kind: str, array: np.ndarray) -> Packed:
    """An F32, F16 or BF16 (as uint16 bits) matrix as it is."""
    want = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[kind]
    if array.ndim != 2 or array.dtype != want:
        raise ValueError(f"a {kind} matrix must be 2-d {np.dtype(want)}, got {array.ndim}-d {array.dtype}")
    return Packed(kind, (array if _is_aligned(array) else aligned(array),))


def permute_rows(packed: Packed, order: np.ndarray) -> Packed:
    """The same matrix with its rows in `order` (GGUF q/k rows back in rotate-half order)."""
    return Packed(packed.kind, tuple(aligned(p[order]) for p in packed.parts))


def _is_aligned(array: np.ndarray) -> bool:
    return array.flags.c_contiguous and array.ctypes.data % ALIGN == 0
