"""The hand-written CPU attention (worker/compute/cpu_attention.py): each row attends to its own slot's cached
positions up to its own, equal to softmax attention in float64 within float tolerance, and the same bits
whatever rows share its step."""
import numpy as np
import pytest
from tinygrad import Tensor

from worker.compute import cpu_threads
from worker.compute.cpu_attention import attention

HEADS, KV_HEADS, HEAD_DIM, CONTEXT, SLOTS = 6, 2, 16, 40, 3


def run(q, cache, rows, threads=1, head_dim=HEAD_DIM):
    ints = np.array([[p for p, _ in rows], [s for _, s in rows], [s * CONTEXT + p for p, s in rows]], dtype=np.int32)
    return attention(Tensor(q), Tensor(cache), Tensor(ints), heads=HEADS, kv_heads=KV_HEADS, head_dim=head_dim,
                     max_context=CONTEXT, threads=cpu_threads.shared(threads)).numpy()


def reference(q, cache, rows):
    out = np.zeros(q.shape)
    for b, (pos, slot) in enumerate(rows):
        seen = cache[slot * CONTEXT: slot * CONTEXT + pos + 1].astype(np.float64)
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            k = seen[:, g * HEAD_DIM:(g + 1) * HEAD_DIM]
            v = seen[:, (KV_HEADS + g) * HEAD_DIM:(KV_HEADS + g + 1) * HEAD_DIM]
            scores = k @ q[b, h * HEAD_DIM:(h + 1) * HEAD_DIM] / np.sqrt(HEAD_DIM)
            p = np.exp(scores - scores.max())
            out[b, h * HEAD_DIM:(h + 1) * HEAD_DIM] = (p / p.sum()) @ v
    return out


@pytest.mark.parametrize("rows", [[(0, 0)], [(5, 1), (39, 2), (17, 1)], [(3, 0)] * 2 + [(4, 0)]],
                         ids=["first position", "slots and positions mixed", "one slot's consecutive rows"])
def test_each_row_attends_to_its_slots_positions_up_to_its_own(rows):
    rng = np.random.default_rng(len(rows))
    cache = 3 * rng.standard_normal((SLOTS * CONTEXT, 2 * KV_HEADS * HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((len(rows), HEADS * HEAD_DIM)).astype(np.float32)
    np.testing.assert_allclose(run(q, cache, rows), reference(q, cache, rows), rtol=1e-5, atol=1e-5)


def test_a_row_gives_the_same_bits_alone_or_among_others():
    rng = np.random.default_rng(9)
    cache = rng.standard_normal((SLOTS * CONTEXT, 2 * KV_HEADS * HEAD_DIM)).astype(np.float32)
    rows = [(7, 0), (30, 2), (12, 1), (0, 1)]
    q = rng.standard_normal((len(rows), HEADS * HEAD_DIM)).astype(np.float32)
    together = run(q, cache, rows)
    for i, row in enumerate(rows):
        assert np.array_equal(run(q[i:i + 1].copy(), cache, [row])[0].view(np.uint32), together[i].view(np.uint32))


@pytest.mark.parametrize("head_dim", [16, 64], ids=["a generic head size", "a specialised head size"])
def test_every_thread_count_gives_the_same_bits(head_dim):
    rng = np.random.default_rng(head_dim)
    cache = rng.standard_normal((SLOTS * CONTEXT, 2 * KV_HEADS * head_dim)).astype(np.float32)
    rows = [(7, 0), (30, 2), (12, 1), (0, 1), (39, 0)]
    q = rng.standard_normal((len(rows), HEADS * head_dim)).astype(np.float32)
    alone = run(q, cache, rows, 1, head_dim)
    for threads in (2, 3, 7):
        assert np.array_equal(run(q, cache, rows, threads, head_dim).view(np.uint32), alone.view(np.uint32)), threads
