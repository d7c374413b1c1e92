"""Waiting for the CPU device without holding the GIL.

tinygrad 0.14's CPU device runs a submitted graph on a worker thread of its own (native code, no GIL), and
whoever reads a result waits for it in `HCQ2Compiled._wait_signal`: a Python loop re-reading the signal,
holding the GIL all the while (the interpreter hands it over only every `sys.getswitchinterval()`, 5 ms).
In a stage that is the compute thread, so while a step's kernels run the event loop can neither read the
next frame nor send the last step's result, and the compute thread itself, woken for the next step, waits
for the GIL the loop holds. A py-spy profile of a 5-stage cluster put ~70% of the compute thread's samples in
that wait and in the GIL hand-overs around it (issue 34, docs/benchmarks.md).

Here the wait gives the GIL up between reads: it sleeps in steps of 20 µs, with the thread's timer slack cut
to 1 µs (Linux adds 50 µs to every sleep by default). Not `sched_yield`: on a busy box a yield can hand the
core to another process for a whole time slice (ms). The polls' wake-ups cost a lone process 0.2-0.7 ms a
15-block step against tinygrad's spin (`bench.wait`); in a pipeline the released GIL is worth more.
tinygrad's hang detection is kept: no progress for `wait_timeout_ms` still ends in `on_device_hang`.

Those polls were the price of a step split over threads (cpu_threads.py): with every core computing, each of
the 50,000 wake-ups a second preempted one of them, and the step's other half waited for it (`bench.threads`
at two threads, docs/benchmarks.md: 8 rows a step took 105 ms against one thread's 82, a 512-token prompt ran
at 75 tokens/s against 101; with the wake below, 63 ms against 82 and 123 against 88). So a
step's end now wakes its waiter: the device's worker threads run our copy of tinygrad's worker loop
(`pp_worker`, cpu_threads.py), which wakes whoever sleeps on its done counter once the counter reaches what
they wait for, and `synchronize` sleeps there in C (`pp_wait_done`, the GIL released) until each ring is
drained, before tinygrad's own checks, which then find everything done. A device whose workers started before `install`
keeps the polls, and so does one whose process has no kernel library (its build failed: cpu_kernels.py).
"""
from __future__ import annotations

import ctypes
import sys
import threading
import time

SLEEP_S = 20e-6  # each sleep between reads: a step's result is read at most this late
POLL_NS = 1_000_000  # pp_wait_done re-reads a done counter at least this often, woken or not
_PR_SET_TIMERSLACK = 29
_slack = threading.local()


def _cut_timer_slack() -> None:
    """Once per thread: sleeps of 20 µs take ~20 µs, not 70 (timer slack is per thread on Linux)."""
    if getattr(_slack, "cut", False):
        return
    _slack.cut = True
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # only slower wake-ups


def wait_signal(device, sig, value: int, timeout: int | None = None) -> None:
    """tinygrad's `_wait_signal`, the GIL released between reads of `sig` (see the module's docstring)."""
    if sig[0] >= value:
        return
    limit_s = ((timeout if timeout is not None and device.can_recover else None) or device.wait_timeout_ms) / 1000
    seen, since = sig[0], time.perf_counter()
    _cut_timer_slack()
    while (done := sig[0]) < value:
        if done != seen:
            seen, since = done, time.perf_counter()
        elif time.perf_counter() - since > limit_s:
            device.on_device_hang()
        time.sleep(SLEEP_S)


class _Worker:
    """What the CPU device starts its worker threads with (tinygrad's CPUProgram of worker_prog: `fxn`)."""

    def __init__(self, fxn):
        self.fxn = fxn


def synchronize(device, timeout: int | None = None) -> None:
    """CPUDevice.synchronize, asleep until each worker's done counter reaches what was put in its ring (our
    worker loop wakes it), then tinygrad's own, which finds everything done."""
    if (lib := _WOKEN.get(device)) is not None:
        hang_ms = (timeout if timeout is not None and device.can_recover else None) or device.wait_timeout_ms
        for worker in device.workers:
            put = worker.put._buf.cpu_view().view(fmt="Q")[0]
            if lib.pp_wait_done(worker.done._buf.va_addr, put, POLL_NS, hang_ms * 1_000_000):
                device.on_device_hang()
    _TINYGRAD_SYNCHRONIZE(device, timeout)


def install(lib=None) -> None:
    """Wait for the CPU device this way (in this process). Other devices' waits are left as tinygrad has them
    (a GPU's signal is read over MMIO; its hang handling is its own). `lib`: the kernel library
    (cpu_threads.library) whose worker loop wakes the waiter; None: tinygrad's loop, waited for by polls."""
    from tinygrad import Device
    from tinygrad.runtime.ops_cpu import CPUDevice, worker_prog
    global _TINYGRAD_SYNCHRONIZE
    CPUDevice._wait_signal = wait_signal
    if not Device.DEFAULT.startswith("CPU") or not sys.platform.startswith("linux"):
        return
    device = Device[Device.DEFAULT]
    if lib is not None and not device.workers and device not in _WOKEN:  # no queue yet: its workers will be ours
        device.prgs[worker_prog] = _Worker(lib.pp_worker)
        _WOKEN[device] = lib
    if CPUDevice.synchronize is not synchronize:
        _TINYGRAD_SYNCHRONIZE, CPUDevice.synchronize = CPUDevice.synchronize, synchronize


_TINYGRAD_SYNCHRONIZE = None
_WOKEN: dict = {}  # devices whose worker threads run pp_worker -> the library it is in
