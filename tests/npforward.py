"""Test helper: an independent Llama forward pass in numpy, the reference pp's tinygrad stages answer to.

Hugging Face layout and arithmetic, written from the architecture rather than from worker/compute/model.py:
RMSNorm, rotate-half RoPE (with GGUF's per-frequency divisors when the config has them), grouped-query
attention, SwiGLU, and a tied or untied head. It shares nothing with pp but the config and the tensor
names. `dtype` is the arithmetic: float64 for the random test families, float32 for a real file's weights
(the same dequantized float32 values pp holds). A KV cache makes greedy decoding over a real model's 30
blocks cost one row a step rather than the whole sequence again.
"""
from __future__ import annotations

import numpy as np

from worker.config import ModelConfig
from worker.weights.contract import EMBEDDING, OUTPUT, OUTPUT_NORM


def rms_norm(x, weight, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rope(x, positions, c: ModelConfig):
    """x: (positions, heads, head_dim), Hugging Face's rotate-half layout. Angles in float64, then x's dtype."""
    half = c.head_dim // 2
    inv = 1.0 / c.rope_theta ** (np.arange(half) * 2 / c.head_dim)
    if c.rope_freq_factors is not None:
        inv = inv / np.asarray(c.rope_freq_factors)
    angle = np.asarray(positions)[:, None] * inv[None, :]
    cos, sin = (t.astype(x.dtype)[:, None, :] for t in (np.cos(angle), np.sin(angle)))
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class Forward:
    """One sequence through the whole model; each call feeds the next ids and keeps their keys and values."""

    def __init__(self, c: ModelConfig, w: dict[str, np.ndarray], dtype=np.float64):
        self.c, self.dtype = c, np.dtype(dtype)
        self.w = {k: v.astype(dtype, copy=False) for k, v in w.items()}
        self.keys: list[np.ndarray | None] = [None] * c.n_layers  # (positions, heads, head_dim), repeated for GQA
        self.values: list[np.ndarray | None] = [None] * c.n_layers
        self.position = 0

    def logits(self, ids: list[int]) -> np.ndarray:
        """The next-token logits after `ids` (the last row's), having fed them at the current position."""
        return self.rows(ids)[-1]

    def rows(self, ids: list[int]) -> np.ndarray:
        """The next-token logits after each of `ids` (len(ids), vocab), fed at the current position."""
        c, w = self.c, self.w
        x, t = w[EMBEDDING][ids], len(ids)
        positions = np.arange(self.position, self.position + t)
        for layer in range(c.n_layers):
            p = f"blk.{layer}."
            x = x + self._attention(layer, rms_norm(x, w[p + "attn_norm.weight"], c.norm_eps), positions)
            h = rms_norm(x, w[p + "ffn_norm.weight"], c.norm_eps)
            gate = h @ w[p + "ffn_gate.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        self.position += t
        head = w[EMBEDDING] if c.tie_embeddings else w[OUTPUT]
        return rms_norm(x, w[OUTPUT_NORM], c.norm_eps) @ head.T

    def _attention(self, layer: int, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        c, w, p, t = self.c, self.w, f"blk.{layer}.", len(h)
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(t, c.n_heads, c.head_dim), positions, c)
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(t, c.n_kv_heads, c.head_dim), positions, c)
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, c.n_kv_heads, c.head_dim)
        group = c.n_heads // c.n_kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        if self.keys[layer] is not None:
            k, v = np.concatenate([self.keys[layer], k]), np.concatenate([self.values[layer], v])
        self.keys[layer], self.values[layer] = k, v
        # query i (at positions[i]) sees keys 0..positions[i]
        mask = np.where(np.arange(len(k))[None, :] <= positions[:, None], 0.0, -np.inf).astype(self.dtype)
        scores = np.einsum("thd,shd->hts", q, k) / self.dtype.type(np.sqrt(c.head_dim)) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        return np.einsum("hts,shd->thd", probs, v).reshape(t, c.dim) @ w[p + "attn_output.weight"].T


def reference_logits(c: ModelConfig, w: dict, ids: list[int], dtype=np.float64) -> np.ndarray:
    return Forward(c, w, dtype).logits(ids)


def teacher_forced(c: ModelConfig, w: dict, prompt: list[int], tokens: list[int], dtype=np.float64) -> np.ndarray:
    """The logits each of `tokens` was chosen from, had `prompt` + `tokens` been generated: one pass over the
    whole sequence. A generation is greedy by this reference exactly when each token is its row's argmax."""
    return Forward(c, w, dtype).rows(list(prompt) + list(tokens[:-1]))[len(prompt) - 1:]


def reference_greedy(c: ModelConfig, w: dict, prompt: list[int], n: int, *, dtype=np.float64,
                     stop_ids: frozenset[int] = frozenset()) -> tuple[list[int], list[np.ndarray]]:
    """Up to `n` greedy tokens after `prompt` and the logits each was taken from; a stop id ends it (kept)."""
    forward, feed, tokens, logits = Forward(c, w, dtype), list(prompt), [], []
    while len(tokens) < n and not (tokens and tokens[-1] in stop_ids):
        logits.append(forward.logits(feed))
        tokens.append(int(logits[-1].argmax()))
        feed = [tokens[-1]]
    return tokens, logits
