"""The hand-written CPU kernels for F32 and packed Q8_0 and Q4_1 weights (worker/compute/cpu_matvec.py): x @ W.T of
the widened weights within float-summation tolerance, and each row's result the same bits whatever rows
share its step (batched decode equals solo)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tinygrad import Tensor

from ggufmake import quantize
from worker.compute import cpu_matvec, cpu_threads
from worker.weights.packed import Packed, aligned

QTYPE = {"q8_0": Q.Q8_0, "q4_1": Q.Q4_1}
SCALE_BYTES = {"q8_0": 2, "q4_1": 4}


def packed(kind: str, w: np.ndarray) -> Packed:
    if kind == "f32":
        return Packed("f32", (aligned(w),))
    blocks = quantize(w, QTYPE[kind]).view(np.uint8).reshape(w.shape[0], w.shape[1] // 32, -1)
    head = SCALE_BYTES[kind]
    q = aligned(blocks[:, :, head:])
    return Packed(kind, (q.view(np.int8) if kind == "q8_0" else q, aligned(blocks[:, :, :head]).view(np.float16)))


def run(kind: str, p: Packed, x: np.ndarray, threads: int = 1) -> np.ndarray:
    parts = tuple(Tensor(a) for a in cpu_matvec.device_parts(kind, p.parts))
    return cpu_matvec.matvec(Tensor(x), kind, parts, p.shape, cpu_threads.shared(threads)).numpy()


@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_1"])
@pytest.mark.parametrize("rows, out, inp", [(1, 40, 64), (3, 7, 96), (5, 64, 32)])
def test_the_kernel_is_x_times_the_widened_weight(kind, rows, out, inp):
    rng = np.random.default_rng(rows * out + inp)
    w = rng.standard_normal((out, inp)).astype(np.float32) + 0.5  # a nonzero mean exercises Q4_1's min
    x = rng.standard_normal((rows, inp)).astype(np.float32)
    p = packed(kind, w)
    want = x.astype(np.float64) @ p.widened().astype(np.float64).T
    got = run(kind, p, x)
    assert got.shape == (rows, out) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * inp * np.abs(x).max() * np.abs(w).max())


@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_1"])
def test_a_row_gives_the_same_bits_alone_or_among_others(kind):
    rng = np.random.default_rng(7)
    p = packed(kind, rng.standard_normal((24, 128)).astype(np.float32))
    x = rng.standard_normal((4, 128)).astype(np.float32)
    together = run(kind, p, x)
    for i in range(4):
        assert np.array_equal(run(kind, p, x[i:i + 1].copy())[0].view(np.uint32), together[i].view(np.uint32))


@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_1"])
@pytest.mark.parametrize("rows, out", [(1, 40), (11, 97), (16, 3)])
def test_every_thread_count_gives_the_same_bits(kind, rows, out):
    rng = np.random.default_rng(rows + out)
    p = packed(kind, rng.standard_normal((out, 96)).astype(np.float32) + 0.5)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    alone = run(kind, p, x, threads=1).view(np.uint32)
    for threads in (2, 3, 5):
        assert np.array_equal(run(kind, p, x, threads).view(np.uint32), alone), threads
