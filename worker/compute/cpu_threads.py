"""A step's big kernels on several cores: a pool of C threads that the hand-written CPU kernels hand work to.

tinygrad 0.14 runs every CPU kernel on one worker thread per device, and its `core_id` slices one after
another (../shared/notes/pipeline-speed.md), so a stage computed on one core. Here the matrices and the
attention (cpu_matvec.py, cpu_attention.py) live in a shared library of our own, compiled once per machine
(cpu_build.py) with tinygrad's optimisation and target flags (-O2, -march=native, or PP_CPU_TARGET's CPU) as an
ordinary shared object (it starts threads and sleeps on futexes), and the tinygrad kernel in the captured step
is only a trampoline: it fills a job (the work function, its buffers and sizes) and calls `pp_run`, which cuts the
job's items (a matrix's output rows, attention's row × head pairs) into CHUNKS contiguous chunks per thread
that the calling thread (tinygrad's worker) and the helpers claim one at a time, and waits for the last.
Every output is computed by the same code in the same order whatever chunk or thread holds it, so a step's
results are the same bits at every thread count; `threads=1` runs the whole job on the calling thread.

Chunks, not one range per thread: on a shared VM the hypervisor takes a vCPU away for milliseconds (a quarter
of the time with both of this box's busy), and a helper woken from sleep starts late; with fixed halves the
step waited at every matrix for the slow half (`bench.step`, docs/benchmarks.md).

Helpers spin while the device is busy (a command or a job started within SPIN_NS) and sleep on a futex
otherwise, so an idle stage burns nothing; the device's worker loop wakes them as a step's first kernels
start. A second caller arriving while a job runs (two devices in one process) runs its job alone rather than
wait.

The library also holds the CPU device's worker loop and the wait for it (`pp_worker`, `pp_wait_done`), which
device_wait.py installs so that a step's end wakes its reader.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
from tinygrad import Tensor, dtypes

from . import cpu_attention, cpu_build, cpu_matvec, cpu_target
from .cpu_jobs import JOB_C
from ..config import MAX_THREADS
# How long a helper polls for its next job after the device was last busy, and the caller for the others to
# finish, before it sleeps: the gaps between a step's big kernels are its small ones, tens of microseconds;
# between steps a helper sleeps, and the next step's first command wakes it.
SPIN_NS = 200_000
# Chunks a job is cut into per thread, claimed by whichever thread is free: enough that a thread the OS or the
# hypervisor stalls holds up a join by a small part of the job, few enough that claiming stays cheap (one
# compare-and-swap per chunk; at most 65535 chunks a job).
CHUNKS = 8

POOL_C = r"""%(libc)s

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

/* The device's pulse: when a command or a job last started (`active_ns`), and a word every sleeping helper
   of every pool waits on (`epoch`), bumped to wake them. A helper spins while the device was active within
   spin_ns, not for spin_ns after its own last job: on a VM a descheduled helper came back to an expired
   deadline and slept mid-step, and a futex wake of an idle vCPU goes through the hypervisor (issue 38). */
static struct { long active_ns; int epoch, sleepers; } pulse;
static void touch(void) {
  __atomic_store_n(&pulse.active_ns, now_ns(), __ATOMIC_RELAXED);
  if (__atomic_load_n(&pulse.sleepers, __ATOMIC_SEQ_CST)) {
    __atomic_add_fetch(&pulse.epoch, 1, __ATOMIC_SEQ_CST);
    fwake(&pulse.epoch);
  }
}

struct pp_pool {
  int gen, done, waiting, busy, stop;
  unsigned long ticket;  /* the job's generation (high 32 bits), its chunk count (16) and the next chunk (16) */
  long helpers, spin_ns;
  const struct pp_job* job;
  pthread_t threads[%(max)d];
};

/* Waits until *word differs from old: spinning while the device is active (pulse), asleep otherwise until a
   pulse or a job wakes it. The waker bumps *word before it reads the sleepers, the sleeper counts itself
   before it reads *word, so one of them sees the other. */
