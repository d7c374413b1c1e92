"""A step's big kernels on several cores: a pool of C threads that the hand-written CPU kernels hand work to.

tinygrad 0.14 runs every CPU kernel on one worker thread per device, and its `core_id` slices one after
another (../shared/notes/pipeline-speed.md), so a stage computed on one core. Here the matrices and the
attention (cpu_matvec.py, cpu_attention.py) live in a shared library of our own, compiled once per machine
with tinygrad's optimisation and target flags (-O2, -march=native) as an ordinary shared object (it starts
threads and sleeps on futexes), and the tinygrad kernel in the captured step is only a
trampoline: it fills a job (the work function, its buffers and sizes) and calls `pp_run`, which splits the
job's items (a matrix's output rows, attention's row × head pairs) into one contiguous range per thread,
runs the first range on the calling thread (tinygrad's worker) and waits for the others. Every output is
computed by the same code in the same order whatever range holds it, so a step's results are the same
bits at every thread count; `threads=1` runs the whole job on the calling thread.

Helpers spin briefly after a job (the next matrix of the step is usually microseconds away) and then sleep
on a futex, so an idle stage burns nothing. A second caller arriving while a job runs (two devices in one
process) runs its job alone rather than wait.

The library also holds the CPU device's worker loop and the wait for it (`pp_worker`, `pp_wait_done`), which
device_wait.py installs so that a step's end wakes its reader.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.helpers import CACHEDB, getenv

from . import cpu_attention, cpu_matvec
from .cpu_jobs import JOB_C
from ..config import MAX_THREADS
# How long a thread polls for its next job (a helper) or for the others to finish (the caller) before it
# sleeps: the gaps between a step's big kernels are its small ones, tens of microseconds; between steps a
# helper sleeps, and one futex wake a step costs microseconds.
SPIN_NS = 200_000

POOL_C = r"""#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}
static void fwait(int* word, int value) { syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0); }
static void fwake(int* word) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }
static long now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000L + t.tv_nsec; }

/* Spins until `deadline` (set on the first call, from spin_ns), reading the clock every 64 polls: whether
   to go on polling, the same length of time on any CPU (a pause instruction takes 3 to 140 cycles). */
static int spinning(long i, long* deadline, long spin_ns) {
  if (i & 63) return 1;
  long t = now_ns();
  if (!*deadline) *deadline = t + spin_ns;
  return t < *deadline;
}

struct pp_pool;
struct pp_arg { struct pp_pool* pool; long index; };
struct pp_pool {
  int gen, pending, sleepers, waiting, busy, stop;
  long helpers, spin_ns;
  const struct pp_job* job;
  pthread_t threads[%(max)d];
  struct pp_arg args[%(max)d];
};

/* Waits until *word differs from old: spinning first, then asleep (counted in *sleepers for the waker). */
static int wait_change(int* word, int old, int* sleepers, long spin_ns) {
  int v;
  long deadline = 0;
  for (long i = 0; spinning(i, &deadline, spin_ns); i++) {
    if ((v = __atomic_load_n(word, __ATOMIC_ACQUIRE)) != old) return v;
    relax();
  }
  __atomic_add_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
  while ((v = __atomic_load_n(word, __ATOMIC_SEQ_CST)) == old) fwait(word, old);
  __atomic_sub_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
  return v;
}

static void range(const struct pp_job* j, long index, long parts) {
  long lo = j->items * index / parts, hi = j->items * (index + 1) / parts;
  if (lo < hi) j->fn(j, lo, hi);
}

static void* helper(void* a) {
  struct pp_arg* arg = a;
  struct pp_pool* p = arg->pool;
  int seen = 0;
  for (;;) {
    seen = wait_change(&p->gen, seen, &p->sleepers, p->spin_ns);
    if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return NULL;
    range(p->job, arg->index, p->helpers + 1);
    if (__atomic_sub_fetch(&p->pending, 1, __ATOMIC_SEQ_CST) == 0 && __atomic_load_n(&p->waiting, __ATOMIC_SEQ_CST))
      fwake(&p->pending);
  }
}

