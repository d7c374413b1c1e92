"""A Hugging Face Llama checkpoint directory as a WeightSource.

Reads config.json and (sharded) safetensors. Opening a directory reads only the JSON headers;
`load` reads only the requested tensor's bytes, so a pipeline stage holds just its own layers.
"""
from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import attrs
import numpy as np

from ..config import MAX_CONTEXT_CAP, ModelConfig, RopeScaling, llama3_freq_factors
from ..errors import ModelFileError
from .packed import Packed, bf16_to_f32
from .packed import dense as packed_dense
from ..files import read_extent, read_json
from .contract import EMBEDDING, OUTPUT, OUTPUT_NORM

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
# Header bounds follow the safetensors reference implementation (100 MB).
MAX_HEADER_BYTES = 100_000_000

_HF_GLOBAL = {"model.embed_tokens.weight": EMBEDDING, "model.norm.weight": OUTPUT_NORM,
              "lm_head.weight": OUTPUT}
_HF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
_HF_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
_INTERNAL_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)\.weight")

# Raw numpy dtypes per safetensors dtype; BF16 is read as its bit pattern (numpy has no bf16).
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_KINDS = {"F32": "f32", "F16": "f16", "BF16": "bf16"}  # worker/weights/packed.py's names
_REQUIRED = object()


# --- names -------------------------------------------------------------------------------------

def internal_name(hf_name: str) -> str | None:
    """llama.cpp name of a Hugging Face tensor, or None for tensors we don't use."""
    if hf_name in _HF_GLOBAL:
        return _HF_GLOBAL[hf_name]
    match = _HF_BLOCK_RE.fullmatch(hf_name)
    if match and match.group(2) in _HF_BLOCK:
        return f"blk.{int(match.group(1))}.{_HF_BLOCK[match.group(2)]}.weight"
    return None


def hf_name(name: str) -> str | None:
    """Hugging Face name of an internal tensor name (for error messages), or None if unknown."""
    for hf, internal in _HF_GLOBAL.items():
        if internal == name:
            return hf
    match = _INTERNAL_BLOCK_RE.fullmatch(name)
    for hf, internal in _HF_BLOCK.items():
        if match and match.group(2) == internal:
            return f"model.layers.{match.group(1)}.{hf}.weight"
    return None


def expected_shape(config: ModelConfig, name: str) -> tuple[int, ...] | None:
    """HF-layout shape `config` implies for an internal tensor name (None if not a known name)."""
    dim, ffn, kv = config.dim, config.ffn_dim, config.n_kv_heads * config.head_dim
    if name in (EMBEDDING, OUTPUT):
        return (config.vocab_size, dim)
    if name == OUTPUT_NORM:
        return (dim,)
    match = _INTERNAL_BLOCK_RE.fullmatch(name)
    shapes = {"attn_norm": (dim,), "ffn_norm": (dim,), "attn_q": (dim, dim), "attn_k": (kv, dim),
              "attn_v": (kv, dim), "attn_output": (dim, dim), "ffn_gate": (ffn, dim),
              "ffn_up": (ffn, dim), "ffn_down": (dim, ffn)}
    return shapes.get(match.group(2)) if match else None


# --- config.json -------------------------------------------------------------------------------

def _field(obj: dict, key: str, kind: type, path, default=_REQUIRED):
    """obj[key] checked to be `kind` (bool not counted as a number; ints must be positive)."""
    value = obj.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelFileError(path, f"missing field {key!r}")
        return default
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        wanted = "positive int" if kind is int else kind.__name__
        raise ModelFileError(path, f"field {key!r} is {value!r}, expected a {wanted}")
    return kind(value)


# model_type -> its causal-LM class; Mistral is Llama's computation plus an optional sliding window
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


def _check_architecture(cfg: dict, path) -> None:
    model_type, architectures = cfg.get("model_type"), cfg.get("architectures")
    if model_type not in ARCHITECTURES or architectures not in (None, [ARCHITECTURES[model_type]]):
        raise ModelFileError(path, f"architecture {architectures!r} (model_type {model_type!r}) is not supported; "
                                   "only Llama (model_type 'llama', LlamaForCausalLM) and Mistral (MistralForCausalLM) are")
    for flag in ("attention_bias", "mlp_bias"):  # Llama configs may add biases, which the slice does not have
        if cfg.get(flag):
            raise ModelFileError(path, f"{flag} is {cfg[flag]!r}: projections with biases are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelFileError(path, f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")


