"""Stage 0's prefix-cache bookkeeping (roles/first.py), beside the pure matching of roles/prefix.py: the index
of entries, which entry each request started from or holds, the entries forgotten here that the stages are
yet to drop, and the counters /health reports. No I/O: stage 0 sends what it decides with its messages.

An entry is a finished request's slot kept on every stage (EndRequest.keep_as). A request that copies an
entry holds it until its first token, by which time every stage has copied it; one that takes an entry's
slot removes it from the index. An entry forgotten here (evicted, or one a new stage lacks) is dropped by
every stage with the next request that starts (RequestStart.drop).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from .messages import InferenceRequest
from .prefix import DEFAULT_BLOCK_SIZE, PrefixIndex, Start, plan_start


class PrefixCache:
    def __init__(self, enabled: bool = True, block_size: int = DEFAULT_BLOCK_SIZE):
        self.enabled, self.index = enabled, PrefixIndex(block_size)  # off: no entry is ever kept
        self.queries = self.hits = 0  # prompt tokens looked up, and found cached (vLLM's counters)
        self._dropped: list[str] = []  # entries forgotten here that stages may hold: dropped by the next start
        self._made = 0
        self._started: dict[str, str] = {}  # request -> the entry its life started from
        self._held: dict[str, str] = {}  # request -> the entry it copies from, held until its first token
        self._positions: dict[str, int] = {}  # entry -> the positions of KV every stage keeps for it

    def usable(self, req: InferenceRequest) -> bool:
        return self.enabled and req.sampling.prompt_logprobs is None  # those need every prompt row's logits

    def plan(self, req: InferenceRequest, ids: Sequence[int], *, free: int) -> Start | None:
        """How the request would start now (roles/prefix.py), `free` being the slots no request holds; None:
        no slot for it yet."""
        if free <= 0:
            return None
        return plan_start(self.index, ids, free_slots=free - len(self.index), use_cache=self.usable(req),
                          salt=req.cache_salt)

    def start(self, req: InferenceRequest, prompt_tokens: int, plan: Start) -> None:
        """The request starts as planned: evict what the plan drops, take or hold the entry it starts from."""
        rid, entry = req.request_id, plan.match.entry
        self.forget(plan.drop)
        if entry is not None:
            self._started[rid] = entry
            if plan.take:
                self.index.remove(entry)
                self._positions.pop(entry, None)
            else:
                self.index.hold(entry)
                self._held[rid] = entry
        if self.usable(req):
            self.queries, self.hits = self.queries + prompt_tokens, self.hits + plan.match.tokens

    def drops(self) -> tuple[str, ...]:
        """The entries forgotten since the last start, for the next one to tell every stage (RequestStart.drop)."""
        drop, self._dropped = tuple(self._dropped), []
        return drop

    def release(self, request_id: str) -> bool:
        """The request no longer copies its entry (its first token came: every stage has copied it); whether it
        held one."""
        entry = self._held.pop(request_id, "")
        if entry:
            self.index.release(entry)
        return bool(entry)

    def replayed(self, request_id: str) -> None:
        """The request starts its next life from the first token: a stage may have lacked the entry it started
        from, so no request starts from that one again."""
        self.release(request_id)
        entry = self._started.pop(request_id, "")
        if entry in self.index:
            self.forget([entry])

    def ended(self, request_id: str) -> None:
        self.release(request_id)
        self._started.pop(request_id, None)

    def keep(self, owner: str, tokens: Sequence[int], salt: str) -> str:
        """The name every stage keeps a finished request's KV under, indexed here by its tokens ("": not kept,
        the cache being off or the request short of a whole block). May raise (an unhashable salt)."""
        if not self.enabled or len(tokens) < self.index.block_size:
            return ""
        self._made += 1
        name = f"{owner}#{self._made}"
        self.index.add(name, tokens, salt)
        self._positions[name] = len(tokens)
        return name

    def forget(self, names: Iterable[str]) -> None:
        """Evict entries here; every stage forgets them with the next request that starts."""
        for name in list(names):
            self.index.remove(name)
            self._positions.pop(name, None)
            self._dropped.append(name)

    def positions(self, name: str | None = None) -> int:
        """The KV positions every stage keeps for an entry, or (None) for all of them."""
        return self._positions.get(name, 0) if name is not None else sum(self._positions.values())

    def evictable(self, other_than: tuple[str, ...] = ()) -> list[tuple[str, int]]:
        """The entries no request holds (but those named), least recently used first, with their positions."""
        return [(name, self._positions.get(name, 0)) for name in self.index.names()
                if name not in other_than and not self.index.held(name)]

    def health(self) -> dict:
        return {"enabled": self.enabled, "block_size": self.index.block_size, "entries": len(self.index),
                "blocks": self.index.blocks, "queries": self.queries, "hits": self.hits}
