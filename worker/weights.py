"""The weight-source contract every loader implements, and which tensors a stage needs.

Tensor names are llama.cpp's (`blk.3.attn_q.weight`); arrays are float32 numpy in Hugging Face
layout: matrices are (out_features, in_features) and q/k rows are in rotate-half order, so a GGUF
loader undoes llama.cpp's q/k permutation before handing them over. `load_packed` gives a matrix in
the file's own precision instead (worker/packed.py), same layout.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from .config import ModelConfig

if TYPE_CHECKING:  # packed.py builds on this module's aligned_empty
    from .packed import Packed

BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
PRECISIONS = ("file", "f32")  # matrices as the file holds them, or widened to float32 at load
EMBEDDING = "token_embd.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"


class WeightSource(Protocol):
    """Where a model's config, tensors and tokenizer come from (GGUF file, HF directory, tiny)."""

    config: ModelConfig
    path: str  # named in every error

    def names(self) -> frozenset[str]: ...

    def load(self, name: str) -> np.ndarray: ...  # float32

    def load_packed(self, name: str) -> Packed: ...  # a matrix as the file holds it, where kernels can read it so

    def tokenizer(self): ...


def is_matrix(name: str) -> bool:
    """Every tensor a stage loads is a matrix but the norm weights."""
    return not name.endswith("_norm.weight")


def block_tensor_names(layer: int) -> list[str]:
    return [f"blk.{layer}.{t}.weight" for t in BLOCK_TENSORS]


def stage_tensor_names(config: ModelConfig, layers: range, *, embed: bool, head: bool) -> list[str]:
    """Exactly the tensors a stage running `layers` loads: its blocks, plus embedding and/or head."""
    names = [n for layer in layers for n in block_tensor_names(layer)]
    if embed:
        names.append(EMBEDDING)
    if head:
        names.append(OUTPUT_NORM)
        head_name = EMBEDDING if config.tie_embeddings else OUTPUT
        if head_name not in names:
            names.append(head_name)
    return names


ALIGN = 4096  # what tinygrad's own CPU buffers get: the CPU device can compute on such an array in place


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised byte array whose data starts on an ALIGN boundary."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes]
