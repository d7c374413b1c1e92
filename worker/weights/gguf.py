"""GGUF weight source for llama.cpp-layout Llama files: parse the header, load only requested tensors.

A pipeline stage holds a slice of the model, so nothing here reads tensor bytes it was not asked
for: the header is parsed from a byte prefix (which a caller may fetch over HTTP range requests),
and `load` reads exactly one tensor's extent.
"""
from __future__ import annotations

import math
import os
import re
import struct

import attrs
import numpy as np

from . import quants
from ..config import ModelConfig
from ..errors import ModelFileError
from .packed import Q8_BLOCK, Q8_BLOCK_BYTES, Packed, permute_rows
from .packed import dense as packed_dense
from ..files import aligned_empty, read_extent

# ggml type id -> (name, elements per block, bytes per block); ggml.h's `ggml_type`.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}
# Types `dequantize` accepts: F32 (used as it is) and every type worker/weights/quants.py decodes, namely F16, BF16,
# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K; each is checked bit-exact against gguf-py in tests/test_gguf.py.
SUPPORTED_TYPES = frozenset({0, *quants.LAYOUTS})

# Sanity bounds; a count or length past these means a corrupt file, not a big model.
# (Llama 3's vocabulary is 128k tokens and 280k merges; a 405B model has ~1.1k tensors.)
MAX_COUNT = 1 << 20        # kv pairs, tensors
MAX_ARRAY = 1 << 24        # elements in one kv array
MAX_STRING = 1 << 24       # bytes in one string
MAX_DIMS = 4               # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40
MAX_NESTING = 4

# Hard cap on the context we allocate for: the KV cache is max_context positions per layer, and
# Llama 3.2 1B's advertised 131072 would need ~8 GiB of float32 K and V (16 layers x 512 wide).
MAX_CONTEXT_CAP = 8192

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class IncompleteHeader(Exception):
    """The prefix ends inside the header; a prefix of at least `needed_bytes` is required to go on.

    Not a ModelFileError: it asks the caller for more bytes; it says nothing is wrong with the file.
    `needed_bytes` is a lower bound (parsing may then stop again further on).
    """

    def __init__(self, needed_bytes: int):
        self.needed_bytes = needed_bytes
        super().__init__(f"GGUF header needs at least {needed_bytes} bytes")


@attrs.frozen
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: ggml's ne reversed
    ggml_type: int
    offset: int             # absolute file offset of the first byte
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


@attrs.frozen
class GGUFHeader:
    version: int
    kv: dict
    tensors: dict[str, TensorInfo]
    data_start: int


