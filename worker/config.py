"""Model hyper-parameters, and the Llama 3 RoPE frequency scaling derived from them."""
from __future__ import annotations

import math

import attrs

# Positions one sequence slot holds unless --ctx says otherwise: KV is allocated for every slot's whole
# context on every stage, so this sets a node's memory. SmolLM2-135M at 2048 is 48 MB of KV a slot in
# all (30 blocks × 2 × 192 floats × 4 bytes a position); its file allows 8192.
DEFAULT_CONTEXT = 2048
# The most positions a model's config says it holds, whatever its file advertises (GGUF and Hugging Face
# alike): KV is allocated for the whole context up front, and Llama 3.2 1B's 131072 would need ~8 GiB of
# float32 K and V (16 layers x 512 wide).
MAX_CONTEXT_CAP = 8192
# The most threads a stage computes on (--threads): the CPU pool's fixed table size (compute/cpu_threads.py).
MAX_THREADS = 256


@attrs.frozen
class RopeScaling:
    """Hugging Face `rope_scaling` with `rope_type: "llama3"`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@attrs.frozen
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Divisors of the base RoPE frequencies, one per rotary pair (head_dim // 2), or None.
    # This is GGUF's `rope_freqs.weight`; Hugging Face configs derive it with llama3_freq_factors.
    rope_freq_factors: tuple[float, ...] | None = None
    max_context: int = 2048
    tie_embeddings: bool = False

    def __attrs_post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"dim {self.dim}, heads {self.n_heads}, kv heads {self.n_kv_heads} do not divide evenly")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, want {self.head_dim // 2}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def llama3_freq_factors(scaling: RopeScaling, theta: float, head_dim: int) -> tuple[float, ...]:
    """Per-frequency divisors as llama.cpp's converter writes them into `rope_freqs.weight`."""
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    return tuple(factors)
