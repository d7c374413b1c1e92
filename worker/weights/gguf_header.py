"""A GGUF file's header, parsed from a byte prefix and nothing else: its metadata, its tensors' places, and
the ModelConfig they describe. A stage range-fetching its slice (worker/weights/rangefetch.py) needs only
this; reading the tensors themselves is worker/weights/gguf.py's.
"""
from __future__ import annotations

import math
import struct

import attrs
import numpy as np

from ..config import MAX_CONTEXT_CAP, ModelConfig
from ..errors import ModelFileError


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


# Sanity bounds; a count or length past these means a corrupt file, not a big model.
# (Llama 3's vocabulary is 128k tokens and 280k merges; a 405B model has ~1.1k tensors.)
MAX_COUNT = 1 << 20        # kv pairs, tensors
MAX_ARRAY = 1 << 24        # elements in one kv array
MAX_STRING = 1 << 24       # bytes in one string
MAX_DIMS = 4               # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40
MAX_NESTING = 4

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
