"""A contiguous slice of a Llama transformer in tinygrad: blocks [lo, hi) with their KV caches,
plus the final norm and output head when the slice is the last one.

The embedding lookup is not here: it is a row gather the first stage does in numpy, so every
slice takes a hidden state in and all slices compile the same kernels whatever their role.
"""
from __future__ import annotations

import numpy as np
from tinygrad import Tensor, TinyJit, UOp
from tinygrad.device import Buffer

from .config import ModelConfig
from .weights import OUTPUT_NORM

# HF rotate-half RoPE: the first and second halves of each head form the rotary pairs.

STEPWISE_PREFILL_MAX = 256  # longer prompts take the batched prefill (a compile per length, fewer steps)


def rope_tables(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position × frequency, (max_context, head_dim // 2) float32."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float64)
    angles = np.outer(np.arange(config.max_context, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * (x.square().mean(axis=-1, keepdim=True) + eps).rsqrt() * weight


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)


class Block:
    """One transformer block and its KV cache (batch 1)."""

    def __init__(self, config: ModelConfig, w: dict[str, Tensor]):
        self.config, self.w = config, w
        c = config
        self.cache_kv = Tensor.zeros(2, 1, c.n_kv_heads, c.max_context, c.head_dim).contiguous().realize()

    def __call__(self, x: Tensor, start_pos: int | UOp, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        c, w = self.config, self.w
        h = x + self._attention(_rms_norm(x, w["attn_norm"], c.norm_eps), start_pos, cos, sin, mask)
        ffn_in = _rms_norm(h, w["ffn_norm"], c.norm_eps)
        ffn = (ffn_in @ w["ffn_gate"].T).silu() * (ffn_in @ w["ffn_up"].T)
        # contiguous: the block output is a buffer in every slicing, so kernels never fuse across blocks
        return (h + ffn @ w["ffn_down"].T).contiguous()

    def _attention(self, x, start_pos, cos, sin, mask):
        c, w = self.config, self.w
        _, t, _ = x.shape
        q = (x @ w["attn_q"].T).reshape(1, t, c.n_heads, c.head_dim).transpose(1, 2)
        k = (x @ w["attn_k"].T).reshape(1, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = (x @ w["attn_v"].T).reshape(1, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        self.cache_kv[:, :, :, start_pos:start_pos + t, :].assign(Tensor.stack(k, v)).realize()
        keys = self.cache_kv[0, :, :, 0:start_pos + t, :]
        values = self.cache_kv[1, :, :, 0:start_pos + t, :]
        out = q.scaled_dot_product_attention(keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(1, t, c.dim) @ w["attn_output"].T


class StageModel:
    """Blocks `layers` of a model; with `head`, also final norm + output head (returns logits)."""

    def __init__(self, config: ModelConfig, layers: range, tensors: dict[str, np.ndarray], *, head_weight: str | None):
        self.config, self.layers = config, layers
        dev = {name: Tensor(arr).realize() for name, arr in tensors.items() if name != "token_embd.weight"}
        self.blocks = [Block(config, {k.split(".")[2]: v for k, v in dev.items() if k.startswith(f"blk.{i}.")})
                       for i in layers]
        self.head = None
        if head_weight is not None:
            head = dev[head_weight] if head_weight in dev else Tensor(tensors[head_weight]).realize()
            self.head = (dev[OUTPUT_NORM], head)
        cos, sin = rope_tables(config)
        self.cos, self.sin = Tensor(cos).realize(), Tensor(sin).realize()
        self._decode = TinyJit(self._forward)
        self._decode_in: Tensor | None = None

    def _forward(self, x: Tensor, start_pos: int | UOp) -> Tensor:
        t = x.shape[1]
        cos = self.cos[start_pos:start_pos + t].reshape(1, 1, t, -1)
        sin = self.sin[start_pos:start_pos + t].reshape(1, 1, t, -1)
        mask = None
        if t > 1:  # causal, lower-right aligned: query i sees keys up to start_pos + i
            mask = Tensor.ones(t, start_pos + t).tril(start_pos).cast("bool").reshape(1, 1, t, start_pos + t)
        for block in self.blocks:
            x = block(x, start_pos, cos, sin, mask)
        if self.head is not None:
            norm, out = self.head
            x = _rms_norm(x[:, -1, :], norm, self.config.norm_eps) @ out.T
        return x.realize()

    def _decode_input(self, data: np.ndarray) -> Tensor:
        """One token's hidden state in a buffer reused every step: copying into it is far cheaper than
        building and realizing a new Tensor from numpy each step (docs/benchmarks.md, change 1)."""
        if self._decode_in is None:
            self._decode_in = Tensor.zeros(1, 1, data.shape[-1]).contiguous().realize()
        buffer = self._decode_in.uop.buffer
        buffer.copy_from(Buffer("PYTHON", buffer.size, buffer.dtype,
                                opaque=memoryview(data.reshape(-1)).cast("B")).ensure_allocated())
        return self._decode_in

    def forward(self, hidden: np.ndarray, start_pos: int) -> np.ndarray:
        """hidden (seq_len, dim) float32 → next hidden (seq_len, dim), or logits (vocab,) with a head.

        Prompts up to STEPWISE_PREFILL_MAX tokens go through the one-token JIT a row at a time: a batched
        prefill compiles new kernels for every prompt length (seconds per stage on a CPU, on the first
        token's critical path), while the step graph is compiled once, at boot (warm_up)."""
        seq_len = hidden.shape[0]
        if start_pos + seq_len > self.config.max_context:
            raise ValueError(f"position {start_pos + seq_len} exceeds the context of {self.config.max_context}")
        data = np.ascontiguousarray(hidden, dtype=np.float32)
        if seq_len > STEPWISE_PREFILL_MAX:
            out = self._forward(Tensor(data.reshape(1, seq_len, -1)).realize(), start_pos).numpy()
            return out.reshape(-1) if self.head is not None else out.reshape(seq_len, -1)
        rows = [self._step(data[i:i + 1], start_pos + i) for i in range(seq_len)]
        return rows[-1].reshape(-1) if self.head is not None else np.concatenate(rows).reshape(seq_len, -1)

    def _step(self, row: np.ndarray, position: int) -> np.ndarray:
        # symbolic position: one compiled graph for every position (stack-facts §2)
        pos = UOp.variable("start_pos", 0, self.config.max_context - 1).bind(position)
        return self._decode(self._decode_input(row), pos).numpy()

    def warm_up(self) -> None:
        """Compile and capture the step graph now (TinyJit captures on its second call), so that the
        first request pays no compile. Positions 0..2 get overwritten by any request's prefill."""
        zeros = np.zeros((1, self.config.dim), dtype=np.float32)
        for position in range(3):
            self._step(zeros, position)