static void wait_done(struct pp_pool* p) {
  long deadline = 0;
  for (long i = 0; spinning(i, &deadline, p->spin_ns); i++) {
    if (__atomic_load_n(&p->pending, __ATOMIC_ACQUIRE) == 0) return;
    relax();
  }
  __atomic_store_n(&p->waiting, 1, __ATOMIC_SEQ_CST);
  int v;
  while ((v = __atomic_load_n(&p->pending, __ATOMIC_SEQ_CST)) != 0) fwait(&p->pending, v);
  __atomic_store_n(&p->waiting, 0, __ATOMIC_SEQ_CST);
}

void pp_run(struct pp_pool* p, const struct pp_job* j) {
  if (p->helpers == 0 || j->items < 2 || __atomic_exchange_n(&p->busy, 1, __ATOMIC_ACQ_REL)) {
    j->fn(j, 0, j->items);
    return;
  }
  p->job = j;
  __atomic_store_n(&p->pending, (int)p->helpers, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&p->gen, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST)) fwake(&p->gen);
  range(j, 0, p->helpers + 1);
  wait_done(p);
  __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
}

struct pp_pool* pp_pool_new(long helpers, long spin_ns) {
  if (helpers < 0 || helpers >= %(max)d) return NULL;
  struct pp_pool* p = calloc(1, sizeof(struct pp_pool));
  if (!p) return NULL;
  p->helpers = helpers;
  p->spin_ns = spin_ns;
  for (long i = 0; i < helpers; i++) {
    p->args[i].pool = p;
    p->args[i].index = i + 1;
    if (pthread_create(&p->threads[i], NULL, helper, &p->args[i])) { p->helpers = i; return NULL; }
  }
  return p;
}

/* tinygrad's CPU worker loop (ops_cpu.worker_prog), which also wakes a pp_wait_done sleeping on its done
   counter once the counter reaches what it waits for (device_wait.py installs it). One waiter at a time is
   woken so (a device is synchronized from one thread); another one sees its value within poll_ns. */
static struct { unsigned long* done; unsigned long at; int waiters; } wake;
typedef void (*pp_command)(%(params)s);
void pp_worker(unsigned long* ring, unsigned long* wait_fn, unsigned long* done, unsigned long sem) {
  int (*wait)(void*) = (int (*)(void*))wait_fn[0];
  for (unsigned long cur = 0;; cur++) {
    while (wait((void*)sem) != 0) {}
    unsigned long* e = ring + (cur %% %(slots)d) * %(cmd)d;
    ((pp_command)e[0])(%(args)s);
    __atomic_store_n(done, cur + 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&wake.waiters, __ATOMIC_SEQ_CST) && __atomic_load_n(&wake.done, __ATOMIC_SEQ_CST) == done
        && cur + 1 >= __atomic_load_n(&wake.at, __ATOMIC_SEQ_CST))
      fwake((int*)done);
  }
}

/* Sleeps until *done >= value (returns 0), woken by pp_worker, re-reading it at least every poll_ns; returns 1
   after hang_ns without progress. */
int pp_wait_done(unsigned long* done, unsigned long value, long poll_ns, long hang_ns) {
  unsigned long seen = __atomic_load_n(done, __ATOMIC_ACQUIRE), v;
  long since = now_ns();
  struct timespec poll = { poll_ns / 1000000000L, poll_ns %% 1000000000L };
  __atomic_store_n(&wake.at, value, __ATOMIC_SEQ_CST);
  __atomic_store_n(&wake.done, done, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&wake.waiters, 1, __ATOMIC_SEQ_CST);
  while ((v = __atomic_load_n(done, __ATOMIC_SEQ_CST)) < value) {
    if (v != seen) { seen = v; since = now_ns(); }
    else if (now_ns() - since > hang_ns) break;
    syscall(SYS_futex, (int*)done, FUTEX_WAIT_PRIVATE, (int)(unsigned int)v, &poll, NULL, 0);
  }
  __atomic_sub_fetch(&wake.waiters, 1, __ATOMIC_SEQ_CST);
  return v < value;
}