static int wait_change(int* word, int old, long spin_ns) {
  int v;
  for (;;) {
    for (long i = 0;; i++) {
      if ((v = __atomic_load_n(word, __ATOMIC_ACQUIRE)) != old) return v;
      relax();
      if (!(i & 63) && now_ns() - __atomic_load_n(&pulse.active_ns, __ATOMIC_RELAXED) > spin_ns) break;
    }
    int epoch = __atomic_load_n(&pulse.epoch, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&pulse.sleepers, 1, __ATOMIC_SEQ_CST);
    if ((v = __atomic_load_n(word, __ATOMIC_SEQ_CST)) == old) fwait(&pulse.epoch, epoch);
    __atomic_sub_fetch(&pulse.sleepers, 1, __ATOMIC_SEQ_CST);
    if (v != old) return v;
  }
}

/* Claims and runs chunks of the posted job until none is left; returns how many it ran. A chunk is claimed by
   advancing the ticket only while it still names the job read with it: a thread late for a job (asleep, or
   its vCPU taken by the hypervisor) finds the ticket moved on and touches nothing, and whoever is running
   does the chunks it would have done, so a join waits for at most one chunk in flight, never for half a job.
   Chunk c is the items items*c/chunks .. items*(c+1)/chunks - 1, whichever thread runs it. */
