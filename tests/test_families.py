"""Each Llama-architecture family the names in worker/weights/fetch.py point at, shrunk to a few dimensions per head but
keeping what the families differ in (head counts, tied or untied head, RoPE theta and scaling, vocabulary size
and kind): the GGUF and the Hugging Face directory load to the same config, and greedy generation, whole and
through a chain of stages, gives the tokens and logits of an independent numpy forward pass (tests/npforward.py)."""
import json

import attrs
import numpy as np
import pytest

from ggufmake import write_llama_gguf
from hfmake import write_hf_dir
from npforward import reference_greedy
from vocabfiles import gguf_fields_of
from worker.config import ModelConfig, RopeScaling, llama3_freq_factors
from worker.weights.contract import BLOCK_TENSORS, EMBEDDING, OUTPUT, OUTPUT_NORM

UNUSED = 5  # gguf-py's TokenType: in the vocabulary, never produced by the tokenizer
LLAMA3_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64)


@attrs.frozen
class Family:
    vocabulary: str  # a vocabfiles name, padded with unused tokens to vocab_size
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    rope_theta: float
    scaling: RopeScaling | None = None


# the real models' head counts, vocabulary sizes, heads and RoPE; dims per head cut to keep it quick
FAMILIES = {
    "tinyllama:1.1b": Family("spm", 32, 4, 4, 32000, tied=False, rope_theta=10000.0),
    "smollm2:135m": Family("smollm", 9, 3, 8, 49152, tied=True, rope_theta=100000.0),
    "smollm2:360m": Family("smollm", 15, 5, 8, 49152, tied=True, rope_theta=100000.0),
    "smollm2:1.7b": Family("smollm", 32, 32, 4, 49152, tied=True, rope_theta=130000.0),
    "mistral:7b": Family("spm", 32, 8, 4, 32768, tied=False, rope_theta=1000000.0),
    "llama3.2:1b": Family("llama-bpe", 32, 8, 4, 128256, tied=True, rope_theta=500000.0, scaling=LLAMA3_SCALING),
    "152k vocabulary": Family("gpt-2", 8, 2, 8, 151936, tied=False, rope_theta=1000000.0),
}


def config_of(f: Family) -> ModelConfig:
    dim = f.n_heads * f.head_dim
    factors = None if f.scaling is None else llama3_freq_factors(f.scaling, f.rope_theta, f.head_dim)
    return ModelConfig(dim=dim, n_layers=3, n_heads=f.n_heads, n_kv_heads=f.n_kv_heads, ffn_dim=2 * dim,
                       vocab_size=f.vocab_size, rope_theta=f.rope_theta, rope_freq_factors=factors, max_context=256,
                       tie_embeddings=f.tied)


def weights_of(c: ModelConfig, seed: int = 3) -> dict[str, np.ndarray]:
    """HF-layout weights scaled by 1/sqrt(fan-in), so activations stay in range as in a trained model."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    kv = c.n_kv_heads * c.head_dim
    shapes = {"attn_q": (c.dim, c.dim), "attn_k": (kv, c.dim), "attn_v": (kv, c.dim), "attn_output": (c.dim, c.dim),
              "ffn_gate": (c.ffn_dim, c.dim), "ffn_up": (c.ffn_dim, c.dim), "ffn_down": (c.dim, c.ffn_dim)}
    out = {EMBEDDING: w(c.vocab_size, c.dim), OUTPUT_NORM: (1 + 0.1 * rng.standard_normal(c.dim)).astype(np.float32)}
    for layer in range(c.n_layers):
        for t in BLOCK_TENSORS:
            shape = shapes.get(t)
            out[f"blk.{layer}.{t}.weight"] = (w(*shape) if shape else
                                              (1 + 0.1 * rng.standard_normal(c.dim)).astype(np.float32))
    if not c.tie_embeddings:
        out[OUTPUT] = w(c.vocab_size, c.dim)
    return out


def padded_vocabulary(name: str, size: int) -> dict:
    """write_llama_gguf's tokenizer keywords for vocabulary `name`, padded with unused tokens to `size`."""
    f = dict(gguf_fields_of(name))
    extra = size - len(f["tokens"])
    f["tokens"] = f["tokens"] + [f"<unused{i}>" for i in range(extra)]
    f["token_types"] = f["token_types"] + [UNUSED] * extra
    if "scores" in f:
        f["scores"] = f["scores"] + [-1e9] * extra
    return f


# --- the tests --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """(config, weights, directory holding m.gguf and hf/) of the family named by the test's parameter."""
    f = FAMILIES[request.param]
    c, directory = config_of(f), tmp_path_factory.mktemp(request.param.replace(":", "-").replace(" ", "-"))
    w = weights_of(c)
    write_llama_gguf(directory / "m.gguf", c, w, **padded_vocabulary(f.vocabulary, f.vocab_size))
    hf = write_hf_dir(directory / "hf", c, w, rope_scaling=f.scaling)
    if request.param.startswith("mistral"):  # as Mistral's own directory says it
        config = json.loads((hf / "config.json").read_text())
        config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
        (hf / "config.json").write_text(json.dumps(config))
    return c, w, directory


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_gguf_and_hugging_face_directory_load_to_the_family_config(family):
    from worker.weights.gguf import GGUFSource
    from worker.weights.hf import HFSource
    c, _, directory = family
    for got in GGUFSource(directory / "m.gguf").config, HFSource(directory / "hf").config:
        # GGUF stores eps and the RoPE factors as float32; the context is the file's own
        assert attrs.evolve(got, norm_eps=c.norm_eps, rope_freq_factors=c.rope_freq_factors) == c
        assert got.norm_eps == pytest.approx(c.norm_eps, rel=1e-6)
        if c.rope_freq_factors is not None:
            np.testing.assert_allclose(got.rope_freq_factors, c.rope_freq_factors, rtol=1e-6)


PROMPT = [1, 7, 300, 25, 31000, 12, 19, 4]
QUICK = ("smollm2:135m", "mistral:7b", "llama3.2:1b")  # odd head counts; untied, SentencePiece; RoPE scaling


@pytest.mark.parametrize("family", [pytest.param(name, marks=[] if name in QUICK else [pytest.mark.slow])
                                    for name in FAMILIES], indirect=True)

def test_greedy_tokens_and_logits_equal_numpy_whole_and_through_three_stages(family):
    from worker.chain import run_chain
    from worker.partition import Shard
    from worker.weights.gguf import GGUFSource
    from worker.models import open_worker, tinygrad_model
    from worker.reference import generate_full
    c, w, directory = family
    want_tokens, want_logits = reference_greedy(c, w, PROMPT, 4)
    model = tinygrad_model(GGUFSource(directory / "m.gguf"))
    got = generate_full(model, PROMPT, 4)
    assert got.token_ids == want_tokens
    for mine, theirs in zip(got.logits, want_logits):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=2e-4 * np.abs(theirs).max())
    chain = run_chain([open_worker(model, Shard.of(s, 3)) for s in range(3)], PROMPT, 4)
    assert chain.token_ids == want_tokens
