"""Reading model files, the ground floor every loader and tokenizer builds on: page-aligned host buffers,
exact-extent reads and JSON objects. Every failure is a ModelFileError naming the file.

No other module of the worker is imported here but its errors.
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np

from .errors import ModelFileError

ALIGN = 4096  # what tinygrad's own CPU buffers get: the CPU device can compute on such an array in place


def lazy_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros in an anonymous private mapping: page-aligned, and a page takes memory only once it is written
    (the kernel maps every untouched page to its one zero page), so RSS follows what is used, not what is
    reserved. `release` gives written pages back."""
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory would keep its pages
    return np.frombuffer(mapping, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


def release(array: np.ndarray, start: int, stop: int) -> None:
    """Give back the written pages of bytes [start, stop) of a lazy_zeros array: they read as zeros again and
    take no memory. Only pages wholly inside the range go (a page at either end may hold a neighbour's bytes)."""
    mapping = array
    while mapping is not None and not isinstance(mapping, mmap.mmap):  # views, then frombuffer's memoryview
        mapping = mapping.obj if isinstance(mapping, memoryview) else getattr(mapping, "base", None)
    if mapping is None:
        raise ValueError("not an array of lazy_zeros")
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, stop // page * page
    if hi > lo:
        mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised byte array whose data starts on an ALIGN boundary."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes]


def read_extent(path, offset: int, nbytes: int, *, what: str, end: int | None = None) -> np.ndarray:
    """Exactly the bytes [offset, offset + nbytes) of the file at `path`, nothing else, in a page-aligned
    uint8 array (a float32 tensor is used in place from there: worker/compute/model.py's _on_device).

    `what` names the extent in errors ("tensor 'blk.0.attn_q.weight'"). `end` is where the whole extent
    ends when this read is one chunk of it (by default offset + nbytes): a file shorter than that is
    refused before anything is read."""
    end = offset + nbytes if end is None else end
    buf = aligned_empty(nbytes)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if end > size:
                raise ModelFileError(path, f"{what} needs bytes up to {end} but the file has {size}: truncated")
            f.seek(offset)
            got = f.readinto(memoryview(buf))
    except FileNotFoundError as e:
        raise ModelFileError(path, "file is missing") from e
    except OSError as e:
        raise ModelFileError(path, f"cannot read {what}: {e.strerror}") from None
    if got != nbytes:  # the file shrank between fstat and read
        raise ModelFileError(path, f"{what}: read {got} of {nbytes} bytes: truncated")
    return buf


def read_json(path: Path) -> dict:
    """A JSON file holding one object."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError as e:
        raise ModelFileError(path, "file is missing") from e
    except OSError as e:
        raise ModelFileError(path, f"cannot read it: {e.strerror}") from None
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ModelFileError(path, f"not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFileError(path, "expected a JSON object at the top level")
    return data
