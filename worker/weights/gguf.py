"""GGUF weight source for llama.cpp-layout Llama files: the header (worker/weights/gguf_header.py), then
only the requested tensors.

A pipeline stage holds a slice of the model, so nothing here reads tensor bytes it was not asked
for: `load` reads exactly one tensor's extent.
"""
from __future__ import annotations

import math
import os
import re

import numpy as np

from . import quants
from ..errors import ModelFileError
from ..files import aligned_empty, read_extent
from .gguf_header import GGML_TYPES, GGUFHeader, TensorInfo, config_from_header, read_header
from .packed import Q4_1_BLOCK_BYTES, Q8_BLOCK, Q8_BLOCK_BYTES, Packed, permute_rows
from .packed import dense as packed_dense

# Types `dequantize` accepts: F32 (used as it is) and every type worker/weights/quants.py decodes, namely F16, BF16,
# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K; each is checked bit-exact against gguf-py in tests/test_gguf.py.
SUPPORTED_TYPES = frozenset({0, *quants.LAYOUTS})


DECODE_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of float32 per decoding step


def dequantize(raw: np.ndarray, ggml_type: int, shape, *, path="<memory>", tensor="tensor") -> np.ndarray:
    """ggml-encoded bytes -> float32 array of `shape`: F32 as a view of `raw`, the rest decoded by
    worker/weights/quants.py a chunk of blocks at a time into one page-aligned result."""
    type_name, block, block_bytes = GGML_TYPES.get(ggml_type, (f"id {ggml_type}", 1, 0))
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(GGML_TYPES[t][0] for t in SUPPORTED_TYPES))
        raise ModelFileError(path, f"{tensor} has type {type_name}, which is not supported (supported: {supported})")
    n = math.prod(shape)
    if n % block or raw.nbytes != n // block * block_bytes:
        raise ModelFileError(path, f"{tensor} has {raw.nbytes} bytes, which is not {type_name} data of shape {shape}")
    if ggml_type == 0:  # already float32
        return raw.view(np.float32).reshape(shape)
    return quants.decode(raw, ggml_type).reshape(shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which stores q/k rows interleaved per head instead of HF's rotate-half.

    The converter does `w.reshape(n_head, 2, hd // 2, in).swapaxes(1, 2).reshape(w.shape)`.
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)



_QK = re.compile(r"blk\.\d+\.attn_([qk])\.weight")
_NARROW = {0: "f32", 1: "f16", 30: "bf16", 8: "q8_0", 3: "q4_1"}  # ggml types kernels read as they are (worker/compute/linear.py)
_NUMPY = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}


def _check_extents(header: GGUFHeader, size: int, path: str) -> None:
    """A file cut short (an interrupted copy or download) is refused when opened, naming the first tensor it
    lacks, rather than when a stage reaches that tensor. A stage's range-fetched slice is a sparse file of
    the full size (worker/weights/rangefetch.py), so it passes."""
    short = [t for t in header.tensors.values() if t.offset + t.nbytes > size]
    if short:
        first = min(short, key=lambda t: t.offset)
        raise ModelFileError(path, f"truncated: tensor {first.name!r} needs bytes up to {first.offset + first.nbytes} "
                                   f"but the file has {size} ({len(short)} tensors cut off)")


