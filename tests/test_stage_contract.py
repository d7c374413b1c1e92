"""The worker contract, against the stub and against tinygrad on the tiny model."""

import numpy as np
import pytest

from worker.chain import decode_step, embed_and_forward, forward_and_sample, forward_range
from worker.contract import StepItem
from worker.errors import WorkerError
from worker.models import open_worker, stub_model, tinygrad_model
from worker.partition import Role, Shard
from worker.weights.tiny import TinySource


@pytest.fixture(params=["stub", "tiny"], scope="module")
def model(request):
    return stub_model() if request.param == "stub" else tinygrad_model(TinySource())


@pytest.fixture
def chain3(model):
    return [open_worker(model, Shard.of(s, 3)) for s in range(3)]


def test_each_stage_reports_its_role_and_slice(model, chain3):
    assert [w.info.shard.role for w in chain3] == [Role.FIRST, Role.MIDDLE, Role.LAST]
    assert [b for w in chain3 for b in w.info.shard.blocks] == list(range(model.total_blocks))
    assert all(w.info.hidden_dim > 0 and w.info.vocab_size > 0 and w.info.stop_ids for w in chain3)


def test_every_op_of_every_role_runs_a_prefill_and_a_decode_step(chain3):
    first, middle, last = chain3
    ids = first.vocabulary.tokenize("Say hello")
    dim = first.info.hidden_dim
    h = embed_and_forward(first, "r", ids, 0)
    assert len(h) == len(ids) * dim * 4
    h = forward_range(middle, "r", h, 0, len(ids))
    assert len(h) == len(ids) * dim * 4
    out = forward_and_sample(last, "r", h, 0, len(ids))
    assert 0 <= out.token_id < last.info.vocab_size and out.logits.shape == (last.info.vocab_size,)
    assert out.token_id == int(np.argmax(out.logits))
    pos = len(ids)
    h = forward_range(middle, "r", decode_step(first, "r", out.token_id, pos), pos, 1)
    assert len(h) == dim * 4
    assert 0 <= forward_and_sample(last, "r", h, pos, 1).token_id < last.info.vocab_size
    assert isinstance(last.vocabulary.detokenize([out.token_id]), str)
    for w in chain3:
        w.release("r")
        w.release("r")  # idempotent


def test_an_answers_text_leaves_control_tokens_out():
    # the tiny model's byte vocabulary: ids 0..255 are bytes, then Llama 3's five control tokens
    first, _, last = [open_worker(tinygrad_model(TinySource()), Shard.of(s, 3)) for s in range(3)]
    ids = [ord("h"), 256, ord("i"), 260]  # h <|begin_of_text|> i <|eot_id|>
    assert last.vocabulary.detokenize(ids) == "hi" and last.vocabulary.token_bytes(ids) == first.vocabulary.token_bytes(ids) == b"hi"
    assert last.vocabulary.tokenizer.decode(ids) == "h<|begin_of_text|>i<|eot_id|>"  # the tokenizer itself keeps them


@pytest.mark.parametrize("stage,op", [
    (1, "embed_and_forward"), (2, "decode_step"),
    (0, "forward_range"), (2, "forward_range"), (0, "forward_and_sample"), (1, "forward_and_sample"),
])
def test_an_op_outside_the_stage_role_is_a_clear_error(chain3, stage, op):
    w = chain3[stage]
    args = {"embed_and_forward": ("r", [1, 2]), "decode_step": ("r", 1, 2),
            "forward_range": ("r", b"", 0, 1), "forward_and_sample": ("r", b"", 0, 1)}[op]
    chained = {"embed_and_forward": embed_and_forward, "decode_step": decode_step, "forward_range": forward_range,
               "forward_and_sample": forward_and_sample}  # worker/chain.py's, on a worker
    with pytest.raises(WorkerError, match=rf"{op} is a \w+-stage op; this worker is stage {stage} of 3"):
        chained[op](w, *args)


def test_only_the_first_and_last_stages_hold_the_vocabulary(chain3):
    # text to tokens and back is the Vocabulary's (worker/tokens/vocabulary.py), which a middle stage lacks
    assert [w.vocabulary is not None for w in chain3] == [True, False, True]


@pytest.mark.parametrize("nbytes_delta,seq_len", [(-4, 2), (4, 2), (0, 0), (0, 3)])
def test_a_wrongly_shaped_hidden_state_is_refused(chain3, nbytes_delta, seq_len):
    middle = chain3[1]
    data = b"\0" * (2 * middle.info.hidden_dim * 4 + nbytes_delta)
    with pytest.raises(WorkerError, match="does not match seq_len"):
        forward_range(middle, "r", data, 0, seq_len)


