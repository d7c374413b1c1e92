"""Decoders for the ggml tensor types real Llama GGUF files use, in numpy, bit-exact, a chunk at a time.

The layouts (ggml-common.h's `block_*` structs; ggml-quants.c's `dequantize_row_*` say how they decode).
Every quantised type stores blocks of 32 or 256 values; `d`, `m`, `dmin` are float16, all little-endian:

    Q8_0   34 B / 32:  d, qs[32] int8                              x = d*q
    Q4_0   18 B / 32:  d, qs[16] nibbles                           x = d*(q-8)
    Q4_1   20 B / 32:  d, m, qs[16]                                x = d*q + m
    Q5_0   22 B / 32:  d, qh u32 (fifth bits), qs[16]              x = d*(q-16)
    Q5_1   24 B / 32:  d, m, qh u32, qs[16]                        x = d*q + m
    Q2_K   84 B / 256: scales[16] (4-bit scale | 4-bit min << 4), qs[64] crumbs, d @80, dmin @82
                       16 sub-blocks of 16:                        x = (d*sc)*q - dmin*mn
    Q3_K  110 B / 256: hmask[32] (third bits), qs[64] crumbs, scales[12] (16 x 6 bits), d @108
                       16 sub-blocks of 16:                        x = (d*(sc-32))*(q-4), q's third bit set = +4
    Q4_K  144 B / 256: d, dmin, scales[12] (8 scales, 8 mins, 6 bits each), qs[128]
                       8 sub-blocks of 32:                         x = (d*sc)*q - dmin*mn
    Q5_K  176 B / 256: as Q4_K with qh[32] (fifth bits) before qs
    Q6_K  210 B / 256: ql[128] nibbles, qh[64] crumbs, scales[16] int8, d @208
                       16 sub-blocks of 16:                        x = (d*sc)*(q-32)

Low nibbles come first: in a group of k bytes, byte i's low nibble is value i and its high nibble value
k + i (k = 16 in the 32-blocks, 32 in Q4_K/Q5_K, 64 in Q6_K's two halves). Crumbs (2-bit fields) likewise:
in Q2_K/Q3_K each half block of 128 values reads 32 bytes four times, shifting 0, 2, 4, 6. Extra bits are
bit planes: Q5_0's qh bit j is value j's fifth bit; Q5_K's qh[l] bit s is value 32s + l's; Q3_K's hmask[l]
bit j is value 32j + l's (counting on across both halves, so the mask is never re-read). The 6-bit
scales are packed two ways. Q4_K/Q5_K: bytes 0-3 hold scales 0-3 in their low six bits, bytes 4-7 mins
0-3, bytes 8-11 scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top two bits are the spare top
bits of bytes 0-3 (scales) and 4-7 (mins). Q3_K: scale k's low nibble is byte k's (k < 8) or byte
k-8's high nibble, its top two bits are bits 2(k//4) of byte 8 + k%4; it is stored biased by 32.

Why the results are bit-exact, not merely close (the test compares with gguf-py's `gguf.quants`, itself
a transcription of ggml-quants.c). float16 to float32 is exact. Every product here is exact in float32:
a float16 significand has 11 bits and the integers it meets are small, the largest being Q6_K's
|sc| <= 128 times |q| <= 32, so 11 + 7 + 5 = 23 bits fit in float32's 24, and the exponents stay far from
float32's limits (a float16 subnormal is 2^-24, a product at most 65504 * 2^12). So `d*sc*q` is the
same float whichever way it is associated, and whether it is formed in int or float. What can differ is
the one rounding step: the affine types' final add, `d*q + m` (Q4_1, Q5_1) or `dl*q - ml` (K-quants).
That is a single correctly rounded IEEE operation on exact operands, so it is reproduced exactly as long
as the same two operands meet in the same operation (a - b is by definition a + (-b), so subtracting a
min and adding its negation agree). It would NOT be reproduced by a rearranged formula such as
`d*(q + m/d)`, by folding the min into a table, or by a fused multiply-add of inexact operands. We write
ggml's formulas as ggml orders them, and even the sign of zero matches (it follows the operands' signs
identically in both: products XOR signs, and -0 - +0 = -0 arises from the same operands), so the tests
compare bit patterns. tinygrad's decoder, used before, gave +0.0 where ggml gives -0.0 for Q5_0's
d*(q-16) with d < 0, because it computes q*d + (-16*d).

Memory: `decode` writes into one float32 output (the caller's, or a fresh page-aligned one the CPU device
can use in place) CHUNK_ELEMENTS values at a time, so besides the encoded bytes and the result it holds
a few chunk-sized scratch arrays (the chunk's integers, one byte a value, and per-sub-block scales):
about 1 MiB. A non-finite scale (a corrupt file) decodes to inf/NaN as in ggml, without numpy's warning.
"""
from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from ..files import aligned_empty