void pp_pool_free(struct pp_pool* p) {
  __atomic_store_n(&p->stop, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&p->gen, 1, __ATOMIC_SEQ_CST);
  fwake(&p->gen);
  for (long i = 0; i < p->helpers; i++) pthread_join(p->threads[i], NULL);
  free(p);
}
"""


def library_source() -> str:
    from tinygrad.runtime.ops_cpu import CMD_SIZE, RING_SLOTS
    pool = POOL_C % {"max": MAX_THREADS, "slots": RING_SLOTS, "cmd": CMD_SIZE,
                     "params": ", ".join(["unsigned long"] * (CMD_SIZE - 1)),
                     "args": ", ".join(f"e[{i}]" for i in range(1, CMD_SIZE))}
    return "\n".join((JOB_C, pool, cpu_matvec.work_source(), cpu_attention.work_source()))


FLAGS = ("-shared", "-O2", "-fPIC", "-fno-math-errno", "-pthread")


def _arch_flags() -> list[str]:
    return ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64") else ["-mcpu=native"]


def _cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("model name", "Model"))), "")


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled library (once per machine: kept beside tinygrad's cache, keyed by its source, the compiler,
    the flags and the CPU, so any change is a new file and never a stale one)."""
    source, compiler = library_source(), getenv("CC", "clang")  # tinygrad's own setting for its compiler
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join((source, version, *FLAGS, *_arch_flags(), _cpu_name())).encode()).hexdigest()[:24]
    folder = Path(CACHEDB).parent / "pp-cpu"
    path = folder / f"threads-{key}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # then renamed: concurrent boots never see half a file
            built = Path(tmp) / "lib.so"
            subprocess.run([compiler, *FLAGS, *_arch_flags(), "-x", "c", "-", "-o", str(built)], input=source,
                           text=True, check=True, capture_output=True)
            os.replace(built, path)
    lib = ctypes.CDLL(str(path))
    lib.pp_pool_new.restype, lib.pp_pool_new.argtypes = ctypes.c_void_p, [ctypes.c_long, ctypes.c_long]
    lib.pp_run.restype, lib.pp_run.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p]
    lib.pp_pool_free.restype, lib.pp_pool_free.argtypes = None, [ctypes.c_void_p]
    lib.pp_wait_done.restype = ctypes.c_int
    lib.pp_wait_done.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_long, ctypes.c_long]
    lib.pp_worker.restype, lib.pp_worker.argtypes = None, [ctypes.c_uint64] * 4
    return lib


class CpuThreads:
    """`threads` threads (the caller's and threads - 1 helpers) for the hand-written kernels of one process.
    `table` is the device buffer a trampoline reads: pp_run, the pool, then each work function (`slot`)."""

    def __init__(self, threads: int, spin_ns: int = SPIN_NS):
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be 1..{MAX_THREADS}, got {threads}")
        lib = library()
        self.threads = threads
        self.pool = pool = lib.pp_pool_new(threads - 1, spin_ns)
        if not pool:
            raise OSError(f"could not start {threads - 1} compute threads")
        self._names = (*cpu_matvec.WORK, *cpu_attention.WORK)
        addresses = [ctypes.cast(lib.pp_run, ctypes.c_void_p).value, pool]
        addresses += [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in self._names]
        self.table = Tensor(np.array(addresses, dtype=np.uint64), dtype=dtypes.uint64).realize()

    def close(self) -> None:
        """Stops the helpers (tests; a node's pool lives as long as its process). No job may be running."""
        if self.pool:
            library().pp_pool_free(self.pool)
            self.pool = None

    def slot(self, work: str) -> int:
        """The table index of the work function named `work`."""
        return 2 + self._names.index(work)


@functools.cache
def shared(threads: int) -> CpuThreads:
    """One pool per thread count per process: stages in one process share it (their kernels run one at a time
    on the device's worker thread, and pp_run runs a second concurrent job alone)."""
    return CpuThreads(threads)

