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
