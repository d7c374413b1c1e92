"""A GGUF file's vocabulary as a Hugging Face `tokenizers.Tokenizer`, built the way llama.cpp reads it.

Not transformers' GGUF conversion: that ignores `tokenizer.ggml.pre` (it splits every byte-level BPE by
GPT-2's regex) and the BOS settings (../shared/notes/tokenizers-and-models.md). Here:
- `tokenizer.ggml.model` "gpt2": byte-level BPE over tokens + merges; the splitting regexes are chosen by
  `tokenizer.ggml.pre` exactly as llama.cpp's llm_tokenizer_bpe chooses them (src/llama-vocab.cpp), each
  regex re-splitting the pieces of the one before; Llama 3's pre-tokenizer also takes a whole piece that
  is in the vocabulary as one token (llama.cpp's ignore_merges).
- "llama": SentencePiece (tokens, scores, token types, <0xNN> byte fallback, "▁" for spaces), see _spm.
- Control and user-defined tokens are added tokens, matched only in text that may hold special tokens
  (llama.cpp's parse_special; see worker.tokens.tokenizer.Tokenizer._encode).
Anything else is refused, naming the file and the value.
"""
from __future__ import annotations

from collections.abc import Mapping

import attrs
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..errors import ModelFileError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@attrs.frozen
class _Pre:
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file does not say


