"""Write a byte-level BPE vocabulary the way real model files carry it: GGUF tokenizer fields and a
Hugging Face tokenizer.json. Merges are every split of a token into two tokens, sorted by the id
they make, as Hugging Face's tiktoken converter writes them (Llama 3's files have this shape)."""
from __future__ import annotations

import functools
import importlib.resources
import json
import os
from pathlib import Path

import attrs
import pytest
import tiktoken.load

from worker.tokens.gguf_vocab import CONTROL, NORMAL, bytes_to_unicode
from worker.tokens.tokenizer import BEGIN_OF_TEXT, BYTE_SPECIALS, END_OF_TEXT

# Meta's pre-tokenizer regex (llama_models/llama3/tokenizer.py), as Llama 3's tokenizer.json carries it
PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_RANKS_FILE = importlib.resources.files("llama_models.llama3") / "tokenizer.model"

_BYTE_CHARS = bytes_to_unicode()


@attrs.frozen(eq=False)
class Vocab:
    """A byte-level BPE vocabulary: token bytes -> id (ids are merge ranks), and special tokens."""

    mergeable_ranks: dict[bytes, int]
    special_ids: dict[str, int]
    bos_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int:
        return len(self.mergeable_ranks) + len(self.special_ids)


def vocab(ranks: dict[bytes, int], special_names, *, eos: str = END_OF_TEXT) -> Vocab:
    """`ranks` then the named specials, BOS <|begin_of_text|>."""
    specials = {name: len(ranks) + n for n, name in enumerate(special_names)}
    return Vocab(ranks, specials, bos_id=specials[BEGIN_OF_TEXT], eos_id=specials[eos])


@functools.cache
def byte_vocab() -> Vocab:
    """The tiny model's vocabulary (worker.tokens.tokenizer.byte_tokenizer): id = byte value, then five specials."""
    return vocab({bytes([b]): b for b in range(256)}, BYTE_SPECIALS)


def byte_level(token: bytes) -> str:
    return "".join(_BYTE_CHARS[b] for b in token)


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """All (a, b) with a, b and a+b tokens, ordered by (rank of a+b, rank of a, rank of b)."""
    found = [(rank, ranks[t[:i]], ranks[t[i:]], t[:i], t[i:])
             for t, rank in ranks.items() for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks]
    found.sort()
    return [(a, b) for *_, a, b in found]


@functools.cache
def _merge_strings(tok: Vocab) -> tuple[tuple[str, str], ...]:
    return tuple((byte_level(a), byte_level(b)) for a, b in derive_merges(tok.mergeable_ranks))


def gguf_fields(tok: Vocab) -> dict:
    """tokens, token_types, merges ("a b"), bos_id, eos_id: ggufmake.write_llama_gguf's keywords."""
    tokens, types = [""] * tok.vocab_size, [NORMAL] * tok.vocab_size
    for token, i in tok.mergeable_ranks.items():
        tokens[i], types[i] = byte_level(token), NORMAL
    for name, i in tok.special_ids.items():
        tokens[i], types[i] = name, CONTROL
    return {"tokens": tokens, "token_types": types, "merges": [f"{a} {b}" for a, b in _merge_strings(tok)],
            "bos_id": tok.bos_id, "eos_id": tok.eos_id}


def gguf_metadata(tok: Vocab) -> dict:
    """The same fields under their GGUF metadata keys, as a GGUF reader returns them."""
    f = gguf_fields(tok)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": f["tokens"], "tokenizer.ggml.token_type": f["token_types"],
            "tokenizer.ggml.merges": f["merges"], "tokenizer.ggml.bos_token_id": f["bos_id"],
            "tokenizer.ggml.eos_token_id": f["eos_id"]}


def tokenizer_json(tok: Vocab, *, pair_merges: bool = False) -> dict:
    """A Hugging Face tokenizer.json document; merges as "a b" strings or, newer style, [a, b] pairs."""
    merges = _merge_strings(tok)
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for name, i in sorted(tok.special_ids.items(), key=lambda x: x[1])]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PAT_STR}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {byte_level(t): i for t, i in tok.mergeable_ranks.items()},
                  "merges": [list(m) if pair_merges else " ".join(m) for m in merges]},
    }


def write_tokenizer_json(tok: Vocab, directory, *, pair_merges: bool = False) -> Path:
    """Write `directory`/tokenizer.json for `tok`; returns its path."""
    path = Path(directory) / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json(tok, pair_merges=pair_merges), ensure_ascii=False), encoding="utf-8")
    return path


@functools.cache
def llama3_vocab() -> Vocab:
    """Meta's Llama 3 vocabulary (the ranks file llama_models ships) with its 256 specials, no network."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # a local file: read it, don't copy it into a cache
        ranks = tiktoken.load.load_tiktoken_bpe(os.fspath(LLAMA3_RANKS_FILE))
    named = [BEGIN_OF_TEXT, END_OF_TEXT, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>"]
    return vocab(ranks, named + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(named))])
