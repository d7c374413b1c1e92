"""The CPU kernels' thread pool (worker/compute/cpu_threads.py): a job split over its threads computes
what one thread does, bit for bit, job after job and with several callers at once; bad thread counts are
refused."""
import ctypes
import threading
import time

import numpy as np
import pytest

from worker.compute import cpu_threads


class Job(ctypes.Structure):  # cpu_jobs.JOB_C
    _fields_ = [("fn", ctypes.c_void_p), ("p", ctypes.c_void_p * 4), ("n", ctypes.c_long * 6),
                ("f", ctypes.c_float * 2), ("items", ctypes.c_long)]


def f32_job(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> Job:
    lib = cpu_threads.library()
    job = Job(fn=ctypes.cast(lib.pp_mv_f32, ctypes.c_void_p).value, items=w.shape[0])
    job.p[0], job.p[1], job.p[2] = y.ctypes.data, x.ctypes.data, w.ctypes.data
    job.n[0], job.n[1], job.n[2] = x.shape[0], w.shape[0], w.shape[1]
    return job


def run(pool: cpu_threads.CpuThreads, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    y = np.zeros((x.shape[0], w.shape[0]), np.float32)
    job = f32_job(y, x, w)
    cpu_threads.library().pp_run(pool.pool, ctypes.byref(job))
    return y


def test_a_split_job_equals_one_threads_bits_job_after_job():
    rng = np.random.default_rng(1)
    pool, alone = cpu_threads.CpuThreads(4, spin_ns=0), cpu_threads.CpuThreads(1)  # spin 0: every job wakes sleepers
    for i in range(300):
        w = rng.standard_normal((1 + i % 37, 64)).astype(np.float32)
        x = rng.standard_normal((1 + i % 5, 64)).astype(np.float32)
        assert np.array_equal(run(pool, x, w).view(np.uint32), run(alone, x, w).view(np.uint32)), i
    np.testing.assert_allclose(run(pool, x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    pool.close()
    alone.close()


def test_callers_at_once_each_get_their_own_answer():
    """Two devices' worker threads may call at once: the second runs its job alone rather than wait."""
    pool, alone = cpu_threads.CpuThreads(3), cpu_threads.CpuThreads(1)
    rng = np.random.default_rng(2)
    cases = [(rng.standard_normal((3, 96)).astype(np.float32), rng.standard_normal((50 + k, 96)).astype(np.float32))
             for k in range(4)]
    wants = [run(alone, x, w) for x, w in cases]
    wrong = []

    def caller(k: int) -> None:
        x, w = cases[k]
        for _ in range(200):
            if not np.array_equal(run(pool, x, w), wants[k]):
                wrong.append(k)
    callers = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in callers) and not wrong
    pool.close()
    alone.close()


@pytest.mark.parametrize("threads", [0, -1, cpu_threads.MAX_THREADS + 1])
def test_a_thread_count_out_of_range_is_refused(threads):
    with pytest.raises(ValueError, match="threads must be"):
        cpu_threads.CpuThreads(threads)


WORK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_long, ctypes.c_long)


def test_a_stalled_helper_holds_up_a_job_by_the_one_chunk_it_has_taken():
    """A thread the OS or the hypervisor takes away mid-job (here: a helper asleep in its first chunk) costs
    the job that chunk, not its share: whoever runs does the chunks it would have done, each item once."""
    pool, caller = cpu_threads.CpuThreads(2, spin_ns=10**9), threading.get_ident()  # the helper spins: it takes a chunk
    ran, lock = [], threading.Lock()

    def work(_job, lo, hi):
        mine = threading.get_ident() == caller
        with lock:
            stall = not mine and not any(not m for m, _ in ran)
            ran.append((mine, range(lo, hi)))
        if stall:
            time.sleep(0.5)
    fn = WORK(work)
    for _ in range(200):  # until the helper, spinning, takes a chunk before the caller has taken them all (a loaded
        # machine may keep it off its core for many tries)
        ran.clear()
        job = Job(fn=ctypes.cast(fn, ctypes.c_void_p).value, items=1000)
        start = time.monotonic()
        cpu_threads.library().pp_run(pool.pool, ctypes.byref(job))
        if any(not mine for mine, _ in ran):
            break
    assert sorted(i for _, r in ran for i in r) == list(range(1000))  # every item once
    assert [mine for mine, _ in ran].count(False) == 1  # the helper's one chunk; the caller did the rest
    assert len(ran) == 2 * cpu_threads.CHUNKS and time.monotonic() - start < 5
    pool.close()
