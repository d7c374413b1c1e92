"""A captured graph replayed with its inputs taken once (worker/compute/replay.py): the same answers as the
jit's own call, new data in the same tensors seen, other tensors run as the jit runs them; the graph's
arguments resolved once per call and inputs."""
from __future__ import annotations

import numpy as np
import tinygrad.engine.realize as realize
from tinygrad import Tensor, TinyJit

from worker.compute import replay as replay_module
from worker.compute.host_io import write as _write
from worker.compute.replay import Replay


def _prefix_sum(x: Tensor, n) -> Tensor:
    return (x[:n].sum().reshape(1) + 0).contiguous().realize()


def _tensor(values) -> Tensor:
    t = Tensor.zeros(len(values)).contiguous().realize()
    _write(t, np.asarray(values, dtype=np.float32))
    return t


def test_replays_answer_as_the_jit_does_at_every_value_of_the_variable():
    x = _tensor(range(8))
    replay = Replay(TinyJit(_prefix_sum), {"n": (1, 8)})
    got = [replay(x, n=n).numpy()[0] for n in (3, 5, 8, 1, 7, 3)]  # the first calls capture, the rest replay
    assert got == [3, 10, 28, 0, 21, 3]
    assert replay.jit.captured is not None


def test_data_written_into_the_same_tensor_is_what_a_replay_reads():
    x = _tensor(range(8))
    replay = Replay(TinyJit(_prefix_sum), {"n": (1, 8)})
    for n in (2, 2, 2):
        replay(x, n=n)
    _write(x, np.full(8, 2.0, dtype=np.float32))
    assert replay(x, n=4).numpy()[0] == 8


def test_another_tensor_goes_through_the_jit():
    x, other = _tensor(range(8)), _tensor([1.0] * 8)
    replay = Replay(TinyJit(_prefix_sum), {"n": (1, 8)})
    for n in (2, 3, 4):
        replay(x, n=n)
    assert replay(other, n=5).numpy()[0] == 5  # the jit takes its buffer
    assert replay(x, n=4).numpy()[0] == 6  # and back


def test_a_replay_resolves_its_graph_s_arguments_once_and_answers_as_before(monkeypatch):
    replay_module.install()
    resolved = []
    resolve = realize.resolve_params
    monkeypatch.setattr(realize, "resolve_params", lambda call, inputs: resolved.append(call) or resolve(call, inputs))
    x, other = _tensor(range(8)), _tensor([1.0] * 8)
    replay = Replay(TinyJit(_prefix_sum), {"n": (1, 8)})
    for n in (2, 3, 4):  # capture
        replay(x, n=n)
    resolved.clear()
    assert [replay(x, n=n).numpy()[0] for n in (5, 8, 1)] == [10, 28, 0]
    assert resolved == []  # each of the graph's calls as the first replay left it
    assert replay(other, n=5).numpy()[0] == 5 and replay(x, n=4).numpy()[0] == 6  # another tensor, and back
