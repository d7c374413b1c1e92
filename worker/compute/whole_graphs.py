"""A captured step submitted to the CPU as one command queue, not kernel by kernel from Python.

tinygrad 0.14 replays a captured graph by calling each kernel from Python, about 100 µs a kernel here
(issue 11's profile): SmolLM2's 30 blocks are ~540 kernels, so a 30-block decode step spent ~53 of its
79 ms in Python (`bench.step --blocks 30`, docs/benchmarks.md, issue 25). Its HCQ2 mode instead encodes
the whole graph once into a command buffer that the CPU device's worker thread runs, so a replay is one
submit: the same step took 26 ms.

HCQ2 is tinygrad's own setting (read through its `getenv`, cached). It is turned on here for the CPU
device only, before any graph is captured; elsewhere (a GPU box) it stays as tinygrad has it, since the
mode is not finished for every device (tinygrad 0.14's AMD backend imports a module its wheel lacks when
HCQ2 is set). A user's explicit `HCQ2=0` is kept.
"""
from __future__ import annotations

import os

import tinygrad.engine.realize as realize
from tinygrad import Device
from tinygrad.helpers import getenv

_UNSET = -1


def install() -> bool:
    """Submit captured graphs whole on the CPU device (once per process); returns whether they are."""
    setting = getenv("HCQ2", _UNSET)
    if setting != _UNSET or not Device.DEFAULT.startswith("CPU"):
        return bool(setting) and setting != _UNSET
    from tinygrad.runtime.support import hcq2
    # realize.py imports these at its own import only when HCQ2 was set then
    realize.hcq_compile, realize.hcq_link = hcq2.hcq_compile, hcq2.hcq_link
    realize.HCQ_RUNTIME_DEV = hcq2.HCQ_RUNTIME_DEV
    os.environ["HCQ2"] = "1"
    getenv.cache_clear()
    return True
