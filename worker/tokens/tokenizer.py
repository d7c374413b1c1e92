"""The tokenizer a stage uses: prompts and conversations to ids, generated ids back to bytes.

Every vocabulary goes through Hugging Face `tokenizers`: a GGUF file's as llama.cpp reads it
(worker/tokens/gguf_vocab.py), a Hugging Face directory's tokenizer.json as it is, and the tiny model's bytes.
"""
from __future__ import annotations

import operator
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from . import chat
from .chat import LLAMA3_TEMPLATE
from ..errors import ModelFileError, WorkerError
from .gguf_vocab import (BYTE, CONTROL, LLAMA3_REGEX, NORMAL, USER_DEFINED, bytes_to_unicode, token_bytes,
                         vocab_from_gguf)
from ..files import read_json

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
LLAMA3_CHAT_SPECIALS = (BEGIN_OF_TEXT, START_HEADER, END_HEADER, EOT)
BYTE_SPECIALS = (BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER, END_HEADER, EOT)
# llama.cpp's end-of-generation texts: a special token spelled so stops generation too (llama-vocab.cpp)
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                       "<EOT>", "<|end_of_text|>", "</s>"})
# A conversation as plain text, for a vocabulary with neither a template of its own nor Llama 3's specials
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


class Tokenizer:
    """Encodes prompts and conversations, decodes ids to bytes; `path` is named in every error about it."""

    def __init__(self, path: str, tok: HFTokenizer, token_bytes: list[bytes], *, special_ids: dict[str, int],
                 bos_id: int, eos_id: int, stop_ids: Iterable[int], add_bos: bool, chat_template: str | None,
                 unencodable: frozenset[int] = frozenset(), control_ids: Iterable[int] | None = None):
        self.path, self._tok, self._bytes = path, tok, token_bytes
        self._encoding = threading.Lock()  # encode_special_tokens is the shared tokenizer's: set and encode as one
        # control tokens (<|im_start|>, <|eot_id|>, ...): the text of an answer leaves them out, as vLLM's
        # skip_special_tokens does by default; all of special_ids unless the vocabulary tells them apart
        self.control_ids = frozenset(special_ids.values() if control_ids is None else control_ids)
        self._unencodable = unencodable  # bytes no token stands for: text holding one is refused (_encode)
        self.vocab_size = len(token_bytes)
        self.special_ids, self.bos_id, self.eos_id = special_ids, bos_id, eos_id
        self.stop_ids = frozenset({eos_id, *stop_ids} | {i for t, i in special_ids.items() if t in EOG_TEXTS})
        self._add_bos = add_bos
        self.bos_token = token_bytes[bos_id].decode(errors="replace")
        self.eos_token = token_bytes[eos_id].decode(errors="replace")
        llama3 = all(name in special_ids for name in LLAMA3_CHAT_SPECIALS)
        self.chat_template = chat_template or (LLAMA3_TEMPLATE if llama3 else PLAIN_TEMPLATE)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """Ordinary text only: special-token strings in `text` are encoded as text, never as their ids."""
        return [self.bos_id] * bos + self._encode(text, specials=False)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt (no chat template) as llama.cpp and transformers take it: BOS first where the
        vocabulary adds one (SmolLM2's does not), then the text as ordinary text."""
        return self.encode(text, bos=self._add_bos)

    def encode_special(self, text: str) -> list[int]:
        """Text where special-token strings are those tokens (a rendered chat template); nothing added."""
        return self._encode(text, specials=True)

    def _encode(self, text: str, *, specials: bool) -> list[int]:
        if self._unencodable and (bad := self._unencodable.intersection(text.encode("utf-8", "surrogatepass"))):
            # tokenizers and llama.cpp would drop the character silently: the model would see other text
            raise WorkerError(f"the text holds a character with byte 0x{min(bad):02x}, for which the model's "
                              f"vocabulary has no token")
        # llama.cpp's parse_special: added (control) tokens are matched only where specials may appear
        with self._encoding:  # prompts are tokenized in worker threads (node/api/openai_api.py)
            self._tok.encode_special_tokens = not specials
            return self._tok.encode(text, add_special_tokens=False).ids

    def encode_messages(self, messages: list[dict], *, add_generation_prompt: bool = True,
                        tools: list[dict] | None = None) -> list[int]:
        """A conversation through the model's chat template, ending where the assistant's reply starts; `tools`
        (function definitions) go to the template as transformers passes them: None where there are none."""
        text = chat.render(self.chat_template, messages, bos_token=self.bos_token, eos_token=self.eos_token,
                           add_generation_prompt=add_generation_prompt, tools=tools)
        ids = self.encode_special(text)
        if self._add_bos and ids[:1] != [self.bos_id]:  # as llama.cpp: BOS unless the template wrote it
            ids = [self.bos_id, *ids]
        return ids

    def encode_chat(self, prompt: str) -> list[int]:
        """One user message through the chat template."""
        return self.encode_messages([{"role": "user", "content": prompt}])

    def decode_bytes(self, ids: Iterable[int], *, specials: bool = True) -> bytes:
        """The raw bytes of `ids` (control tokens as their text, or left out with specials=False); for
        decoding UTF-8 incrementally. An id outside the vocabulary is a ValueError."""
        parts = []
        for token in ids:
            i = operator.index(token)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is not in the vocabulary (size {self.vocab_size})")
            if specials or i not in self.control_ids:
                parts.append(self._bytes[i])
        return b"".join(parts)

    def decode(self, ids: Iterable[int], *, specials: bool = True) -> str:
        return self.decode_bytes(ids, specials=specials).decode("utf-8", errors="replace")

    def token_strs(self, ids: Iterable[int]) -> list[str]:
        """Each id as the vocabulary spells it (transformers' convert_ids_to_tokens); an id the tokenizers
        vocabulary lacks, as its bytes."""
        return [self._tok.id_to_token(i) or self._bytes[i].decode(errors="replace") for i in ids]


def tokenizer_from_gguf_metadata(kv: Mapping, path) -> Tokenizer:
    """A GGUF file's tokenizer (`tokenizer.ggml.*`, read as llama.cpp reads it): stop ids are eos, eot and
    the specials spelled as llama.cpp's end-of-generation texts; chat through `tokenizer.chat_template`."""
    path = str(path)
    vocab = vocab_from_gguf(kv, path)
    template = kv.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(path, f"metadata key 'tokenizer.chat_template' is {type(template).__name__}, want text")
    specials = {t: i for i, (t, kind) in enumerate(zip(vocab.tokens, vocab.types)) if kind in (CONTROL, USER_DEFINED)}
    return Tokenizer(path, vocab.tokenizer, token_bytes(vocab.model, vocab.tokens, vocab.types),
                     special_ids=specials, bos_id=vocab.bos_id, eos_id=vocab.eos_id,
                     stop_ids={vocab.eot_id} - {None}, add_bos=vocab.add_bos, chat_template=template,
                     unencodable=vocab.unencodable,
                     control_ids={i for i, kind in enumerate(vocab.types) if kind == CONTROL})


def tokenizer_from_json(path, *, chat_template: str | None = None) -> Tokenizer:
    """A Hugging Face `tokenizer.json` used as it is. tokenizer_config.json beside it names BOS and EOS
    (where it does not, Llama 3's names are looked for); config.json / generation_config.json add stop ids
    (`eos_token_id`, one or a list). BOS is added where the file's own post-processor would add it, unless
    tokenizer_config.json's add_bos_token says."""
    directory, path = Path(path).parent, str(path)
    try:
        tok = HFTokenizer.from_str(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFileError(path, f"cannot read tokenizer: {exc}") from None
    except Exception as exc:  # tokenizers raises plain Exceptions for malformed files
        raise ModelFileError(path, f"tokenizers cannot read it: {exc}") from None
    config = read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").is_file() else {}
    vocab = tok.get_vocab(with_added_tokens=True)
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    # what tokenizer_config.json does not name, Llama 3's files name by convention
    bos = _config_token(config, "bos_token", vocab, special.get(BEGIN_OF_TEXT))
    eos = _config_token(config, "eos_token", vocab, special.get(END_OF_TEXT, special.get(EOT)))
    if bos is None or eos is None:
        raise ModelFileError(path, "needs BOS and EOS named by a tokenizer_config.json beside it (bos_token, "
                                   "eos_token), each a token of the vocabulary")
    eos_ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        value = read_json(directory / name).get("eos_token_id") if (directory / name).is_file() else None
        eos_ids |= {i for i in (value if isinstance(value, list) else [value]) if _is_id(i)}
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = tok.encode("a", add_special_tokens=True).ids[:1] == [bos]
    return Tokenizer(path, tok, _json_token_bytes(vocab, special), special_ids=special, bos_id=bos, eos_id=eos,
                     stop_ids=eos_ids, add_bos=add_bos, chat_template=chat_template)


def _config_token(config: dict, key: str, vocab: dict, default: int | None) -> int | None:
    """tokenizer_config.json names a token as its text or as {"content": text, ...}."""
    if config.get(key) is None:
        return default
    value = config[key]
    text = value.get("content") if isinstance(value, dict) else value
    return vocab.get(text) if isinstance(text, str) else None


def _json_token_bytes(vocab: dict[str, int], special: dict[str, int]) -> list[bytes]:
    texts = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        texts[i] = text
    byte_level = "Ġ" in vocab or "ĠĠ" in vocab or "<0x00>" not in vocab
    types = [CONTROL if t in special else BYTE if not byte_level and t.startswith("<0x") and len(t) == 6 else NORMAL
             for t in texts]
    return token_bytes("gpt2" if byte_level else "llama", texts, types)


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def byte_tokenizer() -> Tokenizer:
    """The built-in tiny model's vocabulary: id = byte value, then the five Llama 3 specials."""
    chars = bytes_to_unicode()
    specials = {name: 256 + n for n, name in enumerate(BYTE_SPECIALS)}
    tok = HFTokenizer(models.BPE({chars[b]: b for b in range(256)}, []))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    return Tokenizer("<byte tokenizer>", tok, [bytes([b]) for b in range(256)] + [n.encode() for n in specials],
                     special_ids=specials, bos_id=specials[BEGIN_OF_TEXT], eos_id=specials[END_OF_TEXT],
                     stop_ids=(), add_bos=False, chat_template=None)


def chat_template_from_config(directory) -> str | None:
    """A Hugging Face model directory's chat template: `chat_template.jinja`, else `chat_template` in
    tokenizer_config.json (a string, or a list of named templates of which "default" is taken)."""
    directory = Path(directory)
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    template = read_json(config_file).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ModelFileError(config_file, "chat_template is neither text nor a list of named templates")
    return template