class _Cursor:
    """Reads little-endian GGUF fields from a prefix; asks for more bytes when the prefix runs out."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos = memoryview(buf).cast("B"), path, 0

    def corrupt(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, f"corrupt GGUF header at byte {self.pos}: {problem}")

    def take(self, n: int) -> int:
        """Reserve n bytes; return where they start."""
        if self.pos + n > len(self.buf):
            raise IncompleteHeader(self.pos + n)
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str, limit: int) -> int:
        n = self.scalar("<Q")
        if n > limit:
            raise self.corrupt(f"{what} {n} is absurd (limit {limit})")
        return n

    def string(self) -> str:
        n = self.count("string length", MAX_STRING)
        start = self.take(n)
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self.corrupt(f"string is not UTF-8 ({e.reason})") from None

    def value(self, vtype: int, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY and depth < MAX_NESTING:
            item_type = self.scalar("<I")
            n = self.count("array length", MAX_ARRAY)
            if item_type in _SCALARS:  # numeric arrays in one go: token types are 128k entries
                dtype = np.dtype(_SCALARS[item_type])
                return np.frombuffer(self.buf, dtype, n, self.take(n * dtype.itemsize)).tolist()
            return [self.value(item_type, depth + 1) for _ in range(n)]
        if vtype == _ARRAY:
            raise self.corrupt(f"kv arrays nested deeper than {MAX_NESTING}")
        raise self.corrupt(f"unknown kv value type {vtype}")


def parse_header(buf: bytes | memoryview, path) -> GGUFHeader:
    """Parse magic, kv metadata and tensor infos from a file prefix.

    Raises IncompleteHeader if `buf` ends before the last tensor info, ModelFileError if corrupt.
    """
    path = str(path)
    cur = _Cursor(buf, path)
    cur.take(4)
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ModelFileError(path, f"not a GGUF file (magic {bytes(cur.buf[:4])!r}, want b'GGUF')")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelFileError(path, f"unsupported GGUF version {version} (want 2 or 3)")
    n_tensors = cur.count("tensor count", MAX_COUNT)
    n_kv = cur.count("kv count", MAX_COUNT)
    kv = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in kv:
            raise cur.corrupt(f"duplicate key {key!r}")
        kv[key] = cur.value(cur.scalar("<I"))
    alignment = kv.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(path, f"general.alignment {alignment!r} is not a power of two")
    infos = [_tensor_info(cur) for _ in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, rel, nbytes in infos:
        if name in tensors:
            raise ModelFileError(path, f"duplicate tensor {name!r}")
        if rel % alignment:
            raise ModelFileError(path, f"tensor {name!r} offset {rel} is not {alignment}-byte aligned")
        tensors[name] = TensorInfo(name, shape, ggml_type, data_start + rel, nbytes)
    return GGUFHeader(version=version, kv=kv, tensors=tensors, data_start=data_start)


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int, int]:
    name = cur.string()
    n_dims = cur.scalar("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.corrupt(f"tensor {name!r} has {n_dims} dimensions (want 1..{MAX_DIMS})")
    ne = [cur.scalar("<Q") for _ in range(n_dims)]
    ggml_type, rel = cur.scalar("<I"), cur.scalar("<Q")
    if ggml_type not in GGML_TYPES:
        raise cur.corrupt(f"tensor {name!r} has unknown ggml type {ggml_type}")
    type_name, block, block_bytes = GGML_TYPES[ggml_type]
    n = math.prod(ne)
    if not 0 < n <= MAX_ELEMENTS:
        raise cur.corrupt(f"tensor {name!r} has an absurd shape {tuple(reversed(ne))}")
    if ne[0] % block:
        raise cur.corrupt(f"tensor {name!r} rows of {ne[0]} are not whole {type_name} blocks of {block}")
    return name, tuple(reversed(ne)), ggml_type, rel, n // block * block_bytes


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


def config_from_header(header: GGUFHeader, path, rope_freq_factors: tuple[float, ...] | None) -> ModelConfig:
    """ModelConfig from `llama.*` metadata; `rope_freq_factors` is the rope_freqs.weight tensor's values."""
    path, kv = str(path), header.kv
    arch = kv.get("general.architecture")
    if arch != "llama":
        raise ModelFileError(path, f"architecture {arch!r} is not supported (only 'llama')")

    def get(key, kind, default=None):
        value = kv.get(key, default)
        if value is None:
            raise ModelFileError(path, f"metadata key {key!r} is missing")
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ModelFileError(path, f"metadata key {key!r} is {value!r}, "
                                       f"want {'an integer' if kind is int else 'a number'}")
        return value

    n_heads = get("llama.attention.head_count", int)
    tokens = kv.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if isinstance(tokens, list) else get("llama.vocab_size", int)
    try:
        config = ModelConfig(
            dim=get("llama.embedding_length", int),
            n_layers=get("llama.block_count", int),
            n_heads=n_heads,
            n_kv_heads=get("llama.attention.head_count_kv", int, n_heads),
            ffn_dim=get("llama.feed_forward_length", int),
            vocab_size=vocab,
            norm_eps=float(get("llama.attention.layer_norm_rms_epsilon", (float, int))),
            rope_theta=float(get("llama.rope.freq_base", (float, int), 10000.0)),
            rope_freq_factors=rope_freq_factors,
            max_context=min(get("llama.context_length", int), MAX_CONTEXT_CAP),
            tie_embeddings="output.weight" not in header.tensors,
        )
    except ValueError as e:  # ModelConfig's own consistency checks
        raise ModelFileError(path, f"inconsistent llama metadata: {e}") from None
    _check_head_dims(config, kv, header, path)
    return config


