"""The compute thread: one OS thread for every job, strict order, and a trio loop that keeps running meanwhile.

Jobs block on threading.Events that the test sets, so nothing depends on how fast the machine is; the
timeouts on those waits only bound a failing test.
"""
import logging
import threading

import pytest
import trio
import trio.testing

from node.compute import open_compute_thread

BOUND_S = 5.0  # how long a broken test may hang before it fails


def blocked_job(started: threading.Event, gate: threading.Event, log: list, label: str):
    """A job that says it started, then holds the thread until the test opens the gate."""
    def job():
        started.set()
        opened = gate.wait(BOUND_S)
        log.append(label)
        return opened
    return job


async def wait_for(flag: threading.Event) -> None:
    # Waits in a trio worker thread, not the compute thread, so the compute thread stays free.
    assert await trio.to_thread.run_sync(flag.wait, BOUND_S), "the job never started"


async def cancel_once_started(compute, job, started: threading.Event) -> None:
    """Call `job`, and cancel that caller as soon as the job is running on the compute thread."""
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            inner.start_soon(compute.call, job)
            await wait_for(started)
            scope.cancel()
    assert scope.cancelled_caught


async def test_every_call_runs_on_the_same_thread_which_is_not_trios():
    async with open_compute_thread() as compute:
        idents = {await compute.call(threading.get_ident) for _ in range(5)}
        names = {await compute.call(lambda: threading.current_thread().name) for _ in range(2)}
    assert len(idents) == 1
    assert idents != {threading.get_ident()}
    assert names == {"compute"}


async def test_results_and_arguments_travel_both_ways():
    async with open_compute_thread() as compute:
        assert await compute.call(divmod, 17, 5) == (3, 2)
        assert await compute.call(sorted, [3, 1, 2], reverse=True) == [3, 2, 1]


async def test_a_jobs_exception_is_raised_in_the_caller_and_later_calls_still_work():
    def fails():
        raise KeyError("no such block")

    async with open_compute_thread() as compute:
        with pytest.raises(KeyError, match="no such block"):
            await compute.call(fails)
        assert await compute.call(len, "abc") == 3


async def test_jobs_run_in_submission_order(nursery):
    started, gate, ran = threading.Event(), threading.Event(), []
    async with open_compute_thread() as compute:
        nursery.start_soon(compute.call, blocked_job(started, gate, ran, "first"))
        await wait_for(started)
        for i in range(8):
            nursery.start_soon(compute.call, ran.append, i)
            await trio.testing.wait_all_tasks_blocked()  # that caller has queued its job and waits
        gate.set()
        await compute.call(ran.append, "last")
    assert ran == ["first", *range(8), "last"]


async def test_trio_keeps_running_other_tasks_while_a_job_blocks_the_compute_thread(nursery):
    started, gate, ran = threading.Event(), threading.Event(), []
    results = []

    async def caller(compute):
        results.append(await compute.call(blocked_job(started, gate, ran, "job")))

    async with open_compute_thread() as compute:
        nursery.start_soon(caller, compute)
        await wait_for(started)
        ticks = 0
        for _ in range(20):
            await trio.sleep(0.001)
            ticks += 1
        assert ticks == 20 and ran == [] and results == []  # the loop ran while the job was still blocked
        gate.set()
        await compute.call(int)  # returns once the blocked job is done
    assert results == [True]  # the gate opened from the test, not by the job's timeout


async def test_a_caller_cancelled_mid_job_lets_the_job_finish_before_the_next_one(nursery):
    started, gate, ran = threading.Event(), threading.Event(), []
    async with open_compute_thread() as compute:
        await cancel_once_started(compute, blocked_job(started, gate, ran, "cancelled"), started)
        assert ran == []  # the caller is gone, the job still runs

        nursery.start_soon(compute.call, ran.append, "next")
        await trio.testing.wait_all_tasks_blocked()
        assert ran == []  # queued behind the job that is still running
        gate.set()
        assert await compute.call(len, "ok") == 2
    assert ran == ["cancelled", "next"]


async def test_a_job_whose_caller_was_cancelled_before_it_started_is_skipped(nursery):
    started, gate, ran = threading.Event(), threading.Event(), []
    async with open_compute_thread() as compute:
        nursery.start_soon(compute.call, blocked_job(started, gate, ran, "running"))
        await wait_for(started)
        with trio.CancelScope() as scope:
            scope.cancel()
            await compute.call(ran.append, "skipped")
        gate.set()
        await compute.call(ran.append, "after")
    assert ran == ["running", "after"]


async def test_a_failure_nobody_waits_for_any_more_is_logged(caplog):
    started, gate = threading.Event(), threading.Event()

    def fails_after_gate():
        started.set()
        gate.wait(BOUND_S)
        raise RuntimeError("kernel failed")

    async with open_compute_thread() as compute:
        await cancel_once_started(compute, fails_after_gate, started)
        gate.set()
        await compute.call(int)  # the failed job has finished and reported by now
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "node.compute"]
    assert len(warnings) == 1 and "fails_after_gate" in warnings[0].getMessage()
    assert isinstance(warnings[0].exc_info[1], RuntimeError)


async def test_exiting_the_block_stops_the_thread_and_refuses_later_calls():
    async with open_compute_thread(name="stage-compute") as compute:
        await compute.call(int)
        assert compute.thread.is_alive()
    assert not compute.thread.is_alive()
    with pytest.raises(trio.ClosedResourceError):
        await compute.call(int)


async def test_a_cancelled_caller_of_a_closed_thread_hears_it_was_cancelled_not_that_the_thread_closed():
    # nodes in one process share a thread, which their shared shutdown may close before a node has stopped
    async with open_compute_thread() as compute:
        pass
    with trio.CancelScope() as scope:
        scope.cancel()
        await compute.call(lambda: 1)
    assert scope.cancelled_caught


async def test_exiting_a_cancelled_block_still_waits_for_the_running_job_and_stops_the_thread():
    started, never = threading.Event(), threading.Event()

    def short_job():
        started.set()
        never.wait(0.2)  # finishes on its own, after the block below has begun to exit

    async with trio.open_nursery() as nursery:
        async with open_compute_thread(stop_timeout_s=BOUND_S) as compute:
            nursery.start_soon(compute.call, short_job)
            await wait_for(started)
            nursery.cancel_scope.cancel()
    assert not compute.thread.is_alive()


async def test_exit_does_not_hang_on_a_stuck_job_and_says_so(caplog):
    started, gate = threading.Event(), threading.Event()
    async with trio.open_nursery() as nursery:
        async with open_compute_thread(stop_timeout_s=0.1) as compute:
            nursery.start_soon(compute.call, blocked_job(started, gate, [], "stuck"))
            await wait_for(started)
            nursery.cancel_scope.cancel()  # the block exits while its job is stuck
    assert compute.thread.is_alive()  # left behind rather than waited for
    assert any("did not stop within 0.1 s" in r.getMessage() for r in caplog.records if r.name == "node.compute")
    gate.set()
    compute.thread.join(BOUND_S)
    assert not compute.thread.is_alive()
