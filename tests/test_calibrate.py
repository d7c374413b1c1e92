"""What a node measures of itself before it is given blocks (worker/calibrate.py, issue 37)."""
import time
from pathlib import Path

from worker.calibrate import _window, available_memory, calibrate
from worker.models import open_model, stub_model


def test_the_stub_reports_no_times_and_the_model_s_size():
    c = calibrate(stub_model(), max_seqs=4, memory_bytes=123)
    assert (c.block_s, c.head_s, c.rows, c.memory_bytes) == (None, None, 4, 123)  # rows: at most the slots
    assert c.model.blocks == stub_model().total_blocks


def test_a_real_model_s_block_and_head_are_timed_and_weighed(tmp_path: Path):
    model = open_model("tiny", cache_dir=tmp_path, ollama_models_dir=None, progress=False)
    c = calibrate(model, max_seqs=8, memory_bytes=None, window_s=0.02, windows=1)
    assert c.block_s > 0 and c.head_s >= 0 and c.rows == 8 and c.memory_bytes is None
    assert c.model.blocks == model.total_blocks
    # a block's bytes are its weights and its KV for every slot; the head's its matrix and norm
    one = model.open_slice(range(0, 1), embed=False, head=False, max_seqs=8)
    assert c.model.block_bytes == one.weight_bytes + one.kv_bytes
    assert c.model.head_bytes > 0 and c.model.embed_bytes == c.model.head_bytes


def test_a_window_counts_the_stalls_between_steps_not_just_the_fastest_step():
    # as a CPU quota does: bursts at full speed, then the process waits out the rest of its period
    calls = []

    def step():
        calls.append(1)
        time.sleep(0.02 if len(calls) % 4 == 0 else 0.001)
    tally = [0.0, 0]
    _window(step, 0.1, tally)
    assert tally[1] == len(calls) >= 2
    assert tally[0] / tally[1] > 0.005  # the mean over the window; the fastest step took ~1 ms


def test_the_memory_a_node_may_fill_is_what_the_kernel_says_is_available():
    memory = available_memory()
    assert memory is None or memory > 0
