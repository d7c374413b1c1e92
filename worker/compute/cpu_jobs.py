"""The contract between a captured step's CPU kernels and the compiled library that does their work
(cpu_threads.py): the job a tinygrad kernel fills and hands to pp_run, and how such a kernel is made.

A tinygrad CUSTOM kernel's C is pasted into the step by tinygrad's renderer; here that C is only a
trampoline, so the work itself is compiled once per machine, outside tinygrad, and can use threads.
"""
from __future__ import annotations

from tinygrad import Tensor, UOp, dtypes
from tinygrad.uop.ops import KernelInfo, Ops

# what a trampoline hands to pp_run: the work function, up to 4 buffers, 6 sizes, 2 floats, and how many
# items (outputs) the work splits into
JOB_C = r"""struct pp_job;
typedef void (*pp_work)(const struct pp_job*, long lo, long hi);
struct pp_job { pp_work fn; void* p[4]; long n[6]; float f[2]; long items; };"""


def trampoline(work_slot: int, buffers: int, sizes: tuple[int, ...], items: int, floats: tuple[float, ...] = ()) -> str:
    """The tinygrad kernel's C: a job of the output @0 and inputs @1..@{buffers-1} (at most 4 in all), the
    table as the last buffer @{buffers}, handed to pp_run (cpu_threads.py)."""
    sets = [f"j.fn = (pp_work)t[{work_slot}];"]
    sets += [f"j.p[{i}] = {f'(void*)@{i}' if i < buffers else '(void*)0'};" for i in range(4)]
    sets += [f"j.n[{i}] = {sizes[i] if i < len(sizes) else 0};" for i in range(6)]
    sets += [f"j.f[{i}] = {floats[i]!r}f;" if i < len(floats) else f"j.f[{i}] = 0;" for i in range(2)]
    body = "\n".join(["{", JOB_C, f"const unsigned long* t = (const unsigned long*)@{buffers};", "struct pp_job j;",
                      *sets, f"j.items = {items};", "((void (*)(void*, const struct pp_job*))t[0])((void*)t[1], &j);",
                      "}"])
    return custom_text(body, buffers + 1)


def custom_text(body: str, buffers: int) -> str:
    """C as a CUSTOM op's text: tinygrad formats it with the buffers' names, so C's braces are doubled
    and @i becomes argument i."""
    text = body.replace("{", "{{").replace("}", "}}")
    for i in range(buffers):
        text = text.replace(f"@{i}", f"{{{i}}}")
    return text


def _raw(u: UOp) -> UOp:
    while u.op is Ops.RESHAPE:  # the C indexes flat buffers itself
        u = u.src[0]
    return u


def c_kernel(name: str, text: str, out_shape: tuple[int, ...], *inputs: Tensor) -> Tensor:
    """A float32 tensor of `out_shape` written by the C `text` (custom_text), given `inputs` as @1, @2, ..."""
    def kernel(*buffers: UOp) -> UOp:
        body = UOp(Ops.CUSTOM, dtypes.void, tuple(_raw(u) for u in buffers), text)
        return body.sink(arg=KernelInfo(name=name, opts_to_apply=()))
    return Tensor.empty(*out_shape).custom_kernel(*inputs, fxn=kernel)[0]
