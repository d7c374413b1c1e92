"""Host memory to and from the device's buffers: a step's input buffers written in place, outputs read back,
and which numpy arrays the CPU device can compute on where they lie."""
from __future__ import annotations

from typing import Callable

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.device import Buffer

from ..files import aligned_empty

# numpy types the CPU device can compute on in place, as tinygrad's
FROM_BLOB = {np.float32: dtypes.float32, np.float16: dtypes.float16, np.int8: dtypes.int8, np.uint8: dtypes.uint8,
              np.uint16: dtypes.uint16, np.int32: dtypes.int32}


class StepInputs:
    """The host-written input buffers of one bucket: floats (b, dim + head_dim) = hidden | cos | sin,
    ints (3, b) = position | slot | cache row. On the CPU they are written in place through a
    zero-copy view; copying a fresh numpy array in costs more than a small step (docs/benchmarks.md)."""

    def __init__(self, rows: int, dim: int, head_dim: int, zeros: Callable[..., Tensor]):
        self.floats = zeros((rows, dim + head_dim))
        self.ints = zeros((3, rows), np.int32)

    def write(self, floats: np.ndarray, ints: np.ndarray) -> None:
        write(self.floats, floats)
        write(self.ints, ints)


def aligned_copy(array: np.ndarray) -> np.ndarray:
    out = aligned_empty(array.nbytes).view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def zero_copy(buffer: Buffer) -> bool:
    return buffer.device.startswith("CPU") and hasattr(buffer.allocator, "_as_buffer")


def write(t: Tensor, data: np.ndarray) -> None:
    buffer = t.uop.buffer
    if zero_copy(buffer):
        np.frombuffer(buffer.as_memoryview(force_zero_copy=True), dtype=data.dtype)[:] = data.reshape(-1)
        return
    data = np.ascontiguousarray(data)
    buffer.copy_from(Buffer("PYTHON", buffer.size, buffer.dtype, opaque=memoryview(data.reshape(-1)).cast("B"))
                     .ensure_allocated())


def read(t: Tensor) -> np.ndarray:
    buffer = t.uop.buffer
    if zero_copy(buffer):  # the output buffer is reused by the next step: copy it out
        return np.frombuffer(buffer.as_memoryview(force_zero_copy=True), dtype=np.float32).reshape(t.shape).copy()
    return t.numpy()
