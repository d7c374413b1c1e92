"""A model's vocabulary as the serving side uses it: text to token ids and back, the ids' bytes and spellings,
and the figures a request is checked against (vocab_size, max_context, stop_ids). Stage 0 holds one for the API
and its actor, the last stage for answers' text and constrained decoding; a middle stage holds none.

Any thread may call it: the API's worker threads tokenize while the compute thread runs steps. The tokenizer is
read-only once loaded, but for the one setting an encode flips, which worker/tokens/tokenizer.py sets and
encodes under its own lock; longest_token_bytes is made once, and two threads making it at once make the same.
"""
from __future__ import annotations

import functools

from ..errors import WorkerError
from ..grammar import GrammarCompiler


def check_token_ids(tokens: list[int], vocab_size: int) -> None:
    """Raises WorkerError unless every id is one of a vocabulary of `vocab_size`'s."""
    bad = [t for t in tokens if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise WorkerError(f"token ids out of range 0..{vocab_size - 1}: {bad[:5]}")


class Vocabulary:
    """`tokenizer` (worker/tokens/tokenizer.py's, or the stub's) with the model's `vocab_size`, which may be
    larger than the tokenizer's (padding rows), and the context a request's positions must fit in."""

    def __init__(self, tokenizer, *, vocab_size: int, max_context: int):
        self.tokenizer = tokenizer
        self._vocab_size, self._max_context = vocab_size, max_context
        self._stop_ids = frozenset(tokenizer.stop_ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end an answer (end of turn, end of text)."""
        return self._stop_ids

    def tokenize(self, prompt: str, *, chat: bool = True, add_special_tokens: bool = True) -> list[int]:
        """One user turn through the chat template, or (not `chat`) a raw prompt: BOS first where the vocabulary
        adds one, unless not `add_special_tokens` (vLLM's /tokenize flag)."""
        if chat:
            return self.tokenizer.encode_chat(prompt)
        return self.tokenizer.encode_prompt(prompt) if add_special_tokens else self.tokenizer.encode(prompt)

    def tokenize_messages(self, messages: list[dict], *, add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> list[int]:
        """A conversation (system, user and assistant turns) through the model's chat template, ending where the
        assistant's reply starts unless not `add_generation_prompt`; `tools` go to a template that takes them."""
        return self.tokenizer.encode_messages(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    @property
    def chat_template(self) -> str | None:
        """The template conversations are rendered through (None: the stand-in's own turns)."""
        return getattr(self.tokenizer, "chat_template", None)

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes (so characters) one token stands for, control tokens' text included: a text of more
        characters than max_context times this cannot fit in the context. Made once, from the whole vocabulary."""
        return max((len(self.tokenizer.decode_bytes([i])) for i in range(self.vocab_size)), default=1)

    def check_tokens(self, tokens: list[int]) -> None:
        """Raises WorkerError unless every id is one of the vocabulary's."""
        check_token_ids(tokens, self.vocab_size)

    def token_strs(self, tokens: list[int]) -> list[str]:
        """Each token as the vocabulary spells it ("Ġhello", "▁the", "<|im_start|>"): vLLM's token_strs."""
        self.check_tokens(tokens)
        return self.tokenizer.token_strs(tokens)

    def prompt_text(self, tokens: list[int]) -> str:
        """The text `tokens` spell, control tokens included: what /tokenize made them from (vLLM's /detokenize)."""
        self.check_tokens(tokens)
        return self.tokenizer.decode(tokens, specials=True)

    def detokenize(self, tokens: list[int]) -> str:
        """An answer's text: control tokens left out."""
        self.check_tokens(tokens)
        return self.tokenizer.decode(tokens, specials=False)

    def token_bytes(self, tokens: list[int], *, specials: bool = False) -> bytes:
        """The raw bytes of `tokens`, for the entry to stream text as tokens come back, control tokens left out
        as detokenize does unless `specials`; a character split across tokens is completed by the caller."""
        self.check_tokens(tokens)
        return self.tokenizer.decode_bytes(tokens, specials=specials)

    def tokenizer_info(self) -> dict:
        """The vocabulary's special tokens and chat template, as vLLM's GET /tokenizer_info answers (lm-eval's
        remote tokenizer reads eos_token, bos_token, pad_token and chat_template)."""
        tok = self.tokenizer
        return {"tokenizer_class": type(tok).__name__, "bos_token": getattr(tok, "bos_token", None),
                "eos_token": getattr(tok, "eos_token", None), "pad_token": None,
                "chat_template": getattr(tok, "chat_template", None), "model_max_length": self.max_context}

    def grammar_compiler(self) -> GrammarCompiler:
        """A new compiler of constrained decoding's grammars over this vocabulary (worker/grammar.py); its cache
        of compiled grammars is its holder's (the last stage's compute thread)."""
        tok = self.tokenizer
        return GrammarCompiler([tok.decode_bytes([i]) for i in range(tok.vocab_size)], tok.stop_ids,
                               self.vocab_size, control_ids=getattr(tok, "control_ids", ()), encode=tok.encode)
