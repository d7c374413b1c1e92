"""Reading model files, the ground floor every loader and tokenizer builds on: page-aligned host buffers,
exact-extent reads and JSON objects. Every failure is a ModelFileError naming the file.

No other module of the worker is imported here but its errors.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import weakref
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


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_MAP_FIXED = 0x10
_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def shared_zeros(shape: tuple[int, ...], dtype, *, file_factor: int) -> tuple[np.ndarray, int]:
    """Zeros in a shared mapping of a memory file `file_factor` times the array's size (sparse: a page takes
    memory only once touched), and the file's descriptor: worker/kv_pages.py maps parts of the array onto
    other parts of the file (map_file) and gives pages back (punch). Unmapped and closed with the array."""
    count = int(np.prod(shape))
    nbytes = -(-max(1, count * np.dtype(dtype).itemsize) // mmap.PAGESIZE) * mmap.PAGESIZE
    fd = os.memfd_create("pp-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes * file_factor)
        addr = _LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of the KV memory file")
    except BaseException:
        os.close(fd)
        raise
    buffer = (ctypes.c_char * nbytes).from_address(addr)
    weakref.finalize(buffer, _unmap, addr, nbytes, fd)  # the array holds the buffer: both go together
    return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape), fd


def _unmap(addr: int, nbytes: int, fd: int) -> None:
    _LIBC.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes))
    os.close(fd)


def map_file(array: np.ndarray, offset: int, length: int, fd: int, file_offset: int) -> None:
    """Map bytes [offset, offset + length) of `array` (a shared_zeros array) onto the file's bytes from
    `file_offset`: both page-aligned. The bytes read and written there are the file's from then on."""
    addr = array.ctypes.data + offset
    if addr % mmap.PAGESIZE or length % mmap.PAGESIZE or file_offset % mmap.PAGESIZE:
        raise ValueError(f"map_file: {offset}+{length} -> {file_offset} is not page-aligned")
    if length and _LIBC.mmap(addr, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd,
                             file_offset) != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a KV region: {os.strerror(err)}")


def punch(fd: int, offset: int, length: int) -> None:
    """The file's pages in [offset, offset + length) go back to the system and read as zeros, in every mapping."""
    if length > 0 and _LIBC.fallocate(fd, _PUNCH_HOLE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE) of a KV region: {os.strerror(err)}")


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