def _context(cfg: dict, path) -> int:
    """The longest context computed exactly: a sliding window (Mistral) is full attention up to its size."""
    context = min(_field(cfg, "max_position_embeddings", int, path, default=2048), MAX_CONTEXT_CAP)
    if cfg.get("model_type") == "mistral" and cfg.get("sliding_window") is not None:
        context = min(context, _field(cfg, "sliding_window", int, path))
    return context


def rope_from_hf(cfg: dict, path) -> tuple[float, RopeScaling | None]:
    """(theta, llama3 scaling or None) from the legacy `rope_theta`/`rope_scaling` pair or `rope_parameters`."""
    top_theta = _field(cfg, "rope_theta", float, path, default=10000.0)  # transformers' LlamaConfig default
    key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    params = cfg.get(key)
    if params is None:
        return top_theta, None
    if not isinstance(params, dict):
        raise ModelFileError(path, f"{key} is {params!r}, expected an object")
    theta = _field(params, "rope_theta", float, path, default=top_theta)
    rope_type = params.get("rope_type", params.get("type"))  # older files say "type"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelFileError(path, f"{key} rope type {rope_type!r} is not supported (only 'default' and 'llama3')")
    scaling = RopeScaling(
        factor=_field(params, "factor", float, path),
        low_freq_factor=_field(params, "low_freq_factor", float, path),
        high_freq_factor=_field(params, "high_freq_factor", float, path),
        original_max_position_embeddings=_field(params, "original_max_position_embeddings", int, path))
    if not 0 < scaling.low_freq_factor < scaling.high_freq_factor or scaling.factor <= 0:
        raise ModelFileError(path, f"{key} llama3 factors {params!r} need factor > 0 "
                                   "and 0 < low_freq_factor < high_freq_factor")
    return theta, scaling


