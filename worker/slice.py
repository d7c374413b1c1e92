"""What a stage's compute is to the worker: the Slice protocol every backend implements (the tinygrad one
in worker/compute/slice.py, the stand-in in worker/stub.py). No tinygrad here.

A slice owns blocks [lo, hi) and their KV caches; the first slice also embeds token ids, and the
last also turns its output into logits. `forward` takes and returns float32 numpy hidden states.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from .batching import Segment
from .contract import Kernels


class Slice(Protocol):
    hidden_dim: int
    vocab_size: int
    max_context: int
    weight_bytes: int
    kv_bytes: int  # the KV caches of every slot
    kernels: Kernels  # what its steps compute with (pp's C kernels or tinygrad's)
    max_seqs: int  # sequence slots: 0 .. max_seqs - 1
    max_batch: int  # rows one step computes at once; longer batches run as several steps

    def embed(self, token_ids: list[int]) -> np.ndarray: ...  # (seq_len, hidden_dim); first slice only

    # hidden (rows, hidden_dim), the segments' rows in order -> hidden (rows, hidden_dim), or with a head
    # the logits of each segment's last row (len(segments), vocab), or of the rows logit_rows names
    def forward_batch(self, hidden: np.ndarray, segments: list[Segment], logit_rows=None) -> np.ndarray: ...

    def forward(self, hidden: np.ndarray, position: int) -> np.ndarray: ...  # one sequence in slot 0

    # the KV of positions 0 .. rows - 1 of slot src, in every block, into slot dst (the prefix cache); True: dst
    # maps src's very pages (worker/kv_pages.py), nothing copied
    def copy_rows(self, src: int, dst: int, rows: int) -> bool: ...

    # a slot's KV no one will read again: its memory may go back (it reads as zeros after)
    def trim(self, slot: int) -> None: ...

    # compile what the first request would, before it arrives; beam > 0: tinygrad's kernel search first
    def warm_up(self, beam: int = 0, *, lazy: bool = False, prompt_rows: int | None = None
                ) -> dict[int, float]: ...  # seconds each capture took
    def warm_more(self) -> tuple[int, float] | None: ...  # (lazy) the next bucket captured, and its seconds
    @property
    def wants_capture(self) -> bool: ...  # steps keep wanting a bucket not captured yet
