"""Weights kept in the file's precision (F16, BF16, Q8_0 and Q4_1 packed): exactly the values the f32 path widens
them to, a stage holding the file's bytes rather than four per weight, and the same generation."""
import attrs
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ggufmake import write_llama_gguf
from hfmake import write_hf_dir
from test_gguf import QUANT_CONFIG, hf_weights
from tokfiles import byte_vocab, gguf_fields
from worker.chain import run_chain
from worker.partition import Shard
from worker.weights.contract import EMBEDDING, is_matrix, narrow_kinds, stage_tensor_names
from worker.weights.gguf import GGUFSource
from worker.weights.hf import HFSource
from worker.models import open_worker, tinygrad_model
from worker.reference import generate_full
from worker.tokens.tokenizer import byte_tokenizer

# every kind a kernel reads as it is, q and k rows (permuted in the file) among them, and a K-quant,
# which is widened at load
MIXED = {EMBEDDING: Q.Q8_0, "blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.F16,
         "blk.0.attn_v.weight": Q.BF16, "blk.0.attn_output.weight": Q.Q4_1, "blk.0.ffn_gate.weight": Q.Q8_0,
         "blk.0.ffn_up.weight": Q.F16, "blk.0.ffn_down.weight": Q.Q6_K,
         "blk.1.attn_q.weight": Q.BF16, "blk.1.attn_k.weight": Q.Q4_1, "blk.1.attn_v.weight": Q.Q8_0,
         "blk.1.attn_output.weight": Q.F16, "blk.1.ffn_gate.weight": Q.BF16, "blk.1.ffn_up.weight": Q.Q8_0,
         "blk.1.ffn_down.weight": Q.Q8_0}
KIND = {Q.Q8_0: "q8_0", Q.Q4_1: "q4_1", Q.F16: "f16", Q.BF16: "bf16", Q.Q6_K: "f32", Q.F32: "f32"}
CONFIG = attrs.evolve(QUANT_CONFIG, n_layers=2, vocab_size=byte_tokenizer().vocab_size, max_context=512)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("packed") / "m.gguf"
    write_llama_gguf(path, CONFIG, hf_weights(CONFIG), qtypes=MIXED, **gguf_fields(byte_vocab()))
    return path


def test_matrices_keep_the_file_precision_and_widen_to_exactly_what_load_gives(gguf_path):
    source = GGUFSource(gguf_path)
    for name in [n for n in source.names() if is_matrix(n)]:
        packed = source.load_packed(name)
        qtype = MIXED.get(name, Q.F32)
        assert packed.kind == KIND[qtype], name
        np.testing.assert_array_equal(packed.widened().view(np.uint32), source.load(name).view(np.uint32),
                                      err_msg=name)
        if qtype != Q.Q6_K:  # kept as the file holds it: the same bytes
            assert packed.nbytes == source.header.tensors[name].nbytes, name


