"""The sampler against plain-python references of each formula (vLLM's v1 sampler is the model)."""
import math

import numpy as np
import pytest

from worker.contract import GREEDY, Sampling, StepItem
from worker.errors import WorkerError
from worker.models import open_worker, stub_model
from worker.partition import Shard
from worker.reference import generate_full
from worker.sampling import process_logits, sample, stop_set

LOGITS = np.array([2.0, -1.5, 0.0, 3.25, -0.5, 1.0, 0.75, -2.0], dtype=np.float32)


def processed(sampling, *, prompt_ids=(), output_ids=(), stop_ids=frozenset(), allowed=None, logits=LOGITS):
    return list(process_logits(logits, sampling, prompt_ids=prompt_ids, output_ids=output_ids,
                               stop_ids=stop_ids, allowed=allowed))


def draws(logits, sampling, n=400, **kwargs):
    rng = np.random.default_rng(sampling.seed)
    return [sample(logits, sampling, rng, **kwargs) for _ in range(n)]


def softmax(values):
    top = max(values)
    e = [math.exp(v - top) for v in values]
    return [v / sum(e) for v in e]


def old_sample(logits, sampling, rng):
    """The sampler as it was before the processors: a seeded stream must not move."""
    if sampling.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / sampling.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = int(np.searchsorted(np.cumsum(probs[order]), sampling.top_p) + 1)
    kept = order[:keep]
    return int(rng.choice(kept, p=probs[kept] / probs[kept].sum()))


# -- greedy, temperature, top-p (before the processors) ---------------------------------------------------

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


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0, seed=3), Sampling(temperature=0.7, seed=11),
                                      Sampling(temperature=1.3, top_p=0.8, seed=2 ** 63)])
@pytest.mark.parametrize("kwargs", [{}, dict(prompt_ids=[1, 2, 3], output_ids=[4, 5], stop_ids=frozenset({0, 6}))])
def test_defaults_draw_the_same_seeded_stream_as_the_sampler_before_the_processors(sampling, kwargs):
    # processors that are off (no penalty, min_tokens 0) leave the arithmetic alone, whatever the ids passed
    logits = np.random.default_rng(5).normal(0, 3, 500).astype(np.float32)
    same = process_logits(logits, sampling, **{"prompt_ids": (), "output_ids": (), "stop_ids": frozenset(), **kwargs})
    assert same.dtype == np.float64 and np.array_equal(same, logits.astype(np.float64))
    old, new = np.random.default_rng(sampling.seed), np.random.default_rng(sampling.seed)
    assert [old_sample(logits, sampling, old) for _ in range(300)] == \
           [sample(logits, sampling, new, **kwargs) for _ in range(300)]


# -- the processors, each against its formula ---------------------------------------------------------------

@pytest.mark.parametrize("penalty, prompt_ids, output_ids", [
    (1.5, [0, 1], []),              # prompt only: a positive and a negative logit
    (1.5, [], [3, 3, 4]),           # output only, a repeat counts once
    (2.0, [2, 5], [1, 7, 5]),       # both, a zero logit, an id in both
    (0.5, [0, 1, 2], [3]),          # below 1 it rewards repetition
])
def test_repetition_penalty_divides_positive_and_multiplies_other_logits_of_prompt_and_output_tokens(
        penalty, prompt_ids, output_ids):
    seen = set(prompt_ids) | set(output_ids)
    want = [(float(v) / penalty if v > 0 else float(v) * penalty) if i in seen else float(v)
            for i, v in enumerate(LOGITS)]
    got = processed(Sampling(repetition_penalty=penalty), prompt_ids=prompt_ids, output_ids=output_ids)
    assert got == want


@pytest.mark.parametrize("frequency, output_ids", [(0.5, [3, 3, 3, 1]), (-1.25, [0, 0, 7]), (2.0, [])])
def test_frequency_penalty_subtracts_per_occurrence_in_the_output_only(frequency, output_ids):
    want = [float(v) - frequency * output_ids.count(i) for i, v in enumerate(LOGITS)]
    got = processed(Sampling(frequency_penalty=frequency), prompt_ids=[0, 1, 2, 3, 4, 5], output_ids=output_ids)
    assert got == want


@pytest.mark.parametrize("presence, output_ids", [(0.75, [3, 3, 3, 1]), (-2.0, [6]), (1.0, [])])
def test_presence_penalty_subtracts_once_for_any_occurrence_in_the_output(presence, output_ids):
    want = [float(v) - (presence if i in output_ids else 0.0) for i, v in enumerate(LOGITS)]
    got = processed(Sampling(presence_penalty=presence), prompt_ids=[0, 2, 4], output_ids=output_ids)
    assert got == want


