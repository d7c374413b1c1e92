"""Write a tiny Hugging Face Llama directory (config.json + safetensors) for tests.

Written independently of worker/weights/hf.py (its own name table and safetensors writer), so tests
that read these files back check the loader against a second implementation.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from worker.config import ModelConfig, RopeScaling

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_tensor_name(internal: str) -> str:
    if internal in _GLOBAL:
        return _GLOBAL[internal]
    _, layer, kind, _ = internal.split(".")
    return f"model.layers.{layer}.{_BLOCK[kind]}.weight"


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16 bit patterns, as torch converts (finite inputs only)."""
    u = np.ascontiguousarray(x, dtype="<f4").view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def encode(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "F32":
        return np.ascontiguousarray(x, dtype="<f4").tobytes()
    if dtype == "F16":
        return np.ascontiguousarray(x, dtype="<f2").tobytes()
    if dtype == "BF16":
        return bf16_bits(x).tobytes()
    raise ValueError(f"unknown dtype {dtype}")


def safetensors_bytes(tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> bytes:
    """A safetensors file of name -> (dtype, shape, raw bytes), data in the given order."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    return struct.pack("<Q", len(raw)) + raw + b"".join(data for _, _, data in tensors.values())


def hf_config_dict(config: ModelConfig, *, rope_form: str = "legacy", rope_scaling: RopeScaling | None = None) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.dim,
           "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
           "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.ffn_dim,
           "vocab_size": config.vocab_size, "rms_norm_eps": config.norm_eps,
           "max_position_embeddings": config.max_context, "tie_word_embeddings": config.tie_embeddings,
           "torch_dtype": "float32", "hidden_act": "silu"}
    scaling = None if rope_scaling is None else {
        "rope_type": "llama3", "factor": rope_scaling.factor, "low_freq_factor": rope_scaling.low_freq_factor,
        "high_freq_factor": rope_scaling.high_freq_factor,
        "original_max_position_embeddings": rope_scaling.original_max_position_embeddings}
    if rope_form == "legacy":
        cfg.update(rope_theta=config.rope_theta, rope_scaling=scaling)
    elif rope_form == "parameters":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta, **(scaling or {})}
    else:
        raise ValueError(f"unknown rope_form {rope_form!r}")
    return cfg


def write_hf_dir(directory, config: ModelConfig, weights: dict[str, np.ndarray], *, rope_form: str = "legacy",
                 rope_scaling: RopeScaling | None = None, shards: int = 1, dtype: str = "F32") -> Path:
    """config.json plus model.safetensors (shards == 1) or shards with an index; weights use internal names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_dict(config, rope_form=rope_form, rope_scaling=rope_scaling)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {hf_tensor_name(n): (dtype, a.shape, encode(a, dtype)) for n, a in weights.items()}
    if shards == 1:
        (directory / "model.safetensors").write_bytes(safetensors_bytes(tensors))
        return directory
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        (directory / shard).write_bytes(safetensors_bytes(part))
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": sum(len(t[2]) for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory
