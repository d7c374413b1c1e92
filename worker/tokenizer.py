"""Llama 3 tokenizers (tiktoken byte-level BPE) built from GGUF metadata, tokenizer.json, or bytes.

Token ids are tiktoken merge ranks. A GGUF or Hugging Face vocabulary is accepted only when its
merges say the same thing as those ranks would (see check_merges), so that what we encode is what
llama.cpp or Hugging Face would encode for the same file.
"""
from __future__ import annotations

import json
import operator
import os
import re
from collections.abc import Iterable, Mapping, Sequence

import tiktoken

from . import chat
from .chat import LLAMA3_TEMPLATE
from .errors import ModelFileError

# Meta's pre-tokenizer regex, from llama_models/llama3/tokenizer.py.
PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
CHAT_SPECIALS = (BEGIN_OF_TEXT, START_HEADER, END_HEADER, EOT)
BYTE_SPECIALS = (BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER, END_HEADER, EOT)

# tiktoken panics on huge inputs and is quadratic in long runs; Meta cuts text the same way.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_RUNS = re.compile(r"\s+|\S+")  # re's \s is str.isspace, which Meta's cutter uses

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Added tokens: literal text, never produced from user text, decoded as their text.
LITERAL_TYPES = frozenset({CONTROL, USER_DEFINED, UNUSED})
# tokenizer.ggml.pre values whose pre-tokenizer is Llama 3's regex.
LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


# str.translate table taking a byte-level string to latin-1 (one char per byte). Characters that
# encode no byte become U+FFFD so that .encode("latin-1") refuses them.
_TO_LATIN1 = {c: "\ufffd" for c in range(256)} | {ord(u): chr(b) for b, u in bytes_to_unicode().items()}


