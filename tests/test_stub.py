"""The stub must catch the mistakes a pipeline can make: skipped, repeated or reordered blocks and steps."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from worker.chain import run_chain
from worker.models import open_worker, stub_model
from worker.partition import Shard
from worker.reference import generate_full
from worker.stage import StageWorker
from worker.stub import STUB_BLOCKS, STUB_CONTEXT, STUB_VOCAB, StubSlice, StubTokenizer
from worker.tokens.vocabulary import Vocabulary

PROMPT = StubTokenizer().encode_chat("Say hello")


@pytest.mark.parametrize("num_stages", range(2, 9))
def test_stub_chain_equals_single_process_generation(num_stages):
    model = stub_model()
    result = run_chain([open_worker(model, Shard.of(s, num_stages)) for s in range(num_stages)], PROMPT, 24)
    assert result.token_ids == generate_full(model, PROMPT, 24).token_ids


def _chain_with_layers(layer_lists):
    n = len(layer_lists)
    vocabulary = Vocabulary(StubTokenizer(), vocab_size=STUB_VOCAB, max_context=STUB_CONTEXT)
    return [StageWorker(StubSlice(layers, embed=s == 0, head=s == n - 1), vocabulary, Shard.of(s, n).sized(STUB_BLOCKS))
            for s, layers in enumerate(layer_lists)]


@pytest.mark.parametrize("layers", [
    [range(0, 4), range(5, 8)],                    # block 4 skipped
    [range(0, 5), range(4, 8)],                    # block 4 run twice
    [range(4, 8), range(0, 4)],                    # stages swapped
    [[0, 1, 3, 2], range(4, 8)],                   # two blocks out of order
])
def test_a_wrong_block_sequence_gives_a_different_answer(layers):
    expected = generate_full(stub_model(), PROMPT, 16).token_ids
    assert run_chain(_chain_with_layers(layers), PROMPT, 16).token_ids != expected


def test_each_step_depends_on_every_earlier_step_through_the_cache():
    slice_ = StubSlice(range(0, 8), embed=True, head=False)
    a = slice_.forward(slice_.embed([3, 4, 5]), 0)
    step_at_3 = slice_.forward(slice_.embed([9]), 3)
    slice_.forward(slice_.embed([3, 4, 5]), 0)
    slice_.forward(slice_.embed([8]), 3)  # an extra step before the same token
    again = slice_.forward(slice_.embed([9]), 4)
    assert a.shape == (3, 16) and not np.array_equal(step_at_3, again)


def test_roles_the_stub_worker_and_the_stage_contract_import_without_tinygrad():
    """A node serving the stub, and the roles it runs, never load the tinygrad backend."""
    code = ("import roles, worker.stub, worker.stage, sys; "
            "assert not any(m == 'tinygrad' or m.startswith('tinygrad.') for m in sys.modules), "
            "sorted(m for m in sys.modules if m.startswith('tinygrad'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
