"""The stage's compute, on one dedicated OS thread, so that HTTP and gossip keep answering while a stage computes.

tinygrad's state (compiled kernels, JIT caches, the KV cache's buffers) must stay on the thread that made it,
and trio.to_thread's thread cache promises no thread in particular; hence one thread of our own, fed through
a queue, running jobs strictly one after another in submission order.

Cancellation: a running job cannot be interrupted. If the task awaiting `call` is cancelled, a job that has
not started yet is skipped; one that has started runs to its end on the thread, its result is discarded
(an exception it raises is logged, not lost), and the next job waits for it like any other.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import outcome
import trio

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_STOP_TIMEOUT_S = 10.0
_STOP = object()  # the queue's end marker


class _Job:
    """One call: the function, its outcome, and the hand-over between the trio thread and the compute thread."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, token: trio.lowlevel.TrioToken):
        self._fn, self._args, self._kwargs, self._token = fn, args, kwargs, token
        self._lock = threading.Lock()  # orders "started" against "abandoned", which two threads set
        self._started = self._abandoned = False
        self.done = trio.Event()
        self.result: outcome.Outcome | None = None

    def run(self) -> None:
        """On the compute thread: run the function unless its caller already gave up, then report to trio."""
        with self._lock:
            if self._abandoned:
                return
            self._started = True
        self.result = outcome.capture(self._fn, *self._args, **self._kwargs)
        try:
            self._token.run_sync_soon(self._finish)
        except trio.RunFinishedError:
            pass  # the trio run is over: nobody is left to tell

    def abandon(self) -> None:
        """On the trio thread, when the caller stops waiting: skip the job if it has not started."""
        with self._lock:
            self._abandoned = True

    def _finish(self) -> None:
        # Runs on the trio thread, as does abandon(), so this check cannot race with the caller.
        if self._abandoned and isinstance(self.result, outcome.Error):
            log.warning("compute job %s of a cancelled caller failed", _name_of(self._fn), exc_info=self.result.error)
        self.done.set()


def _name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


class ComputeThread:
    """Runs functions on its one thread, in the order `call` was awaited. Make it with `open_compute_thread`."""

    def __init__(self, name: str, token: trio.lowlevel.TrioToken):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._token = token
        self._closed = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    async def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` on the compute thread; return its result or raise its exception here."""
        # A caller cancelled by the same shutdown that closed the thread hears of its cancellation, not of the
        # closure (several nodes in one process share a thread that may close before they have stopped).
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise trio.ClosedResourceError(f"compute thread {self.thread.name!r} is closed")
        job = _Job(fn, args, kwargs, self._token)
        self._jobs.put(job)
        try:
            await job.done.wait()
        finally:
            if not job.done.is_set():  # cancelled (or otherwise gone) while waiting
                job.abandon()
        assert job.result is not None  # done is set only after the result
        return job.result.unwrap()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            job.run()

    async def _stop(self, timeout_s: float) -> None:
        self._closed = True
        self._jobs.put(_STOP)
        # join() blocks, so it waits in a trio worker thread. Shielded, so that stopping also works when the
        # block around us was cancelled; bounded, because a job that never returns would otherwise hang the
        # exit. The thread is a daemon: a stuck one dies with the process.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.thread.join, timeout_s)
        if self.thread.is_alive():
            log.warning("compute thread %r did not stop within %s s (a job is still running); leaving it behind",
                        self.thread.name, timeout_s)


@asynccontextmanager
async def open_compute_thread(name: str = "compute", *,
                              stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> AsyncIterator[ComputeThread]:
    """Start the compute thread; on exit, let queued jobs finish and stop it, waiting at most `stop_timeout_s`
    (without blocking trio) before leaving a stuck thread behind."""
    compute = ComputeThread(name, trio.lowlevel.current_trio_token())
    compute.thread.start()
    try:
        yield compute
    finally:
        await compute._stop(stop_timeout_s)
