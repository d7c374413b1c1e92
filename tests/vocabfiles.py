"""Vocabularies for tokenizer parity tests, each as tokenizer.json and as GGUF metadata written the way
llama.cpp's converter writes it: a byte-level BPE trained with `tokenizers` whose ids are not merge ranks
(GPT-2's and SmolLM's splitting), and Meta's Llama 3 (the llama-models wheel's file). Deterministic, so
that ids recorded once with llama.cpp (record_llamacpp_ids.py) hold for the files the tests write."""
from __future__ import annotations

import json

import attrs
import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ggufmake import write_llama_gguf
from tokfiles import gguf_fields, llama3_vocab
from worker.config import ModelConfig

CONTROL, NORMAL = 3, 1
TRAIN_TEXT = ("The quick brown fox jumps over the lazy dog. It's 2024; we'll see 1,234 foxes! " * 3
              + "café naïve résumé — 日本語 テキスト 🦙 tabs\tand\nnewlines\n\n  spaces   here " * 3)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# the hard text: emoji, CJK, accents, digits, runs of spaces, tabs, newlines, contractions, a special token
HARD = ("Hello, wörld! 🦙🦙 日本語のテキスト café naïve 12345 2024 1,234 1,000,000 3.14159   three   spaces\ttab\t\tx\n\n"
        "newlines  \n  <|endoftext|> it's I'M we'LL don't   \n")
TEMPLATE = "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"
LLAMA3_TEMPLATE = "<|start_header_id|>user<|end_header_id|>\n\nSay hello<|eot_id|>"


def trained_bpe(pre: str) -> Tokenizer:
    """A byte-level BPE trained with GPT-2's splitting, so that it has merges of digits; `pre` "gpt-2"
    keeps that splitting, "smollm" also splits every digit apart (SmolLM's tokenizer.json), which only a
    tokenizer that reads `pre` gets right. "default" is the "gpt-2" one, written under llama.cpp's default
    pre-tokenizer (which splits punctuation and digits further)."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TRAIN_TEXT], trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = _shuffled(tok)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return tok


def _shuffled(tok: Tokenizer) -> Tokenizer:
    """The same tokenizer with its non-special ids permuted, so that ids are not merge ranks."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    names = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    order = np.random.default_rng(7).permutation(len(names))
    data["model"]["vocab"] = {**{t: i for i, t in enumerate(SPECIALS)},
                              **{names[j]: len(SPECIALS) + n for n, j in enumerate(order)}}
    return Tokenizer.from_str(json.dumps(data))


def bpe_gguf_fields(tok: Tokenizer) -> dict:
    """tokens, token_types, merges, bos_id, eos_id of a trained BPE, as llama.cpp's converter writes them."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"tokens": tokens, "token_types": [CONTROL if t in SPECIALS else NORMAL for t in tokens],
            "merges": merges, "bos_id": vocab["<|im_start|>"], "eos_id": vocab["<|im_end|>"]}


# tokenizer.ggml.pre of each ("default": the gpt-2 one), and "spm": tokenizer.ggml.model "llama"
VOCABS = ("gpt-2", "smollm", "default", "llama-bpe", "spm")
JSON_VOCABS = ("gpt-2", "smollm", "llama-bpe", "spm")  # those that also exist as a model's tokenizer.json


def gguf_fields_of(name: str) -> dict:
    """write_llama_gguf's tokenizer keywords for vocabulary `name`."""
    if name == "spm":
        return spm_gguf_fields(trained_spm())
    fields = gguf_fields(llama3_vocab()) if name == "llama-bpe" else bpe_gguf_fields(trained_bpe(name))
    return {**fields, "pre": name}


def template_of(name: str) -> str:
    return {"llama-bpe": LLAMA3_TEMPLATE, "spm": SPM_TEMPLATE}.get(name, TEMPLATE)


def write_vocab_gguf(path, name: str) -> None:
    """A small llama GGUF (random weights) carrying vocabulary `name`."""
    from test_gguf import hf_weights
    fields = gguf_fields_of(name)
    config = attrs.evolve(ModelConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=1,
                                      max_context=128), vocab_size=len(fields["tokens"]))
    weights = {n: w.astype(np.float32) for n, w in hf_weights(config).items()}
    write_llama_gguf(path, config, weights, **fields)


SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
UNKNOWN, BYTE = 2, 6
SPM_TEMPLATE = "<s>Say hello</s>"


def trained_spm() -> Tokenizer:
    """A SentencePiece-style BPE with byte fallback, laid out as Llama 2's (and TinyLlama's) tokenizer.json:
    <unk> <s> </s>, the 256 byte pieces <0x00>..<0xFF>, then pieces; "▁" for spaces, one prepended. The
    alphabet is cut short so that emoji, most CJK and some letters fall back to bytes."""
    trainee = Tokenizer(models.BPE(unk_token="<unk>"))
    trainee.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")  # words
    # a fixed alphabet, always kept whole, and single characters in code point order: the trainer's own
    # order of equally frequent characters changes from run to run
    alphabet = sorted({c for c in TRAIN_TEXT.replace(" ", "▁") if c.isascii() and c not in "HQ"} | set("▁éï日本語"))
    trainee.train_from_iterator([TRAIN_TEXT], trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPM_SPECIALS, initial_alphabet=alphabet, limit_alphabet=len(alphabet),
        show_progress=False))
    trained = json.loads(trainee.to_str())["model"]
    learned = [t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if len(t) > 1 and t not in SPM_SPECIALS]
    pieces = sorted(t for t in trained["vocab"] if len(t) == 1) + learned
    vocab = {t: i for i, t in enumerate(SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces)}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = trainee.normalizer  # Llama 2's tokenizer.json has no pre-tokenizer: this does the spaces
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(SPM_SPECIALS)
    return tok


def spm_gguf_fields(tok: Tokenizer) -> dict:
    """tokens, token types and scores as llama.cpp's converter writes a SentencePiece vocabulary: no merges;
    each piece scored as SentencePiece scores BPE pieces, the later learned the lower."""
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [UNKNOWN if t == "<unk>" else CONTROL if t in SPM_SPECIALS else BYTE if i < 259 else NORMAL
             for i, t in enumerate(tokens)]
    return {"tokens": tokens, "token_types": types, "scores": [0.0 if i < 259 else -float(i) for i in range(len(tokens))],
            "merges": [], "bos_id": 1, "eos_id": 2, "unk_id": 0, "model": "llama"}