@pytest.mark.parametrize("bias", [((1, 100.0),), ((3, -100.0), (0, 2.5)), ((7, 0.125), (2, -3.0), (5, 1.0))])
def test_logit_bias_is_added_to_its_tokens(bias):
    table = dict(bias)
    want = [float(v) + table.get(i, 0.0) for i, v in enumerate(LOGITS)]
    assert processed(Sampling(logit_bias=bias)) == want


@pytest.mark.parametrize("min_tokens, generated, masked", [(3, 0, True), (3, 2, True), (3, 3, False),
                                                           (3, 5, False), (0, 0, False)])
def test_min_tokens_masks_the_stop_ids_until_that_many_tokens_are_out(min_tokens, generated, masked):
    stops = frozenset({3, 5})
    got = processed(Sampling(min_tokens=min_tokens), output_ids=[2] * generated, stop_ids=stops)
    want = [-math.inf if masked and i in stops else float(v) for i, v in enumerate(LOGITS)]
    assert got == want
    assert (sample(LOGITS, Sampling(min_tokens=min_tokens), np.random.default_rng(0), output_ids=[2] * generated,
                   stop_ids=stops) == 3) is not masked  # 3 is the argmax until it is masked


@pytest.mark.parametrize("model_stops, ignore_eos, stop_token_ids, want", [
    ({1}, False, (), {1}),
    ({1, 2}, True, (), set()),
    ({1}, False, (7, 9), {1, 7, 9}),
    ({1}, True, (7, 1), {7, 1}),  # a stop_token_id that is also the model's still stops under ignore_eos
])
def test_stop_set_is_the_model_stops_unless_ignore_eos_plus_stop_token_ids(model_stops, ignore_eos,
                                                                          stop_token_ids, want):
    s = Sampling(ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
    assert stop_set(frozenset(model_stops), s) == frozenset(want)


def test_the_allowed_mask_sets_every_disallowed_token_to_minus_infinity():
    allowed = np.array([i % 3 == 1 for i in range(len(LOGITS))])
    want = [float(v) if allowed[i] else -math.inf for i, v in enumerate(LOGITS)]
    assert processed(GREEDY, allowed=allowed) == want
    assert sample(LOGITS, GREEDY, np.random.default_rng(0), allowed=allowed) == 1 + 3 * int(np.argmax(LOGITS[1::3]))
    assert set(draws(LOGITS, Sampling(temperature=5.0), allowed=allowed)) == {1, 4, 7}


# -- the order -------------------------------------------------------------------------------------------------

def test_logit_bias_is_added_before_the_repetition_penalty_looks_at_the_sign():
    # -1.5 + 3 = 1.5 > 0 is divided: 0.75; penalizing first would give -1.5 * 2 + 3 = 0
    got = processed(Sampling(logit_bias=((1, 3.0),), repetition_penalty=2.0), prompt_ids=[1])
    assert got[1] == 0.75


def test_a_bias_cannot_lift_a_token_the_allowed_mask_or_min_tokens_removed():
    s = Sampling(logit_bias=((0, 100.0), (2, 100.0)), min_tokens=1, presence_penalty=-2.0)
    allowed = np.ones(len(LOGITS), dtype=bool)
    allowed[0] = False
    got = processed(s, output_ids=[], stop_ids=frozenset({2}), allowed=allowed)
    assert got[0] == got[2] == -math.inf
    assert sample(LOGITS, s, np.random.default_rng(0), stop_ids=frozenset({2}), allowed=allowed) == 3


@pytest.mark.parametrize("sampling, output_ids, want", [
    (Sampling(repetition_penalty=2.0), [3], 0),           # 3.25 / 2 = 1.625 < 2.0
    (Sampling(frequency_penalty=0.5), [3, 3, 3], 0),      # 3.25 - 1.5 = 1.75 < 2.0
    (Sampling(presence_penalty=1.5), [3], 0),             # 3.25 - 1.5 = 1.75 < 2.0
    (Sampling(presence_penalty=1.5), [0, 3], 3),          # both fall by 1.5: 3 stays ahead
    (Sampling(logit_bias=((6, 2.75),)), [], 6),           # 0.75 + 2.75 = 3.5 > 3.25
])
def test_greedy_takes_the_argmax_after_the_penalties_and_bias(sampling, output_ids, want):
    assert sample(LOGITS, sampling, np.random.default_rng(0), output_ids=output_ids) == want


# -- top_k and min_p --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_draws_from_exactly_the_k_most_likely_tokens(k):
    logits = np.linspace(1.0, 0.0, 10, dtype=np.float32)[[3, 7, 0, 9, 1, 5, 2, 8, 4, 6]]  # distinct, shuffled
    want = set(sorted(range(10), key=lambda i: -logits[i])[:k])
    assert set(draws(logits, Sampling(temperature=3.0, top_k=k, seed=k), n=600)) == want


@pytest.mark.parametrize("min_p, temperature", [(0.3, 1.0), (0.6, 1.0), (0.3, 0.5), (0.05, 2.0), (1.0, 1.0)])
def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best_after_temperature(min_p, temperature):
    probs = softmax([float(v) / temperature for v in LOGITS])
    want = {i for i, p in enumerate(probs) if p >= min_p * max(probs)}
    assert set(draws(LOGITS, Sampling(temperature=temperature, min_p=min_p, seed=9), n=3000)) == want


@pytest.mark.parametrize("cut", [dict(top_k=2), dict(min_p=0.5)])
def test_top_p_measures_the_mass_the_earlier_cuts_left(cut):
    # probabilities [0.5, 0.3, 0.2]: both cuts leave [0.5, 0.3], i.e. [0.625, 0.375], so top_p 0.6 keeps one;
    # on the uncut distribution 0.5 < 0.6 would keep two
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    assert set(draws(logits, Sampling(temperature=1.0, top_p=0.6, **cut))) == {0}
    assert set(draws(logits, Sampling(temperature=1.0, top_p=0.6))) == {0, 1}


# -- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0)])
@pytest.mark.parametrize("allowed, min_tokens", [(np.zeros(len(LOGITS), dtype=bool), 0),
                                                 (np.arange(len(LOGITS)) == 3, 1)])  # only a stop id left
def test_a_mask_that_leaves_no_token_is_a_worker_error(sampling, allowed, min_tokens):
    s = Sampling(temperature=sampling.temperature, min_tokens=min_tokens)
    with pytest.raises(WorkerError, match="no token left"):
        sample(LOGITS, s, np.random.default_rng(0), stop_ids=frozenset({3}), allowed=allowed)


def test_a_logit_bias_past_the_vocabulary_is_a_worker_error():
    with pytest.raises(WorkerError, match="logit_bias"):
        sample(LOGITS, Sampling(logit_bias=((len(LOGITS), 1.0),)), np.random.default_rng(0))


def test_logits_that_are_not_finite_are_a_worker_error_when_sampling():
    with pytest.raises(WorkerError, match="not finite"):
        sample(np.array([1.0, np.inf, 0.0]), Sampling(temperature=1.0), np.random.default_rng(0))


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(logit_bias=((1, 100.5),)), dict(logit_bias=((-1, 1.0),)),
                                    dict(logit_bias=((2, 1.0), (2, -1.0))), dict(stop_token_ids=(-3,)),
                                    dict(top_k=-1), dict(min_p=1.5), dict(repetition_penalty=0.0)])