def _check_head_dims(config: ModelConfig, kv: dict, header: GGUFHeader, path: str) -> None:
    """Refuse layouts this loader does not model (head_dim != dim / n_heads, partial rotary, odd vocab)."""
    for key in ("llama.attention.key_length", "llama.attention.value_length", "llama.rope.dimension_count"):
        if kv.get(key, config.head_dim) != config.head_dim:
            raise ModelFileError(path, f"{key} = {kv[key]} but dim / heads = {config.head_dim}; not supported")
    embd = header.tensors.get("token_embd.weight")
    if embd is not None and embd.shape != (config.vocab_size, config.dim):
        raise ModelFileError(path, f"token_embd.weight is {embd.shape}, want (vocab {config.vocab_size}, "
                                   f"dim {config.dim})")


def read_header(f, size: int, path, first_read: int = 1 << 24) -> GGUFHeader:
    """Parse the header of an open binary file of `size` bytes, growing the prefix until it parses.

    The first read is big enough for Llama 3's ~10 MB header (128k tokens, 280k merges), so a local
    file is usually parsed once; each retry re-parses from the start.
    """
    prefix = b""
    want = min(size, first_read)
    while True:
        f.seek(len(prefix))
        prefix += f.read(want - len(prefix))
        size = min(size, len(prefix)) if len(prefix) < want else size  # the file shrank since stat
        try:
            return parse_header(prefix, path)
        except IncompleteHeader as e:
            if len(prefix) >= size:
                raise ModelFileError(path, f"header is truncated: it needs at least {e.needed_bytes} bytes, "
                                           f"the file has {size}") from None
            want = min(size, max(e.needed_bytes, 2 * len(prefix)))


_QK = re.compile(r"blk\.\d+\.attn_([qk])\.weight")
_NARROW = {0: "f32", 1: "f16", 30: "bf16", 8: "q8_0"}  # ggml types kernels read as they are (worker/compute/linear.py)
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
        """One matrix in the file's precision where kernels can read it so (F32, F16, BF16, Q8_0); other
        types widened to float32 here. Hugging Face layout, as `load`."""
        info = self._info(name)
        kind = _NARROW.get(info.ggml_type)
        if kind is None or len(info.shape) != 2:
            return packed_dense("f32", self.load(name))  # load undoes the q/k permutation itself
        if kind == "q8_0":
            packed = self._q8_0(info)
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

    def _q8_0(self, info: TensorInfo) -> Packed:
        """A Q8_0 matrix read a chunk of rows at a time straight into its int8 weights and f16 scales, so
        that loading holds no second copy of the tensor."""
        rows, cols = info.shape
        blocks, row_bytes = cols // Q8_BLOCK, cols // Q8_BLOCK * Q8_BLOCK_BYTES
        q = aligned_empty(rows * cols).view(np.int8).reshape(rows, blocks, Q8_BLOCK)
        scale = aligned_empty(rows * blocks * 2).view(np.float16).reshape(rows, blocks, 1)
        step = max(1, DECODE_CHUNK_ELEMENTS // row_bytes)
        for first in range(0, rows, step):
            n = min(step, rows - first)
            chunk = self._raw(info, first * row_bytes, n * row_bytes).reshape(n, blocks, Q8_BLOCK_BYTES)
            scale[first:first + n] = chunk[:, :, :2].view(np.float16)
            q[first:first + n] = chunk[:, :, 2:].view(np.int8)
        return Packed("q8_0", (q, scale))

    def _raw(self, info: TensorInfo, start: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Exactly the tensor's bytes [offset + start, offset + start + nbytes) (all of them by default),
        nothing else."""
        nbytes = info.nbytes - start if nbytes is None else nbytes
        return read_extent(self.path, info.offset + start, nbytes, what=f"tensor {info.name!r}",
                           end=info.offset + info.nbytes)