class GGUFSource:
    """WeightSource over a local llama.cpp GGUF file; reads the header now and tensors on demand."""

    def __init__(self, path):
        self.path = str(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.header = read_header(f, size, self.path)
        except OSError as e:
            raise ModelFileError(self.path, f"cannot read GGUF file: {e.strerror}") from None
        _check_extents(self.header, size, self.path)
        factors = None
        if "rope_freqs.weight" in self.header.tensors:
            factors = tuple(float(x) for x in self._decoded("rope_freqs.weight").ravel())
        self.config = config_from_header(self.header, self.path, factors)

    def names(self) -> frozenset[str]:
        return frozenset(self.header.tensors)

    def load(self, name: str) -> np.ndarray:
        """One tensor as float32 in Hugging Face layout (q/k rows back in rotate-half order)."""
        w = self._decoded(name)
        if m := _QK.fullmatch(name):
            heads = self.config.n_heads if m.group(1) == "q" else self.config.n_kv_heads
            if w.ndim != 2 or w.shape[0] != heads * self.config.head_dim:
                raise ModelFileError(self.path, f"{name} is {w.shape}, want ({heads * self.config.head_dim}, ...)")
            w = unpermute_qk(w, heads)
        return np.ascontiguousarray(w, dtype=np.float32)

    def load_packed(self, name: str) -> Packed:
        """One matrix in the file's precision where kernels can read it so (F32, F16, BF16, Q8_0, Q4_1); other
        types widened to float32 here. Hugging Face layout, as `load`."""
        info = self._info(name)
        kind = _NARROW.get(info.ggml_type)
        if kind is None or len(info.shape) != 2:
            return packed_dense("f32", self.load(name))  # load undoes the q/k permutation itself
        if kind in ("q8_0", "q4_1"):
            packed = self._blocks(info, kind)
        else:
            packed = packed_dense(kind, self._raw(info).view(_NUMPY[kind]).reshape(info.shape))
        if m := _QK.fullmatch(name):
            heads = self.config.n_heads if m.group(1) == "q" else self.config.n_kv_heads
            if info.shape[0] != heads * self.config.head_dim:
                raise ModelFileError(self.path, f"{name} is {info.shape}, want ({heads * self.config.head_dim}, ...)")
            packed = permute_rows(packed, unpermute_qk(np.arange(info.shape[0]), heads))
        return packed

    def tokenizer(self):
        from ..tokens.tokenizer import tokenizer_from_gguf_metadata
        return tokenizer_from_gguf_metadata(self.header.kv, self.path)

    def _info(self, name: str) -> TensorInfo:
        info = self.header.tensors.get(name)
        if info is None:
            raise ModelFileError(self.path, f"tensor {name!r} is not in the file")
        return info

    def _decoded(self, name: str) -> np.ndarray:
        info = self._info(name)
        return dequantize(self._raw(info), info.ggml_type, info.shape, path=self.path, tensor=repr(name))

    def _blocks(self, info: TensorInfo, kind: str) -> Packed:
        """A Q8_0 or Q4_1 matrix read a chunk of rows at a time straight into its quant bytes and f16 scales
        (d, and m for Q4_1), so that loading holds no second copy of the tensor."""
        rows, cols = info.shape
        scales, quant, block_bytes, qtype = {"q8_0": (1, Q8_BLOCK, Q8_BLOCK_BYTES, np.int8),
                                             "q4_1": (2, Q8_BLOCK // 2, Q4_1_BLOCK_BYTES, np.uint8)}[kind]
        blocks = cols // Q8_BLOCK
        row_bytes = blocks * block_bytes
        q = aligned_empty(rows * blocks * quant).view(qtype).reshape(rows, blocks, quant)
        scale = aligned_empty(rows * blocks * 2 * scales).view(np.float16).reshape(rows, blocks, scales)
        step = max(1, DECODE_CHUNK_ELEMENTS // row_bytes)
        for first in range(0, rows, step):
            n = min(step, rows - first)
            chunk = self._raw(info, first * row_bytes, n * row_bytes).reshape(n, blocks, block_bytes)
            scale[first:first + n] = chunk[:, :, :2 * scales].view(np.float16)
            q[first:first + n] = chunk[:, :, 2 * scales:].view(qtype)
        return Packed(kind, (q, scale))

    def _raw(self, info: TensorInfo, start: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Exactly the tensor's bytes [offset + start, offset + start + nbytes) (all of them by default),
        nothing else."""
        nbytes = info.nbytes - start if nbytes is None else nbytes
        return read_extent(self.path, info.offset + start, nbytes, what=f"tensor {info.name!r}",
                           end=info.offset + info.nbytes)