# Values decoded per step: 1 MiB of float32. Measured on Q4_1..Q6_K, 2^16 to 2^20 are within 25% of
# each other and 2^18 the fastest: the step's scratch stays in cache, and the dozen numpy calls per step
# cost little.
CHUNK_ELEMENTS = 1 << 18

_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)  # 2-bit fields of a byte
_BIT_SHIFTS = np.arange(8, dtype=np.uint8).reshape(8, 1)              # bit planes of a byte


@attrs.frozen
class Layout:
    name: str
    block: int        # values per block
    block_bytes: int
    decode: Callable[[np.ndarray, np.ndarray], None]  # (blocks uint8 (n, block_bytes), out float32 (n, block))


def decode(raw: np.ndarray, ggml_type: int, out: np.ndarray | None = None) -> np.ndarray:
    """Whole blocks of ggml type `ggml_type` (bytes) -> flat float32, written into `out` if given.

    `out` must be a C-contiguous float32 array of exactly the decoded size; by default a page-aligned one
    is allocated. Raises KeyError for a type not in LAYOUTS, ValueError for a partial block or wrong `out`.
    """
    layout = LAYOUTS[ggml_type]
    raw = np.ascontiguousarray(raw).view(np.uint8).ravel()
    if raw.size % layout.block_bytes:
        raise ValueError(f"{raw.size} bytes are not whole {layout.name} blocks of {layout.block_bytes}")
    blocks = raw.reshape(-1, layout.block_bytes)
    n = len(blocks) * layout.block
    if out is None:
        out = aligned_empty(4 * n).view(np.float32)
    elif out.dtype != np.float32 or out.size != n or not out.flags.c_contiguous:
        raise ValueError(f"out is {out.dtype} {out.shape}, want {n} contiguous float32 values")
    rows = out.reshape(-1, layout.block)
    step = max(1, CHUNK_ELEMENTS // layout.block)
    with np.errstate(invalid="ignore"):  # inf * 0 from a non-finite scale: NaN, as ggml gives
        for first in range(0, len(blocks), step):
            layout.decode(blocks[first:first + step], rows[first:first + step])
    return out


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of every block, widened (exactly) to a float32 column."""
    return blocks[:, at:at + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Bytes (n, k) -> values (n, 2k) uint8: each run of `group` bytes gives its low nibbles, then its high."""
    n = len(qs)
    qs = qs.reshape(n, -1, 1, group)
    q = np.empty((n, qs.shape[1], 2, group), np.uint8)
    np.bitwise_and(qs[:, :, 0], 0x0F, out=q[:, :, 0])
    np.right_shift(qs[:, :, 0], 4, out=q[:, :, 1])
    return q.reshape(n, -1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K bytes (n, 64) -> 2-bit values (n, 256): per half, 32 bytes read at shifts 0, 2, 4, 6."""
    n = len(qs)
    q = np.right_shift(qs.reshape(n, 2, 1, 32), _CRUMB_SHIFTS)
    q &= 3
    return q.reshape(n, 256)


def _planes(bits: np.ndarray, planes: int) -> np.ndarray:
    """Bytes (n, k) -> (n, planes * k) of 0/1: bit 0 of every byte, then bit 1, ..."""
    q = np.right_shift(bits[:, None, :], _BIT_SHIFTS[:planes])
    q &= 1
    return q.reshape(len(bits), -1)


def _scale(q: np.ndarray, dl: np.ndarray, out: np.ndarray, *, plus=None, minus=None) -> None:
    """out = dl*q (+ plus | - minus), per sub-block: dl/plus/minus are (n, sub-blocks), q and out (n, block)."""
    n, subs = dl.shape
    out = out.reshape(n, subs, -1)
    np.multiply(q.reshape(n, subs, -1), dl[:, :, None], out=out)
    if plus is not None:
        out += plus[:, :, None]
    if minus is not None:
        out -= minus[:, :, None]


def _decode_f16(b, out):
    np.copyto(out, b.view(np.float16))


def _decode_bf16(b, out):
    # bfloat16 is float32's top half: widening is a shift
    wide = out.view(np.uint32)
    np.copyto(wide, b.view(np.uint16))
    wide <<= 16


def _decode_q8_0(b, out):
    np.multiply(b[:, 2:].view(np.int8), _f16(b, 0), out=out)


def _decode_q4_0(b, out):
    q = _nibbles(b[:, 2:], 16).view(np.int8)
    q -= 8
    _scale(q, _f16(b, 0), out)


def _decode_q4_1(b, out):
    _scale(_nibbles(b[:, 4:], 16), _f16(b, 0), out, plus=_f16(b, 2))


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 values 0..31: nibbles with the fifth bits of the little-endian u32 `qh` (bit j: value j)."""
    q = _nibbles(qs, 16)
    high = np.unpackbits(qh, axis=1, bitorder="little")
    high <<= 4
    q |= high
    return q


def _decode_q5_0(b, out):
    q = _five_bits(b[:, 2:6], b[:, 6:]).view(np.int8)
    q -= 16
    _scale(q, _f16(b, 0), out)


def _decode_q5_1(b, out):
    _scale(_five_bits(b[:, 4:8], b[:, 8:]), _f16(b, 0), out, plus=_f16(b, 2))


def _decode_q2_k(b, out):
    sc = b[:, :16]
    _scale(_crumbs(b[:, 16:80]), _f16(b, 80) * (sc & 0x0F), out, minus=_f16(b, 82) * (sc >> 4))


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes -> 16 signed scales (int8, -32..31)."""
    n = len(s)
    sc = np.empty((n, 2, 8), np.uint8)
    np.bitwise_and(s[:, :8], 0x0F, out=sc[:, 0])
    np.right_shift(s[:, :8], 4, out=sc[:, 1])
    top = np.right_shift(s[:, None, 8:], _CRUMB_SHIFTS)  # (n, 4, 4): scale k's top bits at [k // 4, k % 4]
    top &= 3
    top <<= 4
    sc = sc.reshape(n, 16)
    sc |= top.reshape(n, 16)
    sc = sc.view(np.int8)
    sc -= 32
    return sc


def _decode_q3_k(b, out):
    n = len(b)
    q = _crumbs(b[:, 32:96])
    high = _planes(b[:, :32], 8)  # value 32j + l's third bit is hmask[l] bit j
    high <<= 2
    q |= high
    q = q.view(np.int8)
    q -= 4                        # a clear third bit means q - 4, a set one q
    _scale(q.reshape(n, 256), _f16(b, 108) * _q3_k_scales(b[:, 96:108]), out)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> 8 scales and 8 mins, 6 bits each (uint8)."""
    n = len(s)
    low, mid, high = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc, mn = np.empty((n, 8), np.uint8), np.empty((n, 8), np.uint8)
    np.bitwise_and(low, 0x3F, out=sc[:, :4])
    np.bitwise_and(mid, 0x3F, out=mn[:, :4])
    np.bitwise_and(high, 0x0F, out=sc[:, 4:])
    np.right_shift(high, 4, out=mn[:, 4:])
    sc[:, 4:] |= (low >> 6) << 4
    mn[:, 4:] |= (mid >> 6) << 4
    return sc, mn


def _decode_q4_k(b, out):
    sc, mn = _k_scales(b[:, 4:16])
    _scale(_nibbles(b[:, 16:], 32), _f16(b, 0) * sc, out, minus=_f16(b, 2) * mn)


def _decode_q5_k(b, out):
    sc, mn = _k_scales(b[:, 4:16])
    q = _nibbles(b[:, 48:], 32)
    high = _planes(b[:, 16:48], 8)  # value 32s + l's fifth bit is qh[l] bit s
    high <<= 4
    q |= high
    _scale(q, _f16(b, 0) * sc, out, minus=_f16(b, 2) * mn)


def _decode_q6_k(b, out):
    n = len(b)
    q = _nibbles(b[:, :128], 64)  # per half of 128 values: 64 low nibbles, then 64 high
    high = np.right_shift(b[:, 128:192].reshape(n, 2, 1, 32), _CRUMB_SHIFTS)  # value 32k + l: qh[l] >> 2k
    high &= 3
    high <<= 4
    q |= high.reshape(n, 256)
    q = q.view(np.int8)
    q -= 32
    _scale(q, _f16(b, 208) * b[:, 192:208].view(np.int8), out)


# ggml type id (ggml.h's `ggml_type`) -> layout
LAYOUTS: dict[int, Layout] = {layout_id: Layout(*rest) for layout_id, *rest in [
    (1, "F16", 1, 2, _decode_f16),
    (30, "BF16", 1, 2, _decode_bf16),
    (2, "Q4_0", 32, 18, _decode_q4_0),
    (3, "Q4_1", 32, 20, _decode_q4_1),
    (6, "Q5_0", 32, 22, _decode_q5_0),
    (7, "Q5_1", 32, 24, _decode_q5_1),
    (8, "Q8_0", 32, 34, _decode_q8_0),
    (10, "Q2_K", 256, 84, _decode_q2_k),
    (11, "Q3_K", 256, 110, _decode_q3_k),
    (12, "Q4_K", 256, 144, _decode_q4_k),
    (13, "Q5_K", 256, 176, _decode_q5_k),
    (14, "Q6_K", 256, 210, _decode_q6_k),
]}