def test_steps_must_continue_a_known_request_at_its_next_position(chain3):
    first = chain3[0]
    with pytest.raises(WorkerError, match="unknown request 'nope'"):
        decode_step(first, "nope", 1, 3)
    embed_and_forward(first, "r", [5, 6, 7], 0)
    for wrong in (2, 4):  # a lost or a repeated step
        with pytest.raises(WorkerError, match="got position .*, expected 3"):
            decode_step(first, "r", 1, wrong)
    decode_step(first, "r", 1, 3)  # still usable after the refusals


def test_requests_hold_their_own_slots_and_none_supersedes_another(chain3):
    first = chain3[0]
    embed_and_forward(first, "old", [5, 6], 0)
    embed_and_forward(first, "new", [7, 8, 9], 0)
    assert first.active == {"old", "new"}
    decode_step(first, "old", 1, 2)
    decode_step(first, "new", 1, 3)


def test_a_request_id_cannot_start_twice(chain3):
    first = chain3[0]
    embed_and_forward(first, "r", [5, 6], 0)
    with pytest.raises(WorkerError, match="got position 0, expected 2"):
        embed_and_forward(first, "r", [5, 6], 0)


def test_a_request_past_the_last_free_slot_is_refused_until_one_is_released(model):
    first = open_worker(model, Shard.of(0, 2), max_seqs=2)
    embed_and_forward(first, "a", [5], 0)
    embed_and_forward(first, "b", [5], 0)
    with pytest.raises(WorkerError, match="all 2 sequence slots of stage 0 are taken"):
        embed_and_forward(first, "c", [5], 0)
    first.release("a")
    embed_and_forward(first, "c", [5], 0)
    assert first.active == {"b", "c"}


def test_one_refused_step_does_not_fail_the_rest_of_its_batch(chain3):
    first = chain3[0]
    embed_and_forward(first, "r", [5, 6], 0)
    out = first.run([StepItem("r", 5, tokens=(1,)), StepItem("s", 0, tokens=(3, 4)), StepItem("r", 2, tokens=(1,))])
    assert isinstance(out[0], WorkerError) and "expected 2" in str(out[0])
    assert [len(o) for o in out[1:]] == [2 * first.info.hidden_dim * 4, first.info.hidden_dim * 4]
    assert first.active == {"r", "s"}


def test_a_batch_gives_each_request_what_it_gets_alone(model):
    # the stub's hash and tinygrad's float rows: each row of a batch is computed as it would be alone
    alone, batched = open_worker(model, Shard.of(0, 2)), open_worker(model, Shard.of(0, 2))
    prompts = {"a": [5, 6, 7], "b": [9], "c": [4, 4, 4, 4, 4]}
    want = {rid: embed_and_forward(alone, rid, ids, 0) for rid, ids in prompts.items()}
    got = batched.run([StepItem(rid, 0, tokens=tuple(ids)) for rid, ids in prompts.items()])
    assert got == list(want.values())
    want = [decode_step(alone, rid, 1, len(ids)) for rid, ids in prompts.items()]
    assert batched.run([StepItem(rid, len(ids), tokens=(1,)) for rid, ids in prompts.items()]) == want


def test_token_ids_outside_the_vocabulary_are_refused(chain3):
    first, last = chain3[0], chain3[-1]
    with pytest.raises(WorkerError, match="out of range"):
        embed_and_forward(first, "r", [first.info.vocab_size], 0)
    with pytest.raises(WorkerError, match="out of range"):
        last.vocabulary.detokenize([-1])
    with pytest.raises(WorkerError, match="no tokens"):
        embed_and_forward(first, "r", [], 0)


def test_a_step_past_the_context_is_refused(chain3):
    first = chain3[0]
    limit = first.compute.max_context
    with pytest.raises(WorkerError, match=f"exceeds the context of {limit}"):
        embed_and_forward(first, "r", [1] * (limit + 1), 0)


def test_a_failed_step_forgets_the_request_instead_of_continuing_on_a_half_written_cache():
    first = open_worker(stub_model(), Shard.of(0, 2))
    embed_and_forward(first, "r", [5, 6], 0)

    def broken(hidden, position):
        raise RuntimeError("device lost")
    real, first.compute.forward_batch = first.compute.forward_batch, broken
    with pytest.raises(RuntimeError, match="device lost"):
        decode_step(first, "r", 1, 2)
    first.compute.forward_batch = real
    with pytest.raises(WorkerError, match="unknown request 'r'"):
        decode_step(first, "r", 1, 2)