@pytest.mark.parametrize("name, block_bytes", [(EMBEDDING, 34), ("blk.0.attn_output.weight", 20)])
def test_blocked_kinds_read_a_few_rows_at_a_time_are_the_whole_tensor(gguf_path, monkeypatch, name, block_bytes):
    from worker.weights import gguf
    source = GGUFSource(gguf_path)
    whole = source.load_packed(name)
    monkeypatch.setattr(gguf, "DECODE_CHUNK_ELEMENTS", 7 * CONFIG.dim // 32 * block_bytes)  # 7 rows a read
    chunked = source.load_packed(name)
    assert all(np.array_equal(a, b) for a, b in zip(whole.parts, chunked.parts))


@pytest.mark.parametrize("dtype, kind", [("F16", "f16"), ("BF16", "bf16"), ("F32", "f32")])
def test_safetensors_matrices_keep_their_dtype(tmp_path, dtype, kind):
    config = attrs.evolve(QUANT_CONFIG, tie_embeddings=False)
    source = HFSource(write_hf_dir(tmp_path / "hf", config, hf_weights(config), dtype=dtype))
    for name in ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output.weight", EMBEDDING]:
        packed = source.load_packed(name)
        assert packed.kind == kind
        np.testing.assert_array_equal(packed.widened(), source.load(name))


@pytest.mark.parametrize("precision, tuned, kept", [
    ("file", False, {"f16", "bf16", "q8_0", "q4_1"}),
    ("file", True, {"f16", "bf16", "q8_0", "q4_1"}),
    ("auto", True, {"f16", "bf16", "q8_0", "q4_1"}),
    ("auto", False, {"q8_0", "q4_1"}),  # untuned CPU kernels read f16 slower than f32
    ("f32", True, set()),
    ("f32", False, set()),
])
def test_a_stage_holds_the_files_bytes_for_the_kinds_it_keeps_and_four_per_weight_for_the_rest(
        gguf_path, precision, tuned, kept):
    source = GGUFSource(gguf_path)
    names = stage_tensor_names(CONFIG, range(2), embed=True, head=True)
    want = sum(info.nbytes if KIND[MIXED.get(n, Q.F32)] in kept | {"f32"} and MIXED.get(n) != Q.Q6_K
               else 4 * int(np.prod(info.shape)) for n in names for info in [source.header.tensors[n]])
    held = tinygrad_model(source, precision, tuned=tuned).open_slice(range(2), embed=True, head=True).weight_bytes
    assert held == want


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision must be one of auto, file, f32, got 'q4'"):
        narrow_kinds("q4", False)


@pytest.fixture(scope="module")
def file_model(gguf_path):
    return tinygrad_model(GGUFSource(gguf_path), "file")


def test_sliced_equals_whole_exactly_in_the_files_precision(file_model):
    prompt = list(range(3, 20))
    whole = generate_full(file_model, prompt, 12)
    chain = run_chain([open_worker(file_model, Shard.of(s, 2)) for s in range(2)], prompt, 12)
    assert chain.token_ids == whole.token_ids
    assert all(np.array_equal(a, b) for a, b in zip(chain.logits, whole.logits))


def test_the_files_precision_generates_what_the_widened_f32_path_does(file_model, gguf_path):
    prompt = list(range(3, 20))
    narrow = generate_full(file_model, prompt, 12)
    wide = generate_full(tinygrad_model(GGUFSource(gguf_path), "f32"), prompt, 12)
    assert narrow.token_ids == wide.token_ids
    for a, b in zip(narrow.logits, wide.logits):  # the same weights; the sums may differ in order only
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_the_split_matmul_form_matches_the_plain_one_and_slices_exactly(file_model):
    # the form searched kernels take (worker/compute/linear.py); kernel search itself is too slow to run here
    def opened(layers, embed, head, split):
        s = file_model.open_slice(layers, embed=embed, head=head)
        s.model.searched = split
        return s
    prompt = list(range(3, 20))
    plain = opened(range(2), True, True, False)
    whole = opened(range(2), True, True, True)
    first, last = opened(range(1), True, False, True), opened(range(1, 2), False, True, True)
    want = whole.forward(whole.embed(prompt), 0)
    assert np.array_equal(last.forward(first.forward(first.embed(prompt), 0), 0), want)
    np.testing.assert_allclose(want, plain.forward(plain.embed(prompt), 0), rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


def _packed(kind: str, w: np.ndarray):
    from worker.weights import packed
    if kind == "q8_0":  # ggml's blocks: an f16 scale, then 32 int8
        from ggufmake import quantize
        blocks = quantize(w, Q.Q8_0).view(np.uint8).reshape(w.shape[0], -1, 34)
        return packed.Packed("q8_0", (packed.aligned(blocks[:, :, 2:]).view(np.int8),
                                      packed.aligned(blocks[:, :, :2]).view(np.float16)))
    if kind == "q4_1":  # f16 d and m, then 16 bytes of nibbles
        from ggufmake import quantize
        blocks = quantize(w, Q.Q4_1).view(np.uint8).reshape(w.shape[0], -1, 20)
        return packed.Packed("q4_1", (packed.aligned(blocks[:, :, 4:]), packed.aligned(blocks[:, :, :4]).view(np.float16)))
    bits = {"f32": w, "f16": w.astype(np.float16), "bf16": (w.view(np.uint32) >> 16).astype(np.uint16)}[kind]
    return packed.dense(kind, bits)


@pytest.mark.parametrize("searched", [False, True], ids=["plain", "searched"])
@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "q4_1"])
def test_linear_computes_x_times_the_widened_weight_for_every_kind_and_form(kind, searched):
    from tinygrad import Tensor

    from worker.compute.linear import linear, to_device
    rng = np.random.default_rng(3)
    w, x = rng.standard_normal((48, 96)).astype(np.float32), rng.standard_normal((3, 96)).astype(np.float32)
    packed = _packed(kind, w)
    got = linear(Tensor(x), to_device(packed, lambda a: Tensor(a), hand_written=True), searched=searched).numpy()
    np.testing.assert_allclose(got, x @ packed.widened().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("searched", [False, True], ids=["plain", "searched"])
@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_1"])
def test_tinygrad_s_own_forms_compute_x_times_the_widened_weight_where_no_hand_written_kernel_runs(kind, searched):
    # what a GPU runs: the weight's parts as the file holds them, widened inside tinygrad's matmul
    from tinygrad import Tensor

    from worker.compute.linear import DeviceWeight, linear
    rng = np.random.default_rng(4)
    w, x = rng.standard_normal((40, 64)).astype(np.float32) + 0.3, rng.standard_normal((3, 64)).astype(np.float32)
    packed = _packed(kind, w)
    weight = DeviceWeight(kind, tuple(Tensor(p) for p in packed.parts), packed.shape)
    got = linear(Tensor(x), weight, searched=searched).numpy()
    np.testing.assert_allclose(got, x @ packed.widened().T, rtol=1e-5, atol=1e-5)