static int run_chunks(struct pp_pool* p) {
  int ran = 0;
  unsigned long t = __atomic_load_n(&p->ticket, __ATOMIC_ACQUIRE);
  for (;;) {
    const struct pp_job* j = __atomic_load_n(&p->job, __ATOMIC_ACQUIRE);
    unsigned long chunks = (t >> 16) & 0xFFFF, c = t & 0xFFFF;
    if (c >= chunks) return ran;
    if (!__atomic_compare_exchange_n(&p->ticket, &t, t + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
    long lo = j->items * c / chunks, hi = j->items * (c + 1) / chunks;
    if (lo < hi) j->fn(j, lo, hi);
    ran++;
    t++;
    if (__atomic_add_fetch(&p->done, 1, __ATOMIC_SEQ_CST) == (int)chunks && __atomic_load_n(&p->waiting, __ATOMIC_SEQ_CST))
      fwake(&p->done);
  }
}

static void* helper(void* a) {
  struct pp_pool* p = a;
  int seen = 0;
  for (;;) {
    seen = wait_change(&p->gen, seen, p->spin_ns);
    if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return NULL;
    if (run_chunks(p)) __atomic_store_n(&pulse.active_ns, now_ns(), __ATOMIC_RELAXED);  /* a job's end is activity too */
  }
}

/* The caller, its own chunks done, waits for the chunks still running on other threads. */
static void wait_done(struct pp_pool* p, int chunks) {
  long deadline = 0;
  for (long i = 0; spinning(i, &deadline, p->spin_ns); i++) {
    if (__atomic_load_n(&p->done, __ATOMIC_ACQUIRE) == chunks) return;
    relax();
  }
  __atomic_store_n(&p->waiting, 1, __ATOMIC_SEQ_CST);
  int v;
  while ((v = __atomic_load_n(&p->done, __ATOMIC_SEQ_CST)) != chunks) fwait(&p->done, v);
  __atomic_store_n(&p->waiting, 0, __ATOMIC_SEQ_CST);
}

void pp_run(struct pp_pool* p, const struct pp_job* j) {
  if (p->helpers == 0 || j->items < 2 || __atomic_exchange_n(&p->busy, 1, __ATOMIC_ACQ_REL)) {
    j->fn(j, 0, j->items);
    return;
  }
  long most = (p->helpers + 1) * %(chunks)d;
  int chunks = (int)(j->items < most ? j->items : most);
  unsigned long gen = (unsigned long)(unsigned int)(__atomic_load_n(&p->gen, __ATOMIC_RELAXED) + 1);
  __atomic_store_n(&p->job, j, __ATOMIC_RELEASE);
  __atomic_store_n(&p->done, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&p->ticket, gen << 32 | (unsigned long)chunks << 16, __ATOMIC_SEQ_CST);
  __atomic_store_n(&p->gen, (int)gen, __ATOMIC_SEQ_CST);
  touch();
  run_chunks(p);
  wait_done(p, chunks);
  __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
}

struct pp_pool* pp_pool_new(long helpers, long spin_ns) {
  if (helpers < 0 || helpers >= %(max)d) return NULL;
  struct pp_pool* p = calloc(1, sizeof(struct pp_pool));
  if (!p) return NULL;
  p->helpers = helpers;
  p->spin_ns = spin_ns;
  for (long i = 0; i < helpers; i++) {
    if (pthread_create(&p->threads[i], NULL, helper, p)) { p->helpers = i; return NULL; }
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
    touch();  /* a command is starting: helpers asleep since the last step wake while its first kernels run */
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
  touch();
  for (long i = 0; i < p->helpers; i++) pthread_join(p->threads[i], NULL);
  free(p);
}
"""


# What the pool takes from Linux and its C library, declared here rather than included: the source then needs no
# system headers, so one clang builds it for any target, aarch64 included, with nothing else installed
# (tests/test_cpu_targets.py). These are the Linux ABI's values on both 64-bit targets (glibc's and musl's
# pthread_t is one word there); only the futex syscall's number differs.
LIBC_C = r"""typedef unsigned long pthread_t;
int pthread_create(pthread_t*, const void*, void* (*)(void*), void*);
int pthread_join(pthread_t, void**);
void* calloc(unsigned long, unsigned long);
void free(void*);
long syscall(long, ...);
struct timespec { long tv_sec, tv_nsec; };
int clock_gettime(int, struct timespec*);
#define CLOCK_MONOTONIC 1
#define FUTEX_WAIT_PRIVATE 128
#define FUTEX_WAKE_PRIVATE 129
#define INT_MAX 2147483647
#define NULL ((void*)0)
#if defined(__x86_64__)
#define SYS_futex 202
#elif defined(__aarch64__)
#define SYS_futex 98
#else
#error "pp's CPU kernels are built for x86-64 and aarch64 Linux only"
#endif"""


def library_source() -> str:
    from tinygrad.runtime.ops_cpu import CMD_SIZE, RING_SLOTS
    pool = POOL_C % {"libc": LIBC_C, "max": MAX_THREADS, "chunks": CHUNKS, "slots": RING_SLOTS, "cmd": CMD_SIZE,
                     "params": ", ".join(["unsigned long"] * (CMD_SIZE - 1)),
                     "args": ", ".join(f"e[{i}]" for i in range(1, CMD_SIZE))}
    return "\n".join((JOB_C, pool, cpu_matvec.work_source(), cpu_attention.work_source()))


FLAGS = ("-shared", "-O2", "-fPIC", "-fno-math-errno", "-pthread")  # tinygrad's, plus a shared object's
_LIBRARIES: dict[str, ctypes.CDLL | cpu_build.KernelBuildError] = {}


def library(target: str = cpu_target.NATIVE) -> ctypes.CDLL:
    """The library compiled for `target` (cpu_build.py); KernelBuildError, the same one each call, where it
    cannot be."""
    if target not in _LIBRARIES:
        try:
            _LIBRARIES[target] = _loaded(ctypes.CDLL(str(cpu_build.build(library_source(), target, FLAGS))))
        except cpu_build.KernelBuildError as exc:
            _LIBRARIES[target] = exc
    found = _LIBRARIES[target]
    if isinstance(found, cpu_build.KernelBuildError):
        raise found
    return found


def _loaded(lib: ctypes.CDLL) -> ctypes.CDLL:
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

    def __init__(self, threads: int, spin_ns: int = SPIN_NS, target: str = cpu_target.NATIVE):
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be 1..{MAX_THREADS}, got {threads}")
        self.lib = lib = library(target)
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
            self.lib.pp_pool_free(self.pool)
            self.pool = None

    def slot(self, work: str) -> int:
        """The table index of the work function named `work`."""
        return 2 + self._names.index(work)


@functools.cache
def shared(threads: int, target: str = cpu_target.NATIVE) -> CpuThreads:
    """One pool per thread count and target per process: stages in one process share it (their kernels run one
    at a time on the device's worker thread, and pp_run runs a second concurrent job alone)."""
    return CpuThreads(threads, target=target)

