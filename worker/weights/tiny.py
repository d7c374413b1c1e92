"""`tiny`: a built-in Llama-architecture model with random weights from a fixed seed.

It exists so demos and tests run offline in seconds on two CPU cores. Its output is random text.
Each tensor is drawn from its own seed (crc32 of its name), so a stage generates only its slice.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..config import ModelConfig, RopeScaling, llama3_freq_factors
from ..errors import ModelFileError
from .packed import Packed
from .packed import dense as packed_dense
from .contract import BLOCK_TENSORS, EMBEDDING, OUTPUT_NORM

# llama3.2's RoPE scaling, and its shape shrunk: 8 blocks so up to 8 stages each own one.
TINY_ROPE_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192)
TINY_CONFIG = ModelConfig(
    dim=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=261,
    norm_eps=1e-5, rope_theta=500000.0, max_context=512, tie_embeddings=True,
    rope_freq_factors=llama3_freq_factors(TINY_ROPE_SCALING, 500000.0, 32),
)


# `small`: the same recipe at a size where compute per token clearly dominates a hop (~250M parameters,
# 1 GB in float32, fits five ways on a 24 GiB machine); for benchmarks. Its output is random text too.
SMALL_CONFIG = ModelConfig(
    dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=4096, vocab_size=261,
    norm_eps=1e-5, rope_theta=500000.0, max_context=512, tie_embeddings=True,
    rope_freq_factors=llama3_freq_factors(TINY_ROPE_SCALING, 500000.0, 64),
)
BUILT_IN = {"tiny": TINY_CONFIG, "small": SMALL_CONFIG}


def _shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    c, kv = config, config.n_kv_heads * config.head_dim
    kind = name.split(".")[-2]
    return {
        "token_embd": (c.vocab_size, c.dim), "output": (c.vocab_size, c.dim), "output_norm": (c.dim,), "attn_norm": (c.dim,), "ffn_norm": (c.dim,),
        "attn_q": (c.dim, c.dim), "attn_k": (kv, c.dim), "attn_v": (kv, c.dim), "attn_output": (c.dim, c.dim),
        "ffn_gate": (c.ffn_dim, c.dim), "ffn_up": (c.ffn_dim, c.dim), "ffn_down": (c.dim, c.ffn_dim),
    }[kind]


def random_tensor(config: ModelConfig, name: str) -> np.ndarray:
    shape = _shape(config, name)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if len(shape) == 1:  # norm gains near 1, so activations keep their scale
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    w = rng.standard_normal(shape) / np.sqrt(shape[-1])
    if name == EMBEDDING:
        # Shrink the rows (and so, tied, the logits) of all but printable ASCII: the random text
        # stays readable and does not end at once on a stop token.
        w[[i for i in range(shape[0]) if not 32 <= i < 127]] *= 0.1
    else:
        # Blocks must outweigh the tied embedding in the residual stream, or the random model
        # just repeats its last token.
        w *= 2.0
    return w.astype(np.float32)


class TinySource:
    """WeightSource for the random `tiny` model (or any config, for tests and benchmarks)."""

    def __init__(self, config: ModelConfig = TINY_CONFIG, path: str = "tiny"):
        self.config, self.path = config, path
        blocks = {f"blk.{i}.{t}.weight" for i in range(config.n_layers) for t in BLOCK_TENSORS}
        head = set() if config.tie_embeddings else {"output.weight"}
        self._names = frozenset(blocks | head | {EMBEDDING, OUTPUT_NORM})

    def names(self) -> frozenset[str]:
        return self._names

    def load(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise ModelFileError(self.path, f"no tensor {name!r}")
        return random_tensor(self.config, name)

    def load_packed(self, name: str) -> Packed:
        return packed_dense("f32", self.load(name))  # random weights are made in float32

    def tokenizer(self):
        from ..tokens.tokenizer import byte_tokenizer
        return byte_tokenizer()
