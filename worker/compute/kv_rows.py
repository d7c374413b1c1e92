"""A slot's KV rows as a whole, outside a step: copied into another slot (the prefix cache), or given back once
no one will read them (StageModel's caches; worker/slots.py decides when)."""
from __future__ import annotations

import numpy as np

from ..files import release
from .host_io import zero_copy


def copy_rows(model, src: int, dst: int, rows: int) -> bool:
    """The KV of slot src's first `rows` positions into slot dst, every block of `model` (a StageModel). On the
    CPU a copy in host memory; elsewhere a slice assign, which tinygrad compiles once per row count."""
    for s in (src, dst):
        if not 0 <= s < model.max_seqs:
            raise ValueError(f"slot {s}: need 0..{model.max_seqs - 1}")
    if model.pages is not None and model.pages.share(src, dst, rows):
        return True  # the CPU: dst's first rows map src's very pages (worker/kv_pages.py)
    ctx = model.config.max_context
    for block in model.blocks:
        buffer = block.cache.uop.buffer
        if zero_copy(buffer):
            view = np.frombuffer(buffer.as_memoryview(force_zero_copy=True), dtype=np.dtype(block.cache.dtype.fmt))
            view = view.reshape(block.cache.shape)
            view[dst * ctx:dst * ctx + rows] = view[src * ctx:src * ctx + rows]
        else:
            block.cache[dst * ctx:dst * ctx + rows].assign(block.cache[src * ctx:src * ctx + rows]).realize()
    return False


def trim(model, slot: int) -> None:
    """Give back the memory of a slot's KV, which no one will read (its request ended, and no prefix-cache entry
    holds it): on the CPU its pages return to the system (KvPages.reset, or files.release where the caches are
    not shared pages), so a stage holds the KV of what its slots use, not of `max_context` each. Elsewhere (no
    lazy host array) nothing changes."""
    if model.pages is not None:
        model.pages.reset(slot)
        return
    for block in model.blocks:
        host = model.lazy_host(block.cache)
        if host is not None:
            rows, width = model.config.max_context, host.strides[0]
            release(host, slot * rows * width, (slot + 1) * rows * width)
