"""The CPU device's wait (worker/compute/device_wait.py): it returns once the signal reaches the value, lets
other Python threads run meanwhile, and still reports a device that makes no progress."""
from __future__ import annotations

import array
import sys
import threading
import time

import pytest

from worker.compute import device_wait


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
