"""Compiled kernels kept on disk across processes, so that a node's boot does not redo tinygrad's codegen.

tinygrad 0.14 caches the C compiler's output on disk (its `cache.db`), but lowering each kernel to C —
the linearizer and renderer, in Python — is cached only in memory (`to_program_cache`), so every new
process pays it again: about half of capturing a step graph, and a node captures one graph per batch
bucket at boot. This module puts a disk tier under that in-memory cache: on a miss in memory it looks
in tinygrad's own sqlite cache (table `pp_program`), and every newly lowered kernel is written there.

The key is tinygrad's own cache key made into a string: the kernel's content hash, the renderer and its
target, the codegen settings, and tinygrad's version — a different kernel, device, compiler setting or
tinygrad release is a miss, never a wrong program. `CACHELEVEL=0` turns tinygrad's disk cache off, and
with it this one.
"""
from __future__ import annotations

from importlib.metadata import version

import tinygrad.engine.realize as realize
from tinygrad.helpers import diskcache_get, diskcache_put

TABLE = "pp_program"
_TINYGRAD = version("tinygrad")


def _disk_key(key: tuple) -> str:
    content, renderer, target, *settings = key
    content = content.hex() if isinstance(content, bytes) else repr(content)
    return "|".join((_TINYGRAD, content, renderer.__module__ + "." + renderer.__qualname__, repr(target),
                     repr(tuple(settings))))


class DiskBackedPrograms(dict):
    """A drop-in for tinygrad's `to_program_cache` dict: the same lookups, with a disk tier behind them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.disk_hits = 0

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        program = diskcache_get(TABLE, _disk_key(key))
        if program is None:
            return False
        self.disk_hits += 1
        dict.__setitem__(self, key, program)
        return True

    def __setitem__(self, key, program) -> None:
        dict.__setitem__(self, key, program)
        diskcache_put(TABLE, _disk_key(key), program)


def install() -> DiskBackedPrograms:
    """Put the disk tier in place (once per process; later calls return the installed one)."""
    if not isinstance(realize.to_program_cache, DiskBackedPrograms):
        realize.to_program_cache = DiskBackedPrograms(realize.to_program_cache)
    return realize.to_program_cache
