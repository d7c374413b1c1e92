"""A captured graph replayed without re-deriving its inputs on every call.

Each call of a tinygrad 0.14 `TinyJit` first works out, from the tensors it is given, which buffers and
symbolic variables they are (`_prepare_jit_inputs`: a walk over the arguments, a substitute and an unbind
per input, variable merging) and checks them against the capture. A stage's graphs always get the same
input tensors (one set per batch bucket, written in place), so that answer never changes, yet every stage
paid for it at every step (4% of a stage's compute thread in issue 34's profile, docs/benchmarks.md). `Replay` asks the jit once, through its ordinary call, and later calls hand
the captured graph the same buffers and the variables' values directly.

Whenever the tensors are not the ones it saw (another tensor, or the same tensor now holding another
buffer), the call goes through the jit as before, which checks them as it always does.

Below the jit, each replay of a whole-graph submit (whole_graphs.py) resolved every one of the graph's
arguments again (`exec_kernel`: a walk over the call's sources, a lookup and the buffer behind each). For
one captured call and the same inputs the answer is the same list, so `install` keeps it (`_PREPARED`) and a
replay only works out the launch sizes and the symbolic values: `bench.step --blocks 30 --batch 1 --threads 2
--steps 20 --profile` put the graph call at 68 ms over the 20 profiled steps before, 15 ms after (issue 38,
docs/benchmarks.md).
"""
from __future__ import annotations

import weakref

import tinygrad.engine.realize as realize
from tinygrad import Tensor, TinyJit, UOp
from tinygrad.device import MultiBuffer
from tinygrad.helpers import disable_gc, to_tuple


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


# captured call → (its inputs, its runtime, the device buffers it is called with, their Buffers); an entry
# goes with its call
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EXEC_KERNEL = realize.exec_kernel


def install() -> None:
    """A jit replay's kernel call (tinygrad's `exec_kernel`) reuses the buffers it resolved the first time."""
    realize.exec_kernel = _exec_kernel


def _exec_kernel(ctx, call: UOp, ast: UOp) -> list:
    if not ctx.jit:  # a call outside a replay: tinygrad's own way
        return _EXEC_KERNEL(ctx, call, ast)
    entry = _PREPARED.get(call)
    if entry is None or not _same(ctx.input_uops, entry[0]) or not all(b.is_allocated() for b in entry[3]):
        entry = _prepare(ctx, call, ast)
        if entry is None:  # several devices: tinygrad's own way
            return _EXEC_KERNEL(ctx, call, ast)
    _, runtime, device_bufs, _ = entry
    global_size, local_size = ast.arg.launch_dims(ctx.var_vals)
    return [runtime(*device_bufs, global_size=global_size, local_size=local_size, vals=ast.arg.vals(ctx.var_vals),
                    wait=ctx.wait, timeout=ctx.timeout)]


def _prepare(ctx, call: UOp, ast: UOp) -> tuple | None:
    """What `exec_kernel` works out from a call and its inputs, kept for the next replay: one device's runtime
    and the device buffers it is called with (as tinygrad's, with no multi-device unwrapping)."""
    devices = to_tuple(call.src[1].device)
    if len(devices) != 1:
        return None
    resolved = realize.resolve_params(call, ctx.input_uops)
    bufs = [resolved[i].buffer for i in ast.arg.globals]
    if any(isinstance(b, MultiBuffer) for b in bufs):
        return None
    device, allocated = devices[0], [b.ensure_allocated() for b in bufs]
    runtime = realize.get_runtime(device, ast, cache=ctx.cache)
    entry = (ctx.input_uops, runtime, [b.get_buf(device) for b in allocated], allocated)
    _PREPARED[call] = entry
    return entry
