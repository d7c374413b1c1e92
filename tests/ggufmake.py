"""Test helper: write small llama.cpp-layout Llama GGUF files with gguf-py's GGUFWriter.

Weights arrive in Hugging Face layout and are written the way llama.cpp's converter writes them
(q/k rows permuted), optionally quantised per tensor.
"""
from __future__ import annotations

import re

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from worker.config import ModelConfig


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """ggml bytes (or float16 for F16) of a float32 array; K-quants use the simple encoders below
    because gguf-py 0.19 can only decode them."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == Q.Q6_K:
        return _q6_k(w.reshape(-1, 256)).reshape(*w.shape[:-1], -1)
    if qtype == Q.Q4_K:
        return _q4_k(w.reshape(-1, 256)).reshape(*w.shape[:-1], -1)
    return gguf.quants.quantize(w, qtype)


def _f16_scale(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block scale as stored (float16 bytes) and as the decoder will see it (float32)."""
    half = x.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32)


def _div(a, b):
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Round-to-nearest Q6_K: 16 int8 sub-block scales, 6-bit values, layout per ggml's block_q6_K."""
    n = len(blocks)
    sub = blocks.reshape(n, 16, 16)
    sub_scale = np.abs(sub).max(-1) / 31
    d_bytes, d = _f16_scale(sub_scale.max(-1) / 127)
    sc = np.clip(np.round(_div(sub_scale, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = (np.clip(np.round(_div(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    low = (q & 0xF).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """Round-to-nearest Q4_K: 8 sub-blocks of 32 with 6-bit scale and min, layout per block_q4_K."""
    n = len(blocks)
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    sub_scale, sub_min = (sub.max(-1) - lo) / 15, -lo
    d_bytes, d = _f16_scale(sub_scale.max(-1) / 63)
    m_bytes, dmin = _f16_scale(sub_min.max(-1) / 63)
    sc = np.clip(np.round(_div(sub_scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_div(sub_min, dmin[:, None])), 0, 63).astype(np.uint8)
    step, offset = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.round(_div(sub + offset[..., None], step[..., None])), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=1)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d_bytes, m_bytes, scales, qs], axis=1)


_QK = re.compile(r"blk\.\d+\.attn_([qk])\.weight")


def write_llama_gguf(path, config: ModelConfig, weights: dict[str, np.ndarray], *, tokens: list[str],
                     token_types: list[int], merges: list[str], bos_id: int, eos_id: int,
                     qtypes: dict[str, Q] | None = None, architecture: str = "llama", pre: str = "llama-bpe",
                     add_bos: bool | None = None, model: str = "gpt2", scores: list[float] | None = None,
                     unk_id: int | None = None) -> None:
    """Write `weights` (HF layout, llama.cpp names) and `config` as llama.cpp's converter would.

    `architecture` other than "llama" renames the metadata prefix too, as a foreign file would have.
    """
    if config.tie_embeddings == ("output.weight" in weights):
        raise ValueError(f"tie_embeddings={config.tie_embeddings} but output.weight "
                         f"{'is' if 'output.weight' in weights else 'is not'} in weights")
    qtypes = qtypes or {}
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_block_count(config.n_layers)
    w.add_context_length(config.max_context)
    w.add_embedding_length(config.dim)
    w.add_feed_forward_length(config.ffn_dim)
    w.add_head_count(config.n_heads)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_layer_norm_rms_eps(config.norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_rope_dimension_count(config.head_dim)
    w.add_vocab_size(config.vocab_size)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    if merges:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    if unk_id is not None:
        w.add_unk_token_id(unk_id)
    w.add_bos_token_id(bos_id)
    w.add_eos_token_id(eos_id)
    if config.rope_freq_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(config.rope_freq_factors, dtype=np.float32))
    for name, array in weights.items():
        array = np.asarray(array, dtype=np.float32)
        if m := _QK.fullmatch(name):
            array = permute_qk(array, config.n_heads if m.group(1) == "q" else config.n_kv_heads)
        qtype = qtypes.get(name, Q.F32)
        data = quantize(array, qtype)
        # float32/float16 arrays carry their type; ggml bytes need it said (the writer derives the shape)
        w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
