"""Write a random-weight Llama GGUF for side-by-side benchmarks (no download): by default the shape of
issue 12's comparison — dim 1024, 16 blocks, FFN 2816, 16 query / 4 KV heads, Llama 3's 128k vocabulary
and tokenizer, tied head, about 312 M parameters (1.25 GB in F32). llama.cpp and pp both load it.

  python -m bench.make_gguf /tmp/bench-f32.gguf
  llama-quantize /tmp/bench-f32.gguf /tmp/bench-q8_0.gguf Q8_0      # the Q8_0 version, with llama.cpp's tool

Needs the test requirements (gguf, llama-models for the Llama 3 vocabulary file).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the GGUF and vocabulary writers

from ggufmake import write_llama_gguf  # noqa: E402
from tokfiles import gguf_fields, llama3_vocab  # noqa: E402

from worker.config import ModelConfig  # noqa: E402


def bench_config(args) -> ModelConfig:
    return ModelConfig(dim=args.dim, n_layers=args.blocks, n_heads=args.heads, n_kv_heads=args.kv_heads,
                       ffn_dim=args.ffn, vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0,
                       max_context=args.context, tie_embeddings=True)


def random_weights(c: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """HF-layout weights scaled so activations stay in range through every block."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
    kv = c.n_kv_heads * c.head_dim
    out = {"token_embd.weight": w(c.vocab_size, c.dim), "output_norm.weight": np.ones(c.dim, np.float32)}
    for i in range(c.n_layers):
        out |= {f"blk.{i}.attn_norm.weight": np.ones(c.dim, np.float32), f"blk.{i}.attn_q.weight": w(c.dim, c.dim),
                f"blk.{i}.attn_k.weight": w(kv, c.dim), f"blk.{i}.attn_v.weight": w(kv, c.dim),
                f"blk.{i}.attn_output.weight": w(c.dim, c.dim), f"blk.{i}.ffn_norm.weight": np.ones(c.dim, np.float32),
                f"blk.{i}.ffn_gate.weight": w(c.ffn_dim, c.dim), f"blk.{i}.ffn_up.weight": w(c.ffn_dim, c.dim),
                f"blk.{i}.ffn_down.weight": w(c.dim, c.ffn_dim)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.make_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = bench_config(args)
    weights = random_weights(config, args.seed)
    write_llama_gguf(args.path, config, weights, **gguf_fields(llama3_vocab()))
    params = sum(a.size for a in weights.values())
    print(f"{args.path}: {params / 1e6:.0f} M parameters, {args.path.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
