import numpy as np
import pytest

from worker.sampling import GREEDY, Sampling, sample


def test_greedy_takes_the_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert sample(logits, GREEDY, np.random.default_rng(0)) == 1


def test_temperature_sampling_is_reproducible_from_its_seed():
    logits = np.linspace(0, 1, 50, dtype=np.float32)
    s = Sampling(temperature=1.0, seed=7)
    draws = lambda: [sample(logits, s, rng) for rng in [np.random.default_rng(s.seed)] for _ in range(20)]
    assert draws() == draws()
    assert len(set(draws())) > 1  # it does sample, not argmax


def test_small_top_p_keeps_only_the_most_likely_token():
    logits = np.array([1.0, 5.0, 4.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert {sample(logits, Sampling(temperature=2.0, top_p=0.01), rng) for _ in range(50)} == {1}


def test_top_p_never_draws_outside_the_nucleus():
    # probabilities ~ [0.5, 0.25, 0.125, 0.125]; top_p 0.7 keeps the first two
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125]))
    rng = np.random.default_rng(1)
    assert {sample(logits, Sampling(temperature=1.0, top_p=0.7), rng) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_sampling_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        Sampling(**kwargs)