_LLAMA3_PRE = _Pre((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
# tokenizer.ggml.pre → what llama.cpp does with it (the names these models use; more map the same way there)
PRE_TOKENIZERS: dict[str, _Pre] = {
    **{name: _LLAMA3_PRE for name in ("llama-bpe", "llama3", "llama-v3")},
    "smollm": _Pre((r"\p{N}", _GPT2)),
    "gpt-2": _Pre((_GPT2,)),
    "default": _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf-py's TokenType


@attrs.frozen(eq=False)
class GGUFVocab:
    """The tokenizer, the checked token list and types, and the settings llama.cpp takes from the same keys."""

    tokenizer: Tokenizer
    model: str
    tokens: list[str]
    types: list[int]
    add_bos: bool
    bos_id: int
    eos_id: int
    eot_id: int | None
    # byte-level vocabularies: the bytes with no token of their own. SmolLM2's lacks 21 — 0xC0, 0xC1 and
    # 0xF5.., which UTF-8 never holds, but also 0xF1, 0xF2 and some control bytes — and llama.cpp and
    # transformers load it; text holding one is refused when encoded (worker.tokens.tokenizer), not the file
    unencodable: frozenset[int] = frozenset()


def vocab_from_gguf(kv: Mapping, path) -> GGUFVocab:
    path = str(path)
    model = kv.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        said = "missing" if model is None else repr(model)
        raise ModelFileError(path, f"tokenizer.ggml.model is {said}; supported: 'gpt2', 'llama'")
    tokens, types = _list(kv, "tokenizer.ggml.tokens", path), kv.get("tokenizer.ggml.token_type")
    types = types if types is not None else [NORMAL] * len(tokens)  # llama.cpp: all normal when absent
    if not isinstance(types, list) or len(types) != len(tokens):
        raise ModelFileError(path, f"tokenizer.ggml.token_type is not a list of {len(tokens)} entries, one per token")
    if (bad := next((i for i, t in enumerate(tokens) if not isinstance(t, str) or not t), None)) is not None:
        raise ModelFileError(path, f"tokenizer.ggml.tokens[{bad}] is {tokens[bad]!r}, not a token's text")
    vocab = {text: i for i, text in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelFileError(path, "tokenizer.ggml.tokens repeats a token")
    tok, add_bos = (_bpe if model == "gpt2" else _spm)(kv, path, tokens, types, vocab)
    unencodable = frozenset(b for b, c in bytes_to_unicode().items() if c not in vocab) if model == "gpt2" else frozenset()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)])
    return GGUFVocab(tok, model, tokens, types, add_bos=bool(kv.get("tokenizer.ggml.add_bos_token", add_bos)),
                     bos_id=_id(kv, "tokenizer.ggml.bos_token_id", path, len(tokens)),
                     eos_id=_id(kv, "tokenizer.ggml.eos_token_id", path, len(tokens)),
                     eot_id=_id(kv, "tokenizer.ggml.eot_token_id", path, len(tokens), required=False),
                     unencodable=unencodable)


def _id(kv: Mapping, key: str, path: str, size: int, *, required: bool = True) -> int | None:
    value = kv.get(key)
    if value is None and not required:
        return None
    if value is None:
        raise ModelFileError(path, f"metadata key {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
        raise ModelFileError(path, f"{key} is {value!r}, not a token id of the vocabulary (0..{size - 1})")
    return value


def _bpe(kv: Mapping, path: str, tokens: list, types: list, vocab: dict) -> tuple[Tokenizer, bool]:
    pre_name = kv.get("tokenizer.ggml.pre", "default")  # llama.cpp: a missing key means 'default'
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ModelFileError(path, f"tokenizer.ggml.pre is {pre_name!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    if "tokenizer.ggml.merges" in kv:
        merges = [_merge(m, n, path) for n, m in enumerate(_list(kv, "tokenizer.ggml.merges", path))]
    elif all(len(t) == 1 for t, kind in zip(tokens, types) if kind == NORMAL):
        merges = []  # GGUF writers drop empty arrays: a vocabulary of single bytes has no merges key
    else:
        raise ModelFileError(path, "metadata key 'tokenizer.ggml.merges' is missing")
    tok = _bpe_model(path, vocab, merges, ignore_merges=pre.ignore_merges)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, pre.add_bos


def _spm(kv: Mapping, path: str, tokens: list, types: list, vocab: dict) -> tuple[Tokenizer, bool]:
    """SentencePiece: llama.cpp merges, in a fragment, the adjacent pair whose join is the best-scored
    token first; as BPE that is every split of a token into two tokens, ordered by the token's score
    (as transformers derives them). Characters not in the vocabulary fall back to <0xNN> byte pieces;
    spaces are "▁", and one is put before text that starts a fragment (add_space_prefix)."""
    scores = _list(kv, "tokenizer.ggml.scores", path)
    if len(scores) != len(tokens):
        raise ModelFileError(path, f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    unk = _id(kv, "tokenizer.ggml.unknown_token_id", path, len(tokens), required=False) or 0
    tok = _bpe_model(path, vocab, _merges_by_score(tokens, types, scores, vocab), unk_token=tokens[unk],
                     fuse_unk=True, byte_fallback=True)
    prefix = kv.get("tokenizer.ggml.add_space_prefix", True)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * bool(prefix) + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + [decoders.Strip(" ", 1, 0)] * bool(prefix))
    return tok, True  # llama.cpp adds BOS to SentencePiece vocabularies unless the file says not to


def _bpe_model(path: str, vocab: dict, merges: list, **options) -> Tokenizer:
    try:
        return Tokenizer(models.BPE(vocab, merges, **options))
    except Exception as exc:  # tokenizers raises a plain Exception, e.g. for a merge of unknown tokens
        raise ModelFileError(path, f"tokenizers cannot build this vocabulary: {exc}") from None


def _merges_by_score(tokens: list, types: list, scores: list, vocab: dict) -> list[tuple[str, str]]:
    found = []
    for piece, kind, score in zip(tokens, types, scores):
        if kind not in (NORMAL, USER_DEFINED) or len(piece) < 2:
            continue
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda lr: (scores[vocab[lr[0]]], scores[vocab[lr[1]]]), reverse=True)
        found.extend((score, pair) for pair in splits)
    found.sort(key=lambda sp: sp[0], reverse=True)  # stable: a token's own splits keep their order
    return [pair for _, pair in found]


def _list(kv: Mapping, key: str, path: str) -> list:
    value = kv.get(key)
    if not isinstance(value, list) or not value:
        raise ModelFileError(path, f"metadata key {key!r} is missing or not a list")
    return value


def _merge(text, n: int, path: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after the first character, so a merge may start with a space
    cut = text.find(" ", 1) if isinstance(text, str) else -1
    if cut < 0:
        raise ModelFileError(path, f"tokenizer.ggml.merges[{n}] is {text!r}, not two tokens separated by a space")
    return text[:cut], text[cut + 1:]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


def token_bytes(model: str, tokens: list, types: list) -> list[bytes]:
    """The bytes each id stands for: byte-level text mapped back (gpt2), or "▁" as a space and <0xNN> as
    its byte (SentencePiece); control and user-defined tokens as their text."""
    if model == "gpt2":
        back = {u: b for b, u in bytes_to_unicode().items()}
        return [t.encode() if kind in (CONTROL, USER_DEFINED) or any(c not in back for c in t)
                else bytes(back[c] for c in t) for t, kind in zip(tokens, types)]
    return [bytes([int(t[3:5], 16)]) if kind == BYTE else t.encode() if kind in (CONTROL, USER_DEFINED, UNKNOWN)
            else t.replace("▁", " ").encode() for t, kind in zip(tokens, types)]
