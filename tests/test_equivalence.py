"""Spec tier 7: chaining stage slices reproduces single-process generation exactly (tiny model, tinygrad)."""
import numpy as np
import pytest

from worker.chain import run_chain
from worker.models import open_worker, tinygrad_model
from worker.reference import generate_full
from worker.tiny import TinySource

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model():
    return tinygrad_model(TinySource())


@pytest.fixture(scope="module")
def prompt(model):
    return model.tokenizer().encode_chat("Say hello")


@pytest.fixture(scope="module")
def reference(model, prompt):
    return generate_full(model, prompt, MAX_TOKENS)


def test_reference_generates_at_least_32_tokens(reference):
    assert len(reference.token_ids) >= 32  # otherwise the gate below would compare too little


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_sliced_tokens_and_logits_equal_the_whole_model(model, prompt, reference, num_stages):
    chain = run_chain([open_worker(model, s, num_stages) for s in range(num_stages)], prompt, MAX_TOKENS)
    assert chain.token_ids == reference.token_ids
    assert len(chain.logits) == len(reference.logits)
    for step, (got, want) in enumerate(zip(chain.logits, reference.logits)):
        assert np.array_equal(got, want), f"step {step}: max diff {np.abs(got - want).max()}"


def test_a_long_prompt_takes_the_batched_prefill_and_still_matches(model):
    from worker.model import STEPWISE_PREFILL_MAX
    prompt = model.tokenizer().encode_chat("x" * (STEPWISE_PREFILL_MAX + 20))
    assert len(prompt) > STEPWISE_PREFILL_MAX
    reference = generate_full(model, prompt, 6)
    chain = run_chain([open_worker(model, s, 2) for s in range(2)], prompt, 6)
    assert chain.token_ids == reference.token_ids
    assert all(np.array_equal(a, b) for a, b in zip(chain.logits, reference.logits))


def test_batched_prefill_agrees_with_stepping_the_prompt_one_token_at_a_time(model):
    # the batched path has a causal mask and position offsets that stepping does not: they must agree
    from worker.model import STEPWISE_PREFILL_MAX
    prompt = model.tokenizer().encode_chat("y" * (STEPWISE_PREFILL_MAX + 10))
    batched = model.open_slice(range(model.total_blocks), embed=True, head=True)
    stepped = model.open_slice(range(model.total_blocks), embed=True, head=True)
    whole = batched.forward(batched.embed(prompt), 0)
    for position, token in enumerate(prompt):
        last = stepped.forward(stepped.embed([token]), position)
    np.testing.assert_allclose(whole, last, rtol=1e-4, atol=1e-4)
    assert int(np.argmax(whole)) == int(np.argmax(last))
