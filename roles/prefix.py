"""Prefix matching for the prefix cache (issue 27), a pure decision with no I/O: which cached sequence a new
prompt can start from, and from which position.

Stage 0 owns the index. A prompt is cut into blocks of `block_size` tokens, and each whole block is named
by a hash chain, as vLLM names its KV blocks: a block's key is the hash of its parent's key and its own
tokens, so equal keys mean equal prefixes, not only equal blocks. An entry is a sequence whose KV some
stage kept (a finished request's slot, say), known by its id and its block keys.

`match` gives the entry that shares the most whole blocks with a prompt, and the tokens they cover. It never
covers the whole prompt: the last prompt token must be computed, since its row gives the first token's
logits. Entries are reference-counted while requests start from them, and `evictable` names the least
recently used one that no request holds; evicting is the caller's (each stage frees the KV it kept).

`plan_start` is stage 0's decision for a request that is to start: which entry it starts from, whether it
takes that entry's slot or copies its rows into a free one, which entry to evict to make room, or that no
slot can be had yet. Entries and requests share the sequence slots: an entry is a slot no request holds.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import attrs

DEFAULT_BLOCK_SIZE = 16


def block_keys(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, salt: str = "") -> list[bytes]:
    """The hash-chain key of each whole block of `token_ids` (a trailing partial block has none). A `salt`
    (vLLM's cache_salt) starts the chain elsewhere: only requests with the same salt share blocks."""
    if block_size < 1:
        raise ValueError(f"block_size: {block_size} is less than 1")
    keys = []
    parent = hashlib.blake2b(b"salt:" + salt.encode(), digest_size=16).digest() if salt else b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(int(t).to_bytes(4, "little") for t in block))
        parent = digest.digest()
        keys.append(parent)
    return keys


@attrs.frozen
class Match:
    entry: str | None  # the cached sequence to start from; None: a full prefill
    tokens: int = 0  # prompt tokens it covers: the request computes from this position on


NO_MATCH = Match(None)


@attrs.define
class _Entry:
    keys: tuple[bytes, ...]
    used: int  # when it was last added or matched: the index's own tick
    holders: int = 0


class PrefixIndex:
    """Cached sequences by their block keys; least recently used first."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        self.block_size = block_size
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._by_key: dict[bytes, set[str]] = {}  # each block key, to the entries that hold it
        self._tick = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry: str) -> bool:
        return entry in self._entries

    def add(self, entry: str, token_ids: Sequence[int], salt: str = "") -> None:
        """Index a sequence whose KV is kept for its whole blocks; re-adding an entry replaces it."""
        self.remove(entry)
        keys = tuple(block_keys(token_ids, self.block_size, salt))
        self._entries[entry] = _Entry(keys, self._next())
        for key in keys:
            self._by_key.setdefault(key, set()).add(entry)

    def remove(self, entry: str) -> None:
        """Forget an entry (evicted, or a stage that held it lost it); forgetting an unknown one is a no-op."""
        old = self._entries.pop(entry, None)
        for key in old.keys if old else ():
            holders = self._by_key[key]
            holders.discard(entry)
            if not holders:
                del self._by_key[key]

    def match(self, token_ids: Sequence[int], salt: str = "") -> Match:
        """The entry sharing the most whole blocks with `token_ids` (under the same salt), short of their last
        token; among equals the most recently used. A match is used: it becomes the most recent."""
        usable = block_keys(token_ids[:max(len(token_ids) - 1, 0)], self.block_size, salt)
        best, blocks = None, 0
        for n, key in enumerate(usable, start=1):
            holders = self._by_key.get(key)
            if not holders:
                break  # a chain: no later block can match once one does not
            best, blocks = max(holders, key=lambda name: self._entries[name].used), n
        if best is None:
            return NO_MATCH
        self._entries.move_to_end(best)
        self._entries[best].used = self._next()
        return Match(best, blocks * self.block_size)

    def hold(self, entry: str) -> None:
        """A request starts from `entry`: it must not be evicted until `release`."""
        self._entries[entry].holders += 1

    def release(self, entry: str) -> None:
        e = self._entries.get(entry)
        if e is not None and e.holders:
            e.holders -= 1

    def evictable(self, other_than: str | None = None) -> str | None:
        """The least recently used entry no request holds (other than `other_than`), or None."""
        return next((name for name, e in self._entries.items() if not e.holders and name != other_than), None)

    def held(self, entry: str) -> bool:
        return self._entries[entry].holders > 0

    def tokens(self, entry: str) -> int:
        """The tokens an entry's whole blocks cover: all a request starting from it could match."""
        return len(self._entries[entry].keys) * self.block_size

    def names(self) -> list[str]:
        return list(self._entries)

    @property
    def blocks(self) -> int:
        """Whole blocks cached, over every entry (a block two entries share counts once)."""
        return len(self._by_key)

    def _next(self) -> int:
        self._tick += 1
        return self._tick


@attrs.frozen
class Start:
    """How a request starts: from `match` (NO_MATCH: from position 0), taking the entry's slot (`take`) or
    copying its rows into a free slot, once the entries in `drop` are evicted."""

    match: Match = NO_MATCH
    take: bool = False
    drop: tuple[str, ...] = ()


def plan_start(index: PrefixIndex, token_ids: Sequence[int], *, free_slots: int, use_cache: bool = True,
               salt: str = "") -> Start | None:
    """Stage 0's decision for a request about to start, `free_slots` being the slots neither a request nor an
    entry holds; None: no slot can be had until a request ends or releases its entry.

    - A matched entry the request covers whole (the next turn of its chat) is taken, slot and all: the
      request's own entry will hold everything it did. So is one matched when no slot is free.
    - Else a match is copied into a free slot, so the entry stays for others (a shared system prompt).
    - Where no slot is free, the least recently used entry no request holds is evicted to make one.
    - An entry that requests are copying from (held) is neither taken nor evicted.
    """
    m = index.match(token_ids, salt) if use_cache else NO_MATCH
    if m.entry is not None and not index.held(m.entry) and (free_slots <= 0 or m.tokens >= index.tokens(m.entry)):
        return Start(m, take=True)
    if free_slots > 0:
        return Start(m)
    victim = index.evictable(other_than=m.entry)
    return None if victim is None else Start(m, drop=(victim,))
