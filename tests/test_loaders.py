"""The same weights and tokenizer written as a Hugging Face directory and as a llama.cpp GGUF file
(q/k permuted, rope_freqs) load into models that agree with each other and with the in-memory original."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ggufmake import write_llama_gguf
from hfmake import write_hf_dir
from tokfiles import byte_vocab, gguf_fields, write_tokenizer_json
from worker.partition import Shard
from worker.weights.gguf import GGUFSource
from worker.weights.hf import HFSource
from worker.models import open_worker, tinygrad_model
from worker.reference import generate_full
from worker.weights.tiny import TINY_CONFIG, TINY_ROPE_SCALING, TinySource
from worker.tokens.tokenizer import byte_tokenizer

STEPS = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    source = TinySource()
    weights = {name: source.load(name) for name in source.names()}
    tok = byte_vocab()
    hf_dir = write_hf_dir(tmp / "hf", TINY_CONFIG, weights, rope_form="parameters", rope_scaling=TINY_ROPE_SCALING)
    write_tokenizer_json(tok, hf_dir)
    gguf_path = tmp / "tiny.gguf"
    write_llama_gguf(gguf_path, TINY_CONFIG, weights, **gguf_fields(tok))
    return source, hf_dir, gguf_path


@pytest.fixture(scope="module")
def runs(files):
    source, hf_dir, gguf_path = files
    prompt = byte_tokenizer().encode_chat("Say hello")
    return {name: generate_full(tinygrad_model(src), prompt, STEPS)
            for name, src in [("memory", source), ("hf", HFSource(hf_dir)), ("gguf", GGUFSource(gguf_path))]}


def test_hf_directory_gives_the_original_model_exactly(runs):
    assert runs["hf"].token_ids == runs["memory"].token_ids
    assert all(np.array_equal(a, b) for a, b in zip(runs["hf"].logits, runs["memory"].logits))


def test_gguf_file_gives_the_same_tokens_and_logits_as_the_hf_directory(runs):
    # rope_freqs is stored as float32 in GGUF, so logits agree to rounding, not bit for bit
    assert runs["gguf"].token_ids == runs["hf"].token_ids
    for a, b in zip(runs["gguf"].logits, runs["hf"].logits):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_both_files_carry_the_same_config_and_tokenizer(files):
    _, hf_dir, gguf_path = files
    hf, gg = HFSource(hf_dir), GGUFSource(gguf_path)
    for src in (hf, gg):
        assert (src.config.dim, src.config.n_layers, src.config.vocab_size, src.config.tie_embeddings) == (
            TINY_CONFIG.dim, TINY_CONFIG.n_layers, TINY_CONFIG.vocab_size, True)
        np.testing.assert_allclose(src.config.rope_freq_factors, TINY_CONFIG.rope_freq_factors, rtol=1e-6)
    text = "Say hello, wörld 123!"
    assert hf.tokenizer().encode_chat(text) == gg.tokenizer().encode_chat(text) == byte_tokenizer().encode_chat(text)


@pytest.mark.slow  # suite time: the real Q4_1/Q8_0 file runs through 3 stages in the default suite (test_real_model)
def test_a_quantised_gguf_stage_chain_runs_end_to_end(tmp_path):
    source = TinySource()
    weights = {name: source.load(name) for name in source.names()}
    path = tmp_path / "q.gguf"
    qtypes = {n: Q.Q8_0 for n in weights if n.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight"))}
    qtypes.update({n: Q.Q6_K for n in weights if n.endswith("ffn_down.weight")})  # K-quants need rows of 256
    write_llama_gguf(path, TINY_CONFIG, weights, qtypes=qtypes, **gguf_fields(byte_vocab()))
    model = tinygrad_model(GGUFSource(path))
    workers = [open_worker(model, Shard.of(s, 3)) for s in range(3)]
    from worker.chain import run_chain
    prompt = byte_tokenizer().encode_chat("Say hello")
    assert run_chain(workers, prompt, 8).token_ids == generate_full(model, prompt, 8).token_ids
