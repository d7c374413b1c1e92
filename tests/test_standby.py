"""Warm spares (`ppsmoke.py --seed --serve --standby K`, node/standby.py, runner/standby.py): what a standby
understands, how the runner keeps K of them, and a real cluster whose lost middle stage a spare takes; and a
frame refused by a stage that never knew its request, which is the request lost there (replayed), not failed."""
import os
import signal
from pathlib import Path

import attrs
import pytest
import trio

from node.standby import TakeRefused, take_of
from roles.liveness import refused_frame_ends
from roles.messages import Activation, ActivationMeta, EndReason, SegmentMeta
from runner.children import StageExited
from runner.standby import START_ATTEMPTS, Standbys
from test_chaos import Cluster, run_clients, text_of
from test_node_config import parse


# --- what a standby understands -----------------------------------------------------------------------------

@pytest.mark.parametrize("line, stage", [("take 1", 1), ("take 2\n", 2), ("  take 3 ", 3)])
def test_a_standby_takes_the_stage_its_runner_names(line, stage):
    assert take_of(line, 4) == stage


@pytest.mark.parametrize("line, message", [
    ("take 0", "not stage 0"), ("take 4", "1 .. 3"), ("take", "only `take <stage>`"), ("give 1", "only"),
    ("take one", "only"), ("take -1", "only"), ("take 1 2", "only"),
])
def test_anything_else_is_refused_naming_what_it_understands(line, message):
    with pytest.raises(TakeRefused, match=message):
        take_of(line, 4)


def test_a_standby_is_configured_without_a_stage_and_with_the_runner_on_its_stdin():
    cfg = parse({"PP_STANDBY": "1", "PP_STDIN_LIFELINE": "1"}, drop=("STAGE",))
    assert cfg.standby and cfg.stage == 1 and cfg.node_id.startswith("standby-")
    assert parse(argv=["--standby"], env_overrides={"PP_STDIN_LIFELINE": "1"}, drop=("STAGE",)).standby
    assert not parse().standby


@pytest.mark.parametrize("env, drop, message", [
    ({"PP_STANDBY": "1"}, ("STAGE",), "on its stdin (PP_STDIN_LIFELINE=1)"),
    ({"PP_STANDBY": "1", "PP_STDIN_LIFELINE": "1"}, (), "STAGE='1' with --standby"),
])
def test_a_standby_with_a_stage_or_no_runner_is_refused(capsys, env, drop, message):
    with pytest.raises(SystemExit) as info:
        parse(env, drop=drop)
    assert info.value.code == 2 and message in capsys.readouterr().err


# --- a frame refused where its request is unknown ---------------------------------------------------------------

def test_rows_refused_as_unknown_are_lost_there_for_stage_0_to_replay_and_other_refusals_fail():
    frame = Activation(ActivationMeta((SegmentMeta("a", 5, 1, generation=2), SegmentMeta("b", 9, 1))), b"\0" * 32)
    lost = refused_frame_ends(frame, 1, "unknown request", unknown=True)
    assert [(e.request_id, e.reason, e.generation, e.failed_stage) for e in lost] == [
        ("a", EndReason.LOST, 2, 1), ("b", EndReason.LOST, 0, 1)]
    assert {e.reason for e in refused_frame_ends(frame, 1, "bad rows")} == {EndReason.FAILED}


# --- the runner's spares ----------------------------------------------------------------------------------------

@attrs.define(eq=False)
class FakeSpare:
    place: int
    pid: int
    exited: trio.Event = attrs.field(factory=trio.Event)
    took: list = attrs.field(factory=list)

    @property
    def process(self):
        return self

    @property
    def log_path(self):
        return Path(f"standby{self.pid}.log")

    @property
    def returncode(self):
        return 1

    async def take(self, stage):
        self.took.append(stage)
        return ("child of", self.pid, stage)


class FakeStarts:
    """Standbys' `start`: each spare reported at once, or (from `failing`) a spare that ends before it is ready."""

    def __init__(self, failing=()):
        self.started, self.failing = [], list(failing)

    async def __call__(self, place, task_status=trio.TASK_STATUS_IGNORED):
        if self.failing and self.failing.pop(0):
            raise StageExited(None, 1, "    (log)")
        spare = FakeSpare(place, 100 + len(self.started))
        self.started.append(spare)
        task_status.started(spare)
        await spare.exited.wait()


async def test_a_spare_takes_a_lost_stage_and_another_is_started_in_its_place(autojump_clock):
    starts, said = FakeStarts(), []
    spares = Standbys(2, starts, said.append)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spares.run)
        await trio.sleep(1)
        first, second = spares.ready
        assert await spares.take(0) is None  # stage 0 is never a spare's
        assert await spares.take(2) == ("child of", first.pid, 2) and first.took == [2]
        await trio.sleep(1)
        assert [s.pid for s in spares.ready] == [second.pid, 102] and len(starts.started) == 3
        second.exited.set()  # a spare that ends while waiting is replaced too
        await trio.sleep(1)
        assert [s.pid for s in spares.ready] == [102, 103]
        assert any("exited with code 1; starting another" in line for line in said)
        nursery.cancel_scope.cancel()


async def test_the_next_spare_starts_only_once_the_replays_through_the_taken_one_are_over(autojump_clock):
    starts, said, settled = FakeStarts(), [], trio.Event()

    async def settles(child):
        assert child == ("child of", 100, 1)
        await settled.wait()

    spares = Standbys(1, starts, said.append, settled=settles)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spares.run)
        await trio.sleep(1)
        await spares.take(1)
        await trio.sleep(30)
        assert spares.ready == [] and len(starts.started) == 1  # the replays go on: no spare boots now
        settled.set()
        await trio.sleep(1)
        assert [s.pid for s in spares.ready] == [101]
        nursery.cancel_scope.cancel()


async def test_with_no_spare_ready_the_keeper_starts_a_process_and_spares_that_die_young_stop_being_started(
        autojump_clock):
    starts, said = FakeStarts(failing=[True] * START_ATTEMPTS), []
    spares = Standbys(1, starts, said.append)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spares.run)
        await trio.sleep(1)
        assert await spares.take(1) is None and starts.started == []
        assert f"{START_ATTEMPTS} spares in a row ended before they were ready" in said[-1]
        nursery.cancel_scope.cancel()


# --- a real cluster -----------------------------------------------------------------------------------------

def test_a_spare_takes_a_sigkilled_middle_stage_every_stream_ends_as_undisturbed_and_a_new_spare_follows(tmp_path):
    cluster = Cluster(tmp_path, n=3, args=("--standby", "1"))
    try:
        cluster.wait_line("standby 0 ready in", 180)
        undisturbed = [text_of(c) for c in run_clients(cluster)[0]]
        (_, pid), seen = cluster.holders()[1], len(cluster.lines())
        chunks, _ = run_clients(cluster, lambda: os.kill(pid, signal.SIGKILL))
        cluster.wait_line("stage 1: standby standby0 took it", 10, after=seen)
        cluster.wait_line("stage 1 replaced in", 10, after=seen)
        assert [text_of(c) for c in chunks] == undisturbed
        assert cluster.holders()[1][1] != pid and cluster.wait_idle() == [0, 0, 0]
        cluster.wait_line("standby 0 ready in", 180, after=seen)  # its successor, waiting for the next loss
    finally:
        cluster.stop()
