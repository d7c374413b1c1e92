"""A captured graph replayed without re-deriving its inputs on every call.

Each call of a tinygrad 0.14 `TinyJit` first works out, from the tensors it is given, which buffers and
symbolic variables they are (`_prepare_jit_inputs`: a walk over the arguments, a substitute and an unbind
per input, variable merging) and checks them against the capture. A stage's graphs always get the same
input tensors (one set per batch bucket, written in place), so that answer never changes, yet every stage
paid for it at every step (4% of a stage's compute thread in issue 34's profile, docs/benchmarks.md). `Replay` asks the jit once, through its ordinary call, and later calls hand
the captured graph the same buffers and the variables' values directly.

Whenever the tensors are not the ones it saw (another tensor, or the same tensor now holding another
buffer), the call goes through the jit as before, which checks them as it always does.
"""
from __future__ import annotations

from tinygrad import Tensor, TinyJit, UOp
from tinygrad.helpers import disable_gc


class Replay:
    """`replay(*tensors, **values)` runs `jit` on the input tensors with the symbolic variables bound to
    `values` (name → int), as `jit(*tensors, *bound variables)` would, and returns what the jit returns."""

    def __init__(self, jit: TinyJit, variables: dict[str, tuple[int, int]] | None = None):
        self.jit = jit
        self._variables = variables or {}  # name → (min, max), as the graph's function declares them
        self._seen: tuple | None = None  # the inputs' uops when the buffers below were taken
        self._buffers: list[UOp] = []

    def __call__(self, *tensors: Tensor, **values: int):
        key = tuple(t.uop for t in tensors)
        if self.jit.captured is not None and _same(key, self._seen):
            with disable_gc():  # as TinyJit's own call: no collection in the middle of a submit
                return self.jit.captured(self._buffers, values)
        bound = [UOp.variable(name, *self._variables[name]).bind(v) for name, v in values.items()]
        out = self.jit(*tensors, *bound)
        if self.jit.captured is not None:  # captured (now or before): the inputs' buffers are settled
            self._seen, self._buffers = key, [t.uop.base for t in tensors]
        return out


def _same(a: tuple, b: tuple | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))
