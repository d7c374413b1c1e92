"""Logprobs as the API reports them: the log-softmax of the model's logits, the token's own and the top
alternatives, computed by the last stage from the logits it samples from."""
import math

import numpy as np
import pytest

from worker.logprobs import FLOOR, log_softmax, token_logprobs


def reference(row, token, n):
    """float64, written out: log p_i = x_i - log sum_j exp x_j; the top n by value, then by id."""
    m = max(row)
    total = math.log(sum(math.exp(v - m) for v in row)) + m
    lp = [v - total for v in row]
    top = sorted(range(len(row)), key=lambda i: (-lp[i], i))[:n]
    return lp[token], [(i, lp[i]) for i in top]


@pytest.mark.parametrize("seed,n", [(0, 0), (1, 1), (2, 5), (3, 20)])
def test_a_token_s_logprob_and_its_top_alternatives_match_the_formula(seed, n):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((3, 50)) * 4).astype(np.float32)
    tokens = rng.integers(0, 50, 3)
    for row, token, got in zip(logits, tokens, token_logprobs(logits, tokens, n)):
        want, want_top = reference(row.astype(np.float64).tolist(), int(token), n)
        assert got.token_id == token and got.logprob == pytest.approx(want, abs=1e-5)
        assert [i for i, _ in got.top] == [i for i, _ in want_top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want_top], abs=1e-5)


def test_equal_logits_rank_the_lower_id_first_at_the_cut():
    logits = np.array([1.0, 3.0, 3.0, 3.0, 0.0], dtype=np.float32)
    [got] = token_logprobs(logits[None], [4], 2)
    assert [i for i, _ in got.top] == [1, 2]


def test_large_logits_do_not_overflow():
    out = log_softmax(np.array([[1e4, 1e4 - 1.0, -1e4]], dtype=np.float32))
    assert np.isfinite(out).all() and out[0, 0] == pytest.approx(-math.log(1 + math.exp(-1)), abs=1e-5)


def test_a_masked_token_reports_the_floor_not_minus_infinity():
    logits = np.array([[0.0, -np.inf, 1.0]], dtype=np.float32)
    [got] = token_logprobs(logits, [1], 3)
    assert got.logprob == FLOOR and got.top[-1] == (1, FLOOR)
