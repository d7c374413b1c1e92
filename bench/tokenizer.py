"""Tokenizer cost on one GGUF's byte-level BPE vocabulary: building it from the file's metadata (time,
memory kept) and encoding a long text (MB/s, tokens/s) and a chat prompt. `tokenizers` is pp's tokenizer
(worker.tokens.tokenizer, Hugging Face tokenizers); `tiktoken` is the same vocabulary as a tiktoken Encoding with
Llama 3's regex (what pp used before, valid only where ids are merge ranks, as in Llama 3's files). Run
once per implementation: the memory figure is what the process grows by. Needs tiktoken (test requirements).

  python -m bench.tokenizer /tmp/bench-q8_0.gguf --impl tiktoken
  python -m bench.tokenizer /tmp/bench-q8_0.gguf --impl tokenizers
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from pathlib import Path

from worker.weights.gguf_header import read_header

# a text of every kind the tokenizers split differently: prose, code, digits, accents, CJK, emoji, spaces
SAMPLE = (Path(__file__).resolve().parent.parent / "README.md").read_text() + (
    "naïve café 日本語のテキスト 🦙🦙  12345 1,000,000\t\tx\n\n   spaces  ") * 50


class TiktokenVocab:
    """The vocabulary as tiktoken ranks (token bytes -> id), encoding ordinary text and Llama 3 chat prompts."""

    def __init__(self, kv):
        import tiktoken

        from worker.tokens.gguf_vocab import CONTROL, LLAMA3_REGEX, token_bytes
        tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
        table = token_bytes("gpt2", tokens, types)
        ranks = {b: i for i, (b, kind) in enumerate(zip(table, types)) if kind != CONTROL}
        specials = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == CONTROL}
        self.vocab_size = len(tokens)
        self._enc = tiktoken.Encoding("bench", pat_str=LLAMA3_REGEX, mergeable_ranks=ranks, special_tokens=specials)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_chat(self, prompt: str) -> list[int]:
        text = (f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
        return self._enc.encode(text, allowed_special="all")


def build(impl: str, kv, path):
    if impl == "tiktoken":
        return TiktokenVocab(kv)
    from worker.tokens.tokenizer import tokenizer_from_gguf_metadata
    return tokenizer_from_gguf_metadata(kv, path)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tokenizer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf")
    p.add_argument("--impl", choices=("tiktoken", "tokenizers"), required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kb", type=int, default=1024, help="size of the encoded text")
    args = p.parse_args(argv)
    with open(args.gguf, "rb") as f:
        kv = read_header(f, Path(args.gguf).stat().st_size, args.gguf).kv
    text = (SAMPLE * (args.kb * 1024 // len(SAMPLE.encode()) + 1))[:args.kb * 1024]
    gc.collect()
    before = rss_mb()
    started = time.perf_counter()
    tok = build(args.impl, kv, args.gguf)
    build_s = time.perf_counter() - started
    del kv
    gc.collect()
    kept = rss_mb() - before
    times, ids = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        ids = tok.encode(text)
        times.append(time.perf_counter() - started)
    short = [tok.encode_chat("Say hello") for _ in range(1000)]
    started = time.perf_counter()
    for _ in range(1000):
        tok.encode_chat("Say hello")
    chat_us = (time.perf_counter() - started) * 1e3
    best = min(times)
    print(json.dumps({"impl": args.impl, "vocab": tok.vocab_size, "build_s": round(build_s, 2),
                      "kept_mb": round(kept), "text_kb": args.kb, "tokens": len(ids),
                      "encode_mb_s": round(len(text.encode()) / best / 2 ** 20, 2),
                      "encode_tok_s": round(len(ids) / best), "encode_chat_us": round(chat_us, 1),
                      "ids_head": ids[:8], "chat_ids": short[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