def config_from_hf(cfg: dict, path) -> ModelConfig:
    """ModelConfig of a parsed Llama config.json; `path` is named in every refusal."""
    _check_architecture(cfg, path)
    dim = _field(cfg, "hidden_size", int, path)
    heads = _field(cfg, "num_attention_heads", int, path)
    head_dim = _field(cfg, "head_dim", int, path, default=None)
    if head_dim is not None and head_dim * heads != dim:
        raise ModelFileError(path, f"head_dim {head_dim} is not hidden_size / num_attention_heads ({dim} / {heads}); "
                                   "such models are not supported")
    theta, scaling = rope_from_hf(cfg, path)
    factors = llama3_freq_factors(scaling, theta, dim // heads) if scaling else None
    try:
        return ModelConfig(
            dim=dim, n_layers=_field(cfg, "num_hidden_layers", int, path), n_heads=heads,
            n_kv_heads=_field(cfg, "num_key_value_heads", int, path, default=heads),
            ffn_dim=_field(cfg, "intermediate_size", int, path), vocab_size=_field(cfg, "vocab_size", int, path),
            norm_eps=_field(cfg, "rms_norm_eps", float, path, default=1e-6),  # transformers' default
            rope_theta=theta, rope_freq_factors=factors,
            max_context=_context(cfg, path),
            tie_embeddings=_field(cfg, "tie_word_embeddings", bool, path, default=False))
    except ValueError as e:  # ModelConfig's own consistency checks
        raise ModelFileError(path, str(e)) from e


# --- safetensors -------------------------------------------------------------------------------

@attrs.frozen
class TensorEntry:
    """Where one tensor's bytes lie: absolute file offsets [start, end)."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _read_header_json(path: Path) -> tuple[dict, int, int]:
    """(header object, absolute offset of the data section, file size)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelFileError(path, f"corrupt safetensors header: file is only {size} bytes")
            (length,) = struct.unpack("<Q", prefix)
            if not 2 <= length <= min(size - 8, MAX_HEADER_BYTES):
                raise ModelFileError(path, f"corrupt safetensors header: header length {length} does not fit "
                                           f"the {size}-byte file")
            raw = f.read(length)
    except FileNotFoundError as e:
        raise ModelFileError(path, "file is missing") from e
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ModelFileError(path, f"corrupt safetensors header: not JSON ({e})") from e
    if not isinstance(header, dict):
        raise ModelFileError(path, "corrupt safetensors header: not a JSON object")
    return header, 8 + length, size


def _entry(path: Path, name: str, spec, data_start: int, size: int) -> TensorEntry:
    def is_count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    spec_ok = (isinstance(spec, dict) and isinstance(spec.get("dtype"), str) and isinstance(spec.get("shape"), list)
               and all(is_count(d) for d in spec["shape"]) and isinstance(spec.get("data_offsets"), list)
               and len(spec["data_offsets"]) == 2 and all(is_count(o) for o in spec["data_offsets"]))
    if not spec_ok or spec["data_offsets"][0] > spec["data_offsets"][1]:
        raise ModelFileError(path, f"corrupt safetensors header entry for {name!r}: {spec!r}")
    dtype, shape, (start, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
    if dtype in _DTYPES and end - start != math.prod(shape) * _DTYPES[dtype].itemsize:
        raise ModelFileError(path, f"corrupt safetensors header: {name!r} spans {end - start} bytes "
                                   f"but {dtype} {list(shape)} needs {math.prod(shape) * _DTYPES[dtype].itemsize}")
    if data_start + end > size:
        raise ModelFileError(path, f"truncated: tensor {name!r} ends at byte {data_start + end} "
                                   f"but the file has {size} bytes")
    return TensorEntry(path, dtype, shape, data_start + start, data_start + end)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor's location in one safetensors file, reading only its header."""
    header, data_start, size = _read_header_json(path)
    return {name: _entry(path, name, spec, data_start, size)
            for name, spec in header.items() if name != "__metadata__"}


def read_tensor(entry: TensorEntry, name: str) -> np.ndarray:
    """float32 copy of one tensor, reading only its own bytes."""
    raw = read_raw(entry, name)
    if entry.dtype == "BF16":
        return bf16_to_f32(raw)
    return raw if entry.dtype == "F32" else raw.astype(np.float32)


def read_raw(entry: TensorEntry, name: str) -> np.ndarray:
    """One tensor as stored (BF16 as its uint16 bits), in a page-aligned array, reading only its own bytes."""
    if entry.dtype not in _DTYPES:
        raise ModelFileError(entry.path, f"tensor {name!r} has dtype {entry.dtype}; "
                                         "only F32, F16 and BF16 are supported")
    buf = read_extent(entry.path, entry.start, entry.end - entry.start, what=f"tensor {name!r}")
    return buf.view(_DTYPES[entry.dtype]).reshape(entry.shape)


def _sharded_table(index_path: Path) -> dict[str, TensorEntry]:
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFileError(index_path, "weight_map is missing or not an object of tensor name -> shard file")
    headers = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise ModelFileError(index_path, f"names shard {shard!r}, which does not exist")
        headers[shard] = read_header(shard_path)
    table = {}
    for hf, shard in weight_map.items():
        if hf not in headers[shard]:
            raise ModelFileError(index_path, f"places {hf!r} in {shard!r}, which has no such tensor")
        table[hf] = headers[shard][hf]
    return table


def tensor_table(directory: Path) -> tuple[Path, dict[str, TensorEntry]]:
    """(the weights file errors should name, internal name -> location) for a checkpoint directory."""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():
        weights_path, by_hf = single, read_header(single)
    elif index.is_file():
        weights_path, by_hf = index, _sharded_table(index)
    else:
        raise ModelFileError(directory, f"has neither {SINGLE_FILE} nor {INDEX_FILE}")
    return weights_path, {internal_name(hf): e for hf, e in by_hf.items() if internal_name(hf)}


# --- the source --------------------------------------------------------------------------------

class HFSource:
    """WeightSource over a Hugging Face Llama directory; tensors are read on demand."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self.path = str(self.directory)
        config = config_from_hf(read_json(self.directory / CONFIG_FILE), self.directory / CONFIG_FILE)
        self._weights_path, self._entries = tensor_table(self.directory)
        for name, entry in self._entries.items():
            want = expected_shape(config, name)
            if entry.shape != want:
                raise ModelFileError(entry.path, f"tensor {hf_name(name)!r} has shape {list(entry.shape)}, "
                                                 f"config.json implies {list(want)}")
        if OUTPUT not in self._entries:  # no lm_head means the head reuses the embedding
            config = attrs.evolve(config, tie_embeddings=True)
        self.config = config

    def names(self) -> frozenset[str]:
        return frozenset(self._entries)

    def load(self, name: str) -> np.ndarray:
        return read_tensor(self._entry(name), name)

    def load_packed(self, name: str) -> Packed:
        """One matrix as stored (F32, F16 or BF16): the kernels widen it as they read it."""
        entry = self._entry(name)
        return packed_dense(_KINDS[entry.dtype], read_raw(entry, name))

    def _entry(self, name: str) -> TensorEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise ModelFileError(self._weights_path, f"has no tensor {name!r} (Hugging Face {hf_name(name)!r})")
        return entry

    def tokenizer(self):
        # imported late so weights work without it
        from ..tokens.tokenizer import chat_template_from_config, tokenizer_from_json
        return tokenizer_from_json(self.directory / TOKENIZER_FILE,
                                   chat_template=chat_template_from_config(self.directory))