def test_invalid_sampling_parameters_are_refused(kwargs):
    with pytest.raises((ValueError, TypeError)):
        Sampling(**kwargs)


# -- the last stage's sampler ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling, want", [(Sampling(min_tokens=2), 5), (Sampling(min_tokens=2, ignore_eos=True), 1),
                                            (Sampling(min_tokens=2, stop_token_ids=(5,)), 4),
                                            (Sampling(repetition_penalty=4.0), 4)])  # 1 in the prompt, 5 out
def test_the_stage_sampler_masks_the_request_stop_set_and_passes_the_ids_on(sampling, want):
    worker = open_worker(stub_model(), Shard.of(1, 2))  # the stub's stop id is 1
    worker.run([StepItem("r", 0, hidden=b"\0" * 4 * worker.info.hidden_dim, seq_len=1, sampling=sampling)])
    logits = np.zeros(worker.info.vocab_size, dtype=np.float32)
    logits[[1, 5, 4]] = [3.0, 2.0, 1.0]
    assert worker.sample("r", logits, prompt_ids=[1], output_ids=[5]) == want


# -- the single-process reference ---------------------------------------------------------------------------------

PROMPT = [0, 9, 10, 11, 1]  # "abc" as the stub's chat: greedy ends on its stop id 1 after 10 tokens
REPEATING = [0, 2, 1]  # "x": greedy says 3 three times in 12 tokens


def test_the_reference_generation_subtracts_the_presence_penalty_of_what_it_has_said():
    gen = generate_full(stub_model(), REPEATING, 12, Sampling(presence_penalty=2.0))
    for t, (token, logits) in enumerate(zip(gen.token_ids, gen.logits)):
        said = set(gen.token_ids[:t])
        scores = [float(v) - (2.0 if i in said else 0.0) for i, v in enumerate(logits)]
        assert token == scores.index(max(scores))
    assert gen.token_ids != generate_full(stub_model(), REPEATING, 12).token_ids  # the penalty changed a choice


@pytest.mark.parametrize("sampling", [Sampling(min_tokens=12), Sampling(ignore_eos=True)])
def test_the_reference_generation_goes_past_the_model_stop_id_under_min_tokens_or_ignore_eos(sampling):
    assert 1 in generate_full(stub_model(), PROMPT, 12).token_ids
    gen = generate_full(stub_model(), PROMPT, 12, sampling)
    assert len(gen.token_ids) == 12 and (1 not in gen.token_ids or sampling.ignore_eos)
