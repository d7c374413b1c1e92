"""A GGUF file's vocabulary as a Hugging Face `tokenizers.Tokenizer`, built the way llama.cpp reads it.

Not transformers' GGUF conversion: that ignores `tokenizer.ggml.pre` (it splits every byte-level BPE by
GPT-2's regex) and the BOS settings (../shared/notes/tokenizers-and-models.md). Here:
- `tokenizer.ggml.model` "gpt2": byte-level BPE over tokens + merges; the splitting regexes are chosen by
  `tokenizer.ggml.pre` exactly as llama.cpp's llm_tokenizer_bpe chooses them (src/llama-vocab.cpp), each
  regex re-splitting the pieces of the one before; Llama 3's pre-tokenizer also takes a whole piece that
  is in the vocabulary as one token (llama.cpp's ignore_merges).
- "llama": SentencePiece (tokens, scores, token types, <0xNN> byte fallback, "▁" for spaces), see _spm.
- Control and user-defined tokens are added tokens, matched only in text that may hold special tokens
  (llama.cpp's parse_special; see `encode`).
Anything else is refused, naming the file and the value.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .errors import ModelFileError
from .hf import read_json
from .tokenizer import bytes_to_unicode, joined_bytes

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@attrs.frozen
class _Pre:
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file does not say


_LLAMA3_PRE = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
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
    tokens: list[str]
    types: list[int]
    add_bos: bool
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None


def vocab_from_gguf(kv: Mapping, path) -> GGUFVocab:
    path = str(path)
    model = kv.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ModelFileError(path, f"tokenizer.ggml.model is {model!r}; supported: 'gpt2', 'llama'")
    tokens, types = _list(kv, "tokenizer.ggml.tokens", path), kv.get("tokenizer.ggml.token_type")
    types = types if types is not None else [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFileError(path, f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {text: i for i, text in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelFileError(path, "tokenizer.ggml.tokens repeats a token")
    tok, add_bos = (_bpe if model == "gpt2" else _spm)(kv, path, tokens, types, vocab)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)])
    return GGUFVocab(tok, tokens, types, add_bos=bool(kv.get("tokenizer.ggml.add_bos_token", add_bos)),
                     bos_id=kv.get("tokenizer.ggml.bos_token_id"), eos_id=kv.get("tokenizer.ggml.eos_token_id"),
                     eot_id=kv.get("tokenizer.ggml.eot_token_id"))


def _bpe(kv: Mapping, path: str, tokens: list, types: list, vocab: dict) -> tuple[Tokenizer, bool]:
    pre_name = kv.get("tokenizer.ggml.pre", "default")  # llama.cpp: a missing key means 'default'
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ModelFileError(path, f"tokenizer.ggml.pre is {pre_name!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    merges = [_merge(m, n, path) for n, m in enumerate(kv.get("tokenizer.ggml.merges", []))]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
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
    unk = kv.get("tokenizer.ggml.unknown_token_id", 0)
    tok = Tokenizer(models.BPE(vocab, _merges_by_score(tokens, types, scores, vocab), unk_token=tokens[unk],
                               fuse_unk=True, byte_fallback=True))
    prefix = kv.get("tokenizer.ggml.add_space_prefix", True)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * bool(prefix) + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + [decoders.Strip(" ", 1, 0)] * bool(prefix))
    return tok, True  # llama.cpp adds BOS to SentencePiece vocabularies unless the file says not to


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


# llama.cpp's end-of-generation texts: a token spelled so stops generation too (llama-vocab.cpp)
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                       "<EOT>", "<|end_of_text|>", "</s>"})
# A conversation as plain text, for a vocabulary without a template of its own (nor Llama 3's specials)
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


class HFTokenizer:
    """worker.tokenizer.Tokenizer's interface over a Hugging Face `tokenizers.Tokenizer` (made by
    gguf_tokenizer or json_tokenizer)."""

    def __init__(self, path: str, tok: Tokenizer, token_bytes: list[bytes], *, special_ids: dict[str, int],
                 bos_id: int, eos_id: int, stop_ids: frozenset[int], add_bos: bool, chat_template: str | None):
        self.path, self._tok, self._bytes = path, tok, token_bytes
        self.vocab_size = len(token_bytes)
        for what, i in (("bos", bos_id), ("eos", eos_id)):
            if not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ModelFileError(path, f"{what} token id {i!r} is not in the vocabulary")
        self.special_ids, self.bos_id, self.eos_id, self.stop_ids = special_ids, bos_id, eos_id, stop_ids
        self._add_bos = add_bos
        self.bos_token, self.eos_token = token_bytes[bos_id].decode(errors="replace"), token_bytes[eos_id].decode(errors="replace")
        self.chat_template = chat_template or PLAIN_TEMPLATE

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """Ordinary text only: special-token strings in `text` are encoded as text."""
        return [self.bos_id] * bos + self._encode(text, specials=False)

    def encode_special(self, text: str) -> list[int]:
        """Text where special-token strings are those tokens (a rendered chat template)."""
        return self._encode(text, specials=True)

    def _encode(self, text: str, *, specials: bool) -> list[int]:
        # llama.cpp's parse_special: added (control) tokens are matched only where specials may appear
        self._tok.encode_special_tokens = not specials
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_messages(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        from . import chat
        text = chat.render(self.chat_template, messages, bos_token=self.bos_token, eos_token=self.eos_token,
                           add_generation_prompt=add_generation_prompt)
        ids = self.encode_special(text)
        if self._add_bos and ids[:1] != [self.bos_id]:  # as llama.cpp: BOS unless the template wrote it
            ids = [self.bos_id, *ids]
        return ids

    def encode_chat(self, prompt: str) -> list[int]:
        return self.encode_messages([{"role": "user", "content": prompt}])

    def decode_bytes(self, ids) -> bytes:
        return joined_bytes(self._bytes, ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def gguf_tokenizer(path, kv: Mapping) -> HFTokenizer:
    """A GGUF file's tokenizer: stop ids are eos, eot and the tokens spelled as llama.cpp's end-of-generation
    texts; chat through `tokenizer.chat_template`, else a plain one."""
    path = str(path)
    vocab = vocab_from_gguf(kv, path)
    tokens, types = vocab.tokens, vocab.types
    specials = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)}
    template = kv.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(path, f"metadata key 'tokenizer.chat_template' is {type(template).__name__}, want text")
    stops = {vocab.eos_id, vocab.eot_id} - {None} | {i for t, i in specials.items() if t in EOG_TEXTS}
    return HFTokenizer(path, vocab.tokenizer, _token_bytes(kv["tokenizer.ggml.model"], tokens, types),
                       special_ids=specials, bos_id=vocab.bos_id, eos_id=vocab.eos_id, stop_ids=frozenset(stops),
                       add_bos=vocab.add_bos, chat_template=template)


def json_tokenizer(path, chat_template: str | None) -> HFTokenizer:
    """A Hugging Face `tokenizer.json` used as it is. tokenizer_config.json beside it names BOS and EOS;
    config.json / generation_config.json add stop ids (`eos_token_id`, one or a list). BOS is added where
    the file's own post-processor would add it, unless tokenizer_config.json's add_bos_token says."""
    directory, path = Path(path).parent, str(path)
    if not (directory / "tokenizer_config.json").is_file():
        raise ModelFileError(path, "is not Llama 3's tokenizer and has no tokenizer_config.json beside it to name "
                                   "its BOS and EOS tokens")
    config = read_json(directory / "tokenizer_config.json")
    bos, eos, add_bos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token")), config.get("add_bos_token")
    eos_ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        value = read_json(directory / name).get("eos_token_id") if (directory / name).is_file() else None
        eos_ids |= {i for i in (value if isinstance(value, list) else [value]) if _is_id(i)}
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises plain Exceptions for unreadable or malformed files
        raise ModelFileError(path, f"tokenizers cannot read it: {exc}") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    texts = [""] * size
    for text, i in vocab.items():
        texts[i] = text
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    byte_level = "Ġ" in vocab or "ĠĠ" in vocab or "<0x00>" not in vocab
    types = [CONTROL if t in special else BYTE if not byte_level and t.startswith("<0x") and len(t) == 6 else NORMAL
             for t in texts]
    token_bytes = _token_bytes("gpt2" if byte_level else "llama", texts, types)
    bos_id = vocab.get(bos) if bos else None
    eos_id = vocab.get(eos) if eos else min(eos_ids, default=None)
    if bos_id is None or eos_id is None:
        raise ModelFileError(path, f"tokenizer_config.json's bos_token {bos!r} and eos_token {eos!r} must both "
                                   f"be tokens of the vocabulary")
    if not isinstance(add_bos, bool):
        add_bos = tok.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
    return HFTokenizer(path, tok, token_bytes, special_ids=special, bos_id=bos_id, eos_id=eos_id,
                       stop_ids=frozenset(eos_ids | {eos_id}), add_bos=add_bos, chat_template=chat_template)


def _token_text(value) -> str | None:
    """tokenizer_config.json names a token as its text or as {"content": text, ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_bytes(model: str, tokens: list, types: list) -> list[bytes]:
    """The bytes each id stands for: byte-level text mapped back (gpt2), or "▁" as a space and <0xNN> as
    its byte (SentencePiece); control and user-defined tokens as their text."""
    if model == "gpt2":
        back = {u: b for b, u in bytes_to_unicode().items()}
        return [t.encode() if kind in (CONTROL, USER_DEFINED) or any(c not in back for c in t)
                else bytes(back[c] for c in t) for t, kind in zip(tokens, types)]
    return [bytes([int(t[3:5], 16)]) if kind == BYTE else t.encode() if kind in (CONTROL, USER_DEFINED, UNKNOWN)
            else t.replace("▁", " ").encode() for t, kind in zip(tokens, types)]
