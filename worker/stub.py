"""A deterministic stand-in for the model: no tinygrad, tiny dims, for fast node and transport tests.

Like a real model it has blocks with a per-position cache, so the answer is wrong if any block is
skipped, repeated or run out of order, or if a decode step is lost, repeated or reordered: each
block maps h -> (31·h + c_block + Σ cache[0..p]) mod 1009, a polynomial hash whose value depends on
the order of every step. All arithmetic is on small integers, exact in float32.
"""
from __future__ import annotations

import string

import numpy as np

from .batching import DEFAULT_MAX_SEQS, Segment, default_max_batch
from .contract import Kernels

STUB_BLOCKS = 8
STUB_DIM = 16
STUB_VOCAB = 32
STUB_CONTEXT = 512
_MOD = 1009
_ALPHABET = string.ascii_lowercase + "012345"  # one printable character per id 0..31


class StubTokenizer:
    vocab_size, bos_id, eot_id = STUB_VOCAB, 0, 1
    stop_ids = frozenset({1})

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        ids = [2 + b % (STUB_VOCAB - 2) for b in text.encode()]
        return [self.bos_id, *ids] if bos else ids

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text, bos=True)

    def encode_chat(self, prompt: str) -> list[int]:
        return [*self.encode(prompt, bos=True), self.eot_id]

    def encode_messages(self, messages: list[dict], *, add_generation_prompt: bool = True,
                        tools: list[dict] | None = None) -> list[int]:
        """Each turn's role and text, then the end-of-turn id; no template engine for the stand-in (nor tools to
        show), and no generation prompt to leave out."""
        ids = [self.bos_id]
        for m in messages:
            ids += [*self.encode(f"{m['role']}:{m['content']}"), self.eot_id]
        return ids

    def decode(self, ids, *, specials: bool = True) -> str:
        return "".join(_ALPHABET[i] for i in ids)  # the stand-in has no control tokens

    def decode_bytes(self, ids, *, specials: bool = True) -> bytes:
        return self.decode(ids).encode()

    def token_strs(self, ids) -> list[str]:
        return [_ALPHABET[i] for i in ids]


class StubSlice:
    hidden_dim, vocab_size, max_context = STUB_DIM, STUB_VOCAB, STUB_CONTEXT

    def __init__(self, layers: range, *, embed: bool, head: bool, max_seqs: int = DEFAULT_MAX_SEQS):
        self.layers, self._embed, self._head = layers, embed, head
        self.weight_bytes = self.kv_bytes = 0
        self.kernels = Kernels("stub")
        self.max_seqs, self.max_batch = max_seqs, default_max_batch(max_seqs)
        self._cache = {(slot, i): np.zeros((STUB_CONTEXT, STUB_DIM), dtype=np.int64)
                       for slot in range(max_seqs) for i in layers}

    def embed(self, token_ids: list[int]) -> np.ndarray:
        if not self._embed:
            raise RuntimeError("this stub slice has no embedding")
        ids = np.asarray(token_ids, dtype=np.int64)[:, None]
        return ((ids * 7 + np.arange(STUB_DIM)) % _MOD).astype(np.float32)

    def warm_up(self, beam: int = 0, *, lazy: bool = False, prompt_rows: int | None = None) -> dict[int, float]:
        return {}  # nothing to compile

    def warm_more(self) -> tuple[int, float] | None:
        return None

    wants_capture = False

    def forward_batch(self, hidden: np.ndarray, segments: list[Segment], logit_rows=None) -> np.ndarray:
        """Each segment on its own slot's cache, as the tinygrad slice does in one batched step."""
        outs, offset = [], 0
        for s in segments:
            outs.append(self._forward(hidden[offset:offset + s.length], s.position, s.slot))
            offset += s.length
        out = np.concatenate(outs)
        if not self._head:
            return out.astype(np.float32)
        rows = np.cumsum([s.length for s in segments]) - 1 if logit_rows is None else logit_rows
        if not len(rows):
            return np.zeros((0, STUB_VOCAB), dtype=np.float32)
        return np.stack([self._logits(out[r]) for r in rows])

    def copy_rows(self, src: int, dst: int, rows: int) -> bool:
        for i in self.layers:
            self._cache[(dst, i)][:rows] = self._cache[(src, i)][:rows]
        return False

    def trim(self, slot: int) -> None:
        for i in self.layers:
            self._cache[(slot, i)][:] = 0

    def forward(self, hidden: np.ndarray, position: int) -> np.ndarray:
        h = self._forward(hidden, position, 0)
        return self._logits(h[-1]) if self._head else h.astype(np.float32)

    def _forward(self, hidden: np.ndarray, position: int, slot: int) -> np.ndarray:
        h = hidden.astype(np.int64)
        for i in self.layers:
            cache = self._cache[(slot, i)]
            cache[position:position + len(h)] = h
            seen = np.cumsum(cache[:position + len(h)], axis=0)[position:]  # Σ cache[0..p] per row
            h = (31 * h + (i + 1) * (np.arange(STUB_DIM) + 1) + seen) % _MOD
        return h

    @staticmethod
    def _logits(row: np.ndarray) -> np.ndarray:
        target = int(row.sum()) % STUB_VOCAB
        return -np.abs(np.arange(STUB_VOCAB) - target).astype(np.float32)