class Tokenizer:
    """Encodes prompts and decodes generated ids; `path` is named in every error about the vocabulary."""

    def __init__(self, path, ranks: dict[bytes, int], specials: dict[str, int], *, bos_id: int, eos_id: int,
                 chat_template: str | None = None):
        self.path = str(path)
        self.chat_template = chat_template or LLAMA3_TEMPLATE  # the model's own, else Llama 3's
        self.mergeable_ranks, self.special_ids = ranks, dict(specials)
        self._bytes = self._decode_table(ranks, specials)
        self.vocab_size = len(self._bytes)
        missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
        if missing_bytes:
            raise ModelFileError(path, f"byte-level vocabulary lacks tokens for {len(missing_bytes)} single bytes "
                                       f"(first: 0x{missing_bytes[0]:02x})")
        for name in CHAT_SPECIALS:
            if name not in specials:
                raise ModelFileError(path, f"vocabulary lacks the Llama 3 special token {name}")
        for what, i in (("bos", bos_id), ("eos", eos_id)):
            if not 0 <= i < self.vocab_size:
                raise ModelFileError(path, f"{what} token id {i} is not in the vocabulary")
        self.bos_id, self.eos_id = bos_id, eos_id
        self.stop_ids = frozenset({eos_id} | {specials[n] for n in (EOT, END_OF_TEXT) if n in specials})
        self._encoding = tiktoken.Encoding(os.path.basename(self.path) or "tokenizer", pat_str=PAT_STR,
                                           mergeable_ranks=ranks, special_tokens=self.special_ids)
        self._specials_re = re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
        self.bos_token, self.eos_token = self._bytes[bos_id].decode(), self._bytes[eos_id].decode()

    def _decode_table(self, ranks: dict[bytes, int], specials: dict[str, int]) -> list[bytes]:
        """Bytes of each id; ids must be exactly 0..n-1, as in GGUF and Hugging Face vocabularies."""
        entries = [*ranks.items(), *((name.encode(), i) for name, i in specials.items())]
        table: list[bytes | None] = [None] * len(entries)
        for text, i in entries:
            if not 0 <= i < len(entries) or table[i] is not None:
                raise ModelFileError(self.path, f"token id {i} is repeated or out of range: "
                                                f"{len(entries)} tokens need ids 0..{len(entries) - 1}")
            table[i] = text
        return table

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """Ordinary text only: special-token strings in `text` are encoded as text, never as control ids."""
        ids = [self.bos_id] if bos else []
        for piece in split_long_runs(text):
            ids.extend(self._encoding.encode_ordinary(piece))
        return ids

    def encode_special(self, text: str) -> list[int]:
        """Text where special-token strings are those tokens (a rendered chat template), as transformers
        encodes the rendered template; nothing is added."""
        ids: list[int] = []
        for n, piece in enumerate(self._specials_re.split(text)):
            if n % 2:
                ids.append(self.special_ids[piece])
            elif piece:
                ids.extend(self.encode(piece))
        return ids

    def encode_messages(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """A conversation through the model's chat template, ending where the assistant's reply starts."""
        text = chat.render(self.chat_template, messages, bos_token=self.bos_token, eos_token=self.eos_token,
                           add_generation_prompt=add_generation_prompt)
        return self.encode_special(text)

    def encode_chat(self, prompt: str) -> list[int]:
        """One user message through the chat template."""
        return self.encode_messages([{"role": "user", "content": prompt}])

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of `ids` (specials as their text); for decoding UTF-8 incrementally."""
        return joined_bytes(self._bytes, ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def joined_bytes(table: Sequence[bytes], ids: Iterable[int]) -> bytes:
    """The bytes of each id in `table`, joined; an id outside it is a ValueError."""
    parts = []
    for token in ids:
        i = operator.index(token)
        if not 0 <= i < len(table):
            raise ValueError(f"token id {i} is not in the vocabulary (size {len(table)})")
        parts.append(table[i])
    return b"".join(parts)


def split_long_runs(text: str, max_chars: int = MAX_ENCODE_CHARS, max_run: int = MAX_RUN_CHARS) -> list[str]:
    """Cut `text` into chunks of at most max_chars, and every max_run chars into a run of only
    whitespace or only non-whitespace (as Meta's _split_whitespaces_or_nonwhitespaces does)."""
    pieces = []
    for start in range(0, len(text), max_chars):
        chunk, last = text[start:start + max_chars], 0
        for run in _RUNS.finditer(chunk):
            for cut in range(run.start() + max_run, run.end(), max_run):
                pieces.append(chunk[last:cut])
                last = cut
        pieces.append(chunk[last:])
    return pieces or [""]


def byte_tokenizer() -> Tokenizer:
    """The built-in tiny model's vocabulary: id = byte value, then the five Llama 3 specials."""
    specials = {name: 256 + n for n, name in enumerate(BYTE_SPECIALS)}
    return Tokenizer("<byte tokenizer>", {bytes([b]): b for b in range(256)}, specials,
                     bos_id=specials[BEGIN_OF_TEXT], eos_id=specials[END_OF_TEXT])


def token_bytes(path, text: str, token_id: int) -> bytes:
    """A byte-level BPE token string (GPT-2's printable alphabet) as the bytes it stands for."""
    try:
        return text.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        raise ModelFileError(path, f"token {token_id} {text!r} is not a byte-level BPE string") from None


def check_merges(path, vocab: Mapping[str, int], merges: Sequence[tuple[str, str]]) -> None:
    """Refuse merges that a tiktoken reading (id = merge rank) would tokenize differently.

    tiktoken merges any adjacent pair whose join is a token, lowest id first; llama.cpp and
    Hugging Face merge only listed pairs, earliest listed first. They agree when the list is sorted
    by the id of the token each merge makes and holds every split of a token into two tokens
    (Hugging Face's tiktoken converter writes exactly that; Llama 3 files are made that way).
    """
    last, pairs = -1, set()
    for n, (a, b) in enumerate(merges):
        made = vocab.get(a + b)
        if a not in vocab or b not in vocab or made is None:
            raise ModelFileError(path, f"merge {n} ({a!r} {b!r}) uses or makes a token not in the vocabulary")
        if made < last:
            raise ModelFileError(path, f"merge {n} ({a!r} {b!r}) makes token {made} after a merge made token "
                                       f"{last}: token ids are not merge ranks, which this tokenizer needs")
        last = made
        pairs.add((a, b))
    splits = _count_splits(vocab)
    if len(pairs) != splits:
        raise ModelFileError(path, f"merges list {len(pairs)} distinct pairs but the vocabulary has {splits} "
                                   f"splits of a token into two tokens; each must be a merge for ids to be ranks")


def _count_splits(vocab: Mapping[str, int]) -> int:
    """How many (a, b) pairs of tokens join into a token."""
    count = 0
    for t in vocab:
        for i in range(1, len(t)):
            if t[:i] in vocab and t[i:] in vocab:
                count += 1
    return count


def ranks_from_bpe(path, vocab: Mapping[str, int], merges: Sequence[tuple[str, str]]) -> dict[bytes, int]:
    """tiktoken ranks from a byte-level BPE vocabulary (string -> id) and its merges."""
    ranks = {token_bytes(path, text, i): i for text, i in vocab.items()}
    if b"" in ranks:
        raise ModelFileError(path, f"token {ranks[b'']} is empty")
    check_merges(path, vocab, merges)
    return ranks


def tokenizer_from_gguf_metadata(kv: Mapping, path):
    """The tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata (llama.cpp's layout): Llama 3's
    through tiktoken here; every other vocabulary (SentencePiece, SmolLM's and GPT-2's splitting) through
    Hugging Face tokenizers (worker/hf_tokenizers.py), which refuses what llama.cpp would not read."""
    model = _required(kv, "tokenizer.ggml.model", path)
    pre = kv.get("tokenizer.ggml.pre")
    if model != "gpt2" or (pre is not None and pre not in LLAMA3_PRE):
        from .hf_tokenizers import gguf_tokenizer
        return gguf_tokenizer(path, kv)
    tokens = _required_list(kv, "tokenizer.ggml.tokens", path)
    types = _required_list(kv, "tokenizer.ggml.token_type", path)
    if len(types) != len(tokens):
        raise ModelFileError(path, f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    specials: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        table = vocab if kind == NORMAL else specials if kind in LITERAL_TYPES else None
        if table is None:
            raise ModelFileError(path, f"token {i} {text!r} has type {kind!r}, which byte-level BPE does not use")
        if not isinstance(text, str):
            raise ModelFileError(path, f"tokenizer.ggml.tokens[{i}] is {text!r}, not a string")
        if table.setdefault(text, i) != i:
            raise ModelFileError(path, f"token {i} {text!r} repeats token {table[text]}")
    # GGUF writers drop empty arrays, so a vocabulary of single bytes has no merges key.
    single_bytes = "tokenizer.ggml.merges" not in kv and all(len(t) == 1 for t in vocab)
    merges = [] if single_bytes else [merge_pair(path, "tokenizer.ggml.merges", n, m)
                                      for n, m in enumerate(_required_list(kv, "tokenizer.ggml.merges", path))]
    return Tokenizer(path, ranks_from_bpe(path, vocab, merges), specials,
                     bos_id=_required_id(kv, "tokenizer.ggml.bos_token_id", path),
                     eos_id=_required_id(kv, "tokenizer.ggml.eos_token_id", path),
                     chat_template=_optional_text(kv, "tokenizer.chat_template", path))


def _optional_text(kv: Mapping, key: str, path) -> str | None:
    value = kv.get(key)
    if value is not None and not isinstance(value, str):
        raise ModelFileError(path, f"metadata key {key!r} is {type(value).__name__}, want text")
    return value


def _required(kv: Mapping, key: str, path):
    if key not in kv:
        raise ModelFileError(path, f"metadata key {key!r} is missing")
    return kv[key]


def _required_list(kv: Mapping, key: str, path) -> list | tuple:
    value = _required(kv, key, path)
    if not isinstance(value, (list, tuple)):
        raise ModelFileError(path, f"metadata key {key!r} is a {type(value).__name__}, want an array")
    return value


def _required_id(kv: Mapping, key: str, path) -> int:
    value = _required(kv, key, path)
    if not _is_int(value):
        raise ModelFileError(path, f"metadata key {key!r} is {value!r}, want a token id")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def merge_pair(path, field: str, n: int, merge) -> tuple[str, str]:
    """One merge, written "a b" (GGUF, older tokenizer.json) or ["a", "b"] (newer tokenizer.json)."""
    pair = merge.split(" ") if isinstance(merge, str) else merge
    if isinstance(pair, (list, tuple)) and len(pair) == 2:
        a, b = pair
        if isinstance(a, str) and isinstance(b, str) and a and b:
            return a, b
    raise ModelFileError(path, f"{field}[{n}] is {merge!r}, not a pair of tokens")


def chat_template_from_config(directory) -> str | None:
    """A Hugging Face model directory's chat template: `chat_template.jinja`, else `chat_template` in
    tokenizer_config.json (a string, or a list of named templates of which "default" is taken)."""
    from pathlib import Path
    directory = Path(directory)
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = _read_json(config_file).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(config_file, "chat_template is neither text nor a list of named templates")
    return template


def tokenizer_from_json(path, *, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer in a Hugging Face `tokenizer.json` (byte-level BPE with Llama 3's pre-tokenizer).

    Every added token, special or not, is literal: user text never turns into it, and it decodes
    as its text. BOS and EOS are found by name, as tokenizer.json does not declare them.
    """
    doc = _read_json(path)
    model = _json_field(path, doc, "model", dict)
    if model.get("type") != "BPE":
        raise ModelFileError(path, f"model.type is {model.get('type')!r}; only 'BPE' is supported")
    if doc.get("normalizer") is not None or _splitters(doc.get("pre_tokenizer")) != [PAT_STR]:
        from .hf_tokenizers import json_tokenizer  # not Llama 3's shape: Hugging Face tokenizers, as it is
        return json_tokenizer(path, chat_template)
    vocab = dict(_json_field(path, model, "vocab", dict, "model.vocab"))
    raw_merges = _json_field(path, model, "merges", list, "model.merges")
    added = _json_field(path, doc, "added_tokens", list)
    _check_pre_tokenizer(path, doc)
    for text, i in vocab.items():
        if not _is_int(i):
            raise ModelFileError(path, f"model.vocab[{text!r}] is {i!r}, not a token id")
    specials: dict[str, int] = {}
    for n, entry in enumerate(added):
        text, i = (entry.get("content"), entry.get("id")) if isinstance(entry, dict) else (None, None)
        if not isinstance(text, str) or not _is_int(i):
            raise ModelFileError(path, f"added_tokens[{n}] is {entry!r}, want content and id")
        if specials.setdefault(text, i) != i:
            raise ModelFileError(path, f"added_tokens[{n}] {text!r} repeats id {specials[text]}")
        if vocab.get(text) == i:  # some files also list added tokens in the BPE vocab
            del vocab[text]
    merges = [merge_pair(path, "model.merges", n, m) for n, m in enumerate(raw_merges)]
    ranks = ranks_from_bpe(path, vocab, merges)
    eos = specials.get(END_OF_TEXT, specials.get(EOT))
    if BEGIN_OF_TEXT not in specials or eos is None:
        raise ModelFileError(path, f"added_tokens lacks {BEGIN_OF_TEXT} or both {END_OF_TEXT} and {EOT}")
    return Tokenizer(path, ranks, specials, bos_id=specials[BEGIN_OF_TEXT], eos_id=eos, chat_template=chat_template)


def _read_json(path) -> dict:
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except OSError as e:
        raise ModelFileError(path, f"cannot read tokenizer: {e.strerror or e}") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ModelFileError(path, f"tokenizer is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ModelFileError(path, "tokenizer JSON is not an object")
    return doc


def _json_field(path, parent: dict, key: str, kind: type, name: str | None = None):
    value = parent.get(key)
    if not isinstance(value, kind):
        want = "an object" if kind is dict else "a list"
        raise ModelFileError(path, f"field {name or key!r} is {'missing' if value is None else 'not ' + want}")
    return value


def _check_pre_tokenizer(path, doc: dict) -> None:
    """Refuse text splitting other than Llama 3's: it would silently change every encoding."""
    if doc.get("normalizer") is not None:
        raise ModelFileError(path, f"normalizer {doc['normalizer']!r} is not supported (Llama 3 has none)")
    splits = _splitters(doc.get("pre_tokenizer"))
    if splits != [PAT_STR]:
        raise ModelFileError(path, f"pre_tokenizer splits text by {splits!r}, not Llama 3's regex")


def _splitters(node) -> list:
    """What each pre-tokenizer step splits text by; ByteLevel without its regex only maps bytes."""
    if node is None:
        return []
    kind = node.get("type") if isinstance(node, dict) else node
    if kind == "Sequence":
        return [s for sub in node.get("pretokenizers") or [] for s in _splitters(sub)]
    if kind == "Split":
        return [(node.get("pattern") or {}).get("Regex", node.get("pattern"))]
    if kind == "ByteLevel" and node.get("use_regex") is False:
        return []
    return [kind if kind != "ByteLevel" else "ByteLevel's GPT-2 regex"]
