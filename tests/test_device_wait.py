"""The CPU device's wait (worker/compute/device_wait.py): it returns once the signal reaches the value, lets
other Python threads run meanwhile, and still reports a device that makes no progress."""
from __future__ import annotations

import array
import ctypes
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from worker.compute import device_wait
from worker.compute.cpu_threads import library


class _Device:
    def __init__(self, wait_timeout_ms: int = 30000):
        self.wait_timeout_ms, self.can_recover, self.hung = wait_timeout_ms, False, 0

    def on_device_hang(self):
        self.hung += 1
        raise RuntimeError("hang")


def _set_later(sig: array.array, value: int, after_s: float) -> threading.Thread:
    def run():
        time.sleep(after_s)
        sig[0] = value
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_wait_returns_once_the_signal_reaches_the_value():
    sig = array.array("Q", [3])
    setter = _set_later(sig, 5, 0.02)
    started = time.perf_counter()
    device_wait.wait_signal(_Device(), sig, 5)
    assert sig[0] == 5 and time.perf_counter() - started >= 0.015
    setter.join()


def test_a_signal_already_there_returns_at_once():
    device_wait.wait_signal(_Device(wait_timeout_ms=0), array.array("Q", [7]), 7)


def test_other_python_threads_get_the_interpreter_at_once_while_the_device_is_awaited():
    """A thread that wakes (the event loop, on a frame) runs within a fraction of a millisecond. tinygrad's own
    wait held the GIL, handing it over only when the interpreter's switch interval (5 ms) forced it."""
    sig, late = array.array("Q", [0]), []

    def wake_often():
        for _ in range(20):
            started = time.perf_counter()
            time.sleep(0.001)
            late.append(time.perf_counter() - started - 0.001)
        sig[0] = 1
    sleeper = threading.Thread(target=wake_often)
    sleeper.start()
    device_wait.wait_signal(_Device(), sig, 1)
    sleeper.join()
    assert sorted(late)[len(late) // 2] < sys.getswitchinterval() / 2


def test_a_device_that_makes_no_progress_is_reported_hung():
    device = _Device(wait_timeout_ms=30)
    with pytest.raises(RuntimeError, match="hang"):
        device_wait.wait_signal(device, array.array("Q", [0]), 1)
    assert device.hung == 1


def test_progress_short_of_the_value_keeps_the_wait_going():
    """Each step of the signal restarts the hang timer, as tinygrad's own wait does."""
    sig, device = array.array("Q", [0]), _Device(wait_timeout_ms=60)

    def climb():
        for v in range(1, 6):
            time.sleep(0.03)
            sig[0] = v
    climber = threading.Thread(target=climb)
    climber.start()
    device_wait.wait_signal(device, sig, 5)
    climber.join()
    assert device.hung == 0


def test_installed_on_the_cpu_device():
    device_wait.install()
    from tinygrad.runtime.ops_cpu import CPUDevice
    assert CPUDevice._wait_signal is device_wait.wait_signal


# --- the woken wait (pp_worker / pp_wait_done, worker/compute/cpu_threads.py) ------------------------------

def _counter_and_address():
    counter = (ctypes.c_uint64 * 1)(0)
    return counter, ctypes.addressof(counter)


def test_the_woken_wait_returns_once_the_done_counter_reaches_the_value_even_unwoken():
    counter, address = _counter_and_address()

    def count_up():
        for v in range(1, 4):
            time.sleep(0.01)
            counter[0] = v  # a plain write, no wake: the wait's poll still sees it
    climber = threading.Thread(target=count_up)
    climber.start()
    assert library().pp_wait_done(address, 3, 2_000_000, 10**9) == 0
    climber.join()
    assert counter[0] == 3


def test_the_woken_wait_reports_a_counter_that_makes_no_progress():
    _, address = _counter_and_address()
    assert library().pp_wait_done(address, 1, 1_000_000, 20_000_000) == 1


WOKEN_RUN = """
import time, numpy as np
from tinygrad import Device, Tensor, TinyJit
from worker.compute import device_wait, whole_graphs
from worker.compute.cpu_threads import library
whole_graphs.install()
device_wait.install(library())
dev = Device[Device.DEFAULT]
a = Tensor(np.random.default_rng(0).standard_normal((400, 400)).astype(np.float32)).realize()
step = TinyJit(lambda x: (x @ a / 400).realize())
x = Tensor.ones(400, 400).contiguous().realize()
for _ in range(3):
    step(x)
dev.synchronize()
for _ in range(30):
    y = step(x)
thread_cpu, wall = time.thread_time(), time.perf_counter()
dev.synchronize()
thread_cpu, wall = time.thread_time() - thread_cpu, time.perf_counter() - wall
ours = [w.thread._target == library().pp_worker for w in dev.workers]
print(ours, wall, thread_cpu)
"""


def test_installed_the_device_runs_our_worker_loop_and_its_waiter_sleeps():
    """Once installed before the device's first queue, its worker threads run pp_worker, and a synchronize
    sleeps until woken rather than polling (its thread's CPU time is a small part of the wait)."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", WOKEN_RUN], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DEV": "CPU", "PYTHONPATH": str(root)}, check=True)
    ours, wall, thread_cpu = out.stdout.strip().rsplit("\n", 1)[-1].rsplit(" ", 2)
    assert ours.startswith("[True") and "False" not in ours, out.stdout
    if float(wall) > 0.05:  # the work was still running when the wait began
        assert float(thread_cpu) < 0.2 * float(wall), (wall, thread_cpu)
