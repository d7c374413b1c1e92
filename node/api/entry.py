"""What the serving surface (the OpenAI API, /tokenize, the chat page, the pipeline view) needs of the entry
stage, and all it may use of it: node/entry.py's EntryStage has these members (structurally: nothing here
imports it). The checks a request must pass are not here: the actor admits or refuses it (roles/first.py), and the
worker checks what it computes (worker/stage.py)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from roles.messages import InferenceRequest
from worker.plan import Split

from node.membership.gossip import Member


class Vocabulary(Protocol):
    """The model's vocabulary as the API uses it (worker/tokens/vocabulary.py's): its figures, and text to tokens
    and back, safe from any thread. Tokenizing is slow for a long text: the API calls it in a worker thread."""

    @property
    def max_context(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def stop_ids(self) -> frozenset[int]: ...
    @property
    def longest_token_bytes(self) -> int: ...
    def tokenize(self, prompt: str, *, chat: bool = True, add_special_tokens: bool = True) -> list[int]: ...
    def tokenize_messages(self, messages: list[dict], *, add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> list[int]: ...
    @property
    def chat_template(self) -> str | None: ...
    def token_bytes(self, tokens: list[int], *, specials: bool = False) -> bytes: ...
    def token_strs(self, tokens: list[int]) -> list[str]: ...  # as the vocabulary spells each (/tokenize)
    def prompt_text(self, tokens: list[int]) -> str: ...  # control tokens included (/detokenize)
    def tokenizer_info(self) -> dict: ...  # special tokens and chat template (/tokenizer_info)


class Inbox(Protocol):
    """One API request's events (node/follow.py's): each of its engine requests' roles.actions.Progress, then
    the last stage's InferenceResponse, read with `async for` until every request is closed. It holds a few
    events a request: an asker that reads no further holds its requests' rows, so nothing piles up for it."""

    def __aiter__(self) -> AsyncIterator: ...


class Members(Protocol):
    """The membership view (node/membership/swim.py) the pipeline view shows."""

    def members(self) -> Mapping[str, Member]: ...
    def resolve(self, name: str) -> Member | None: ...


class Entry(Protocol):
    @property
    def loading(self) -> bool:
        """Still loading: every request is refused with node/transport/app.py's still_loading()."""
    @property
    def vocabulary(self) -> Vocabulary | None:
        """Text to tokens and back; None while loading."""
    @property
    def max_seqs(self) -> int | None:
        """The entry stage's sequence slots: no request asks for more choices (`n`) at once; None while loading."""
    @property
    def url(self) -> str | None:
        """The advertised address: the API's requests name it as their reply_to."""
    @property
    def split(self) -> Split | None:
        """Each stage's block count, how they were chosen and why (worker.plan.Split); None while loading."""
    @property
    def swim(self) -> Members | None:
        """None until membership runs."""
    @property
    def last_answer(self) -> dict:
        """Figures of the last answer followed here (tokens, compute per stage per token, decode speed)."""

    def health(self) -> dict:
        """The stage's /health figures; the actor's `admitting`, `slots` and `queue` among them."""

    def open_local(self, request: InferenceRequest, into: Inbox | None = None) -> Inbox:
        """Admit a request and follow it into `into`, or a new inbox (several requests may share one); returns
        the inbox. Raises roles.actions.Refused (its `code` says why, where it is the prompt's fault)."""

    def close_local(self, request_id: str, *, cancel: bool) -> None:
        """Stop following a request; with `cancel`, also end it and free its slots."""
