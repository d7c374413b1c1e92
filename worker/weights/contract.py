"""The weight-source contract every loader implements, and which tensors a stage needs.

Tensor names are llama.cpp's (`blk.3.attn_q.weight`); arrays are float32 numpy in Hugging Face
layout: matrices are (out_features, in_features) and q/k rows are in rotate-half order, so a GGUF
loader undoes llama.cpp's q/k permutation before handing them over. `load_packed` gives a matrix in
the file's own precision instead (worker/weights/packed.py), same layout.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..config import ModelConfig
from .packed import Packed

BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
PRECISIONS = ("auto", "file", "f32")  # which matrices keep the file's precision: see narrow_kinds
NARROW_KINDS = frozenset({"f16", "bf16", "q8_0", "q4_1"})  # worker/weights/packed.py's kinds other than f32
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


def narrow_kinds(precision: str, tuned: bool) -> frozenset[str]:
    """The file precisions a slice keeps as they are; the rest are widened to float32 at load.

    file: all it can; f32: none (the reference path); auto: Q8_0 and Q4_1 always (worker/compute/cpu_matvec.py's
    kernels read them packed on the CPU), F16 and BF16 only when kernels
    are searched (`tuned`): tinygrad's untuned CPU kernels read f16 about 4× slower than f32 (4 blocks of
    the 312 M model: 103 against 24 ms a step), searched ones a little faster (18 against 20 ms)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        return NARROW_KINDS if tuned else frozenset({"q8_0", "q4_1"})
    return NARROW_KINDS if precision == "file" else frozenset()


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

