"""Batched steps on tinygrad: requests in one step get bit-identical logits to each run alone, whatever
bucket the step is padded to and whatever else shares it; the batch-size buckets and their defaults."""
import numpy as np
import pytest

from worker.batching import Segment, bucket_sizes, default_max_batch, split_rows, unmeasured_cost
from worker.models import tinygrad_model
from worker.weights.tiny import TinySource


@pytest.mark.parametrize("max_batch,want", [(1, (1,)), (2, (1, 2)), (4, (1, 2, 4)), (16, (1, 2, 4, 8, 16)),
                                            (12, (1, 2, 4, 8, 12))])
def test_buckets_double_up_to_the_largest_batch(max_batch, want):
    assert bucket_sizes(max_batch) == want


@pytest.mark.parametrize("max_seqs,want", [(1, 2), (2, 4), (3, 8), (8, 16), (9, 32)])
def test_a_step_has_room_for_a_decode_row_of_every_slot_and_as_many_prompt_rows(max_seqs, want):
    assert default_max_batch(max_seqs) == want >= 2 * max_seqs


PROMPTS = ("Say hello", "Name three rivers of Europe, briefly.", "x", "Why?")


@pytest.fixture(scope="module", params=[(1, "float32"), (2, "float32"), (2, "float16")],
                ids=lambda p: f"{p[0]} thread(s), {p[1]} KV")
def model(request):
    """The tiny model with its steps on one thread, then split over two (worker/compute/cpu_threads.py), with
    each KV cache dtype (--kv-cache-dtype)."""
    threads, kv_dtype = request.param
    return tinygrad_model(TinySource(), threads=threads, kv_dtype=kv_dtype)


def test_two_threads_give_one_threads_logits_bit_for_bit():
    one, two = tinygrad_model(TinySource(), threads=1), tinygrad_model(TinySource(), threads=2)
    for ids in [one.tokenizer().encode_chat(p) for p in PROMPTS]:
        assert all(np.array_equal(a, b) for a, b in zip(alone(one, ids, 4), alone(two, ids, 4)))


@pytest.fixture(scope="module")
def prompts(model):
    tok = model.tokenizer()
    return [tok.encode_chat(p) for p in PROMPTS]


def alone(model, ids, steps):
    """Greedy logits of one request by itself: its prompt a token at a time, then decode."""
    s = model.open_slice(range(model.total_blocks), embed=True, head=True, max_seqs=1)
    logits = [s.forward(s.embed(ids), 0)]
    for i in range(steps):
        logits.append(s.forward(s.embed([int(np.argmax(logits[-1]))]), len(ids) + i))
    return logits


def test_a_batched_decode_step_gives_each_row_the_logits_it_gets_alone(model, prompts):
    want = [alone(model, ids, 6) for ids in prompts]
    s = model.open_slice(range(model.total_blocks), embed=True, head=True, max_seqs=4)
    # the prompts start in one step, in slots that are not their order, then decode side by side with
    # rows at different positions; one request drops out halfway so the later steps use smaller buckets
    slots = [3, 0, 2, 1]
    logits = s.forward_batch(np.concatenate([s.embed(ids) for ids in prompts]),
                             [Segment(slot, 0, len(ids)) for slot, ids in zip(slots, prompts)])
    live = list(range(len(prompts)))
    for step in range(6):
        for row, i in enumerate(live):
            assert np.array_equal(logits[row], want[i][step]), f"request {i}, step {step}"
        if step == 3:
            live, logits = live[1:], logits[1:]
        tokens = [int(np.argmax(row)) for row in logits]
        logits = s.forward_batch(np.concatenate([s.embed([t]) for t in tokens]),
                                 [Segment(slots[i], len(prompts[i]) + step, 1) for i in live])


def test_a_step_longer_than_the_largest_bucket_runs_as_several_steps(model, prompts):
    s = model.open_slice(range(2), embed=True, head=False, max_seqs=1)
    ids = prompts[1]
    assert len(ids) > s.max_batch
    whole = s.forward_batch(s.embed(ids), [Segment(0, 0, len(ids))])
    t = model.open_slice(range(2), embed=True, head=False, max_seqs=1)
    one_by_one = np.concatenate([t.forward(t.embed([x]), i) for i, x in enumerate(ids)])
    assert np.array_equal(whole, one_by_one)


def test_a_float16_cache_holds_half_the_bytes_and_its_answers_stay_near_float32_s():
    wide, half = tinygrad_model(TinySource(), kv_dtype="float32"), tinygrad_model(TinySource(), kv_dtype="float16")
    slices = [m.open_slice(range(2), embed=True, head=True, max_seqs=2) for m in (wide, half)]
    assert slices[1].kv_bytes * 2 == slices[0].kv_bytes
    for ids in [wide.tokenizer().encode_chat(p) for p in ("Say hello", "Why?")]:
        a, b = alone(wide, ids, 4), alone(half, ids, 4)
        assert not all(np.array_equal(x, y) for x, y in zip(a, b))  # the keys and values were rounded ...
        assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < 0.05  # ... to float16's precision


def test_off_the_cpu_attention_reads_a_float16_cache_as_the_cpu_kernel_does(monkeypatch):
    """What a GPU runs: tinygrad's own attention over the gathered keys and values, widened after the gather."""
    from worker.compute import model as compute_model
    ids = tinygrad_model(TinySource()).tokenizer().encode_chat("Say hello")
    want = alone(tinygrad_model(TinySource(), kv_dtype="float16"), ids, 4)
    init = compute_model.Block.__init__

    def tinygrad_attention(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.hand_written = False
    monkeypatch.setattr(compute_model.Block, "__init__", tinygrad_attention)
    got = alone(tinygrad_model(TinySource(), kv_dtype="float16"), ids, 4)
    assert [int(np.argmax(x)) for x in got] == [int(np.argmax(x)) for x in want]
    # the two attentions differ in summation order, as with float32 KV; a later block's keys and values
    # then round to neighbouring float16s here and there, so logits differ by float16's precision, not more
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, want)) < 0.05


@pytest.mark.parametrize("rows,cost,want", [
    (1, {1: 1.0, 2: 1.1, 4: 1.2}, [1]),
    (3, {1: 1.0, 2: 1.1, 4: 1.2}, [3]),  # one call padded to 4 beats 2 + 1
    (12, {4: 10.8, 8: 15.5, 16: 34.5}, [8, 4]),  # `small` on a CPU: 16 rows cost 2.2 calls of 8
    (12, {4: 2.0, 8: 2.2, 16: 2.5}, [12]),  # `tiny`: per-call overhead dominates, pad to 16
    (40, {8: 1.0, 16: 1.5}, [16, 16, 8]),
    (0, {1: 1.0}, []),
])
def test_a_step_is_cut_into_the_cheapest_graph_calls(rows, cost, want):
    got = split_rows(rows, cost)
    assert sorted(got, reverse=True) == want and sum(got) == rows


def test_before_buckets_are_timed_a_step_takes_the_fewest_calls():
    assert split_rows(12, unmeasured_cost((1, 4, 8, 16))) == [12]
    assert sorted(split_rows(40, unmeasured_cost((1, 4, 8, 16)))) == [8, 16, 16]
