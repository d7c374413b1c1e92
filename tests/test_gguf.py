"""GGUF weight source: header parsing from prefixes, config, exact dequantisation, lazy tensor reads."""
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ggufmake import quantize, write_llama_gguf
from worker.config import ModelConfig, RopeScaling, llama3_freq_factors
from worker.errors import ModelFileError
from worker.files import ALIGN
from worker.weights import quants
from worker.weights.contract import BLOCK_TENSORS, EMBEDDING, OUTPUT, OUTPUT_NORM
from worker.weights.gguf import SUPPORTED_TYPES, GGUFSource, dequantize
from worker.weights.gguf_header import (GGML_TYPES, GGUFHeader, IncompleteHeader, TensorInfo, config_from_header,
                                        parse_header, read_header)

SMALL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=300,
                    rope_theta=500000.0, max_context=4096)


def hf_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    kv = config.n_kv_heads * config.head_dim
    shapes = {"attn_norm": (config.dim,), "attn_q": (config.dim, config.dim), "attn_k": (kv, config.dim),
              "attn_v": (kv, config.dim), "attn_output": (config.dim, config.dim), "ffn_norm": (config.dim,),
              "ffn_gate": (config.ffn_dim, config.dim), "ffn_up": (config.ffn_dim, config.dim),
              "ffn_down": (config.dim, config.ffn_dim)}
    weights = {EMBEDDING: (config.vocab_size, config.dim)}
    for layer in range(config.n_layers):
        weights.update({f"blk.{layer}.{t}.weight": shapes[t] for t in BLOCK_TENSORS})
    weights[OUTPUT_NORM] = (config.dim,)
    if not config.tie_embeddings:
        weights[OUTPUT] = (config.vocab_size, config.dim)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in weights.items()}


def write(path, config: ModelConfig, weights, **kw):
    tokens = [f"tok{i}" for i in range(config.vocab_size)]
    write_llama_gguf(path, config, weights, tokens=tokens, token_types=[1] * config.vocab_size,
                     merges=["t o", "to k"], bos_id=0, eos_id=1, **kw)
    return path


def test_f32_weights_come_back_exactly_in_hf_layout(tmp_path):
    weights = hf_weights(SMALL)
    source = GGUFSource(write(tmp_path / "m.gguf", SMALL, weights))
    assert source.names() == frozenset(weights)
    for name, want in weights.items():
        got = source.load(name)
        assert got.dtype == np.float32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_file_stores_q_rows_interleaved_as_llama_cpp_does(tmp_path):
    # HF row r of head h holds the value r; llama.cpp stores each head's rows as 0, hd/2, 1, hd/2+1, ...
    config = SMALL
    weights = hf_weights(config)
    weights["blk.0.attn_q.weight"] = np.repeat(np.arange(config.dim, dtype=np.float32)[:, None], config.dim, 1)
    path = write(tmp_path / "m.gguf", config, weights)
    stored = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    first_head = np.asarray(stored.data).reshape(config.dim, config.dim)[:16, 0]
    assert first_head.tolist() == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    np.testing.assert_array_equal(GGUFSource(path).load("blk.0.attn_q.weight"), weights["blk.0.attn_q.weight"])


def test_config_comes_from_llama_metadata_and_rope_freqs_tensor(tmp_path):
    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    factors = llama3_freq_factors(scaling, 500000.0, SMALL.head_dim)
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=300,
                         norm_eps=1e-5, rope_theta=500000.0, rope_freq_factors=factors, max_context=4096)
    source = GGUFSource(write(tmp_path / "m.gguf", config, hf_weights(config)))
    # the file stores float32, so that is the precision that comes back
    assert source.config == ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=300,
        norm_eps=float(np.float32(1e-5)), rope_theta=500000.0,
        rope_freq_factors=tuple(float(np.float32(f)) for f in factors), max_context=4096, tie_embeddings=False)
    assert "rope_freqs.weight" in source.names()


def test_missing_output_weight_means_tied_embeddings(tmp_path):
    config = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=300,
                         tie_embeddings=True)
    source = GGUFSource(write(tmp_path / "m.gguf", config, hf_weights(config)))
    assert source.config.tie_embeddings and OUTPUT not in source.names()


LLAMA_KV = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
            "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.context_length": 2048,
            "tokenizer.ggml.tokens": ["a"] * 300}


@pytest.mark.parametrize("extra, field, want", [
    ({}, "n_kv_heads", 4),                                    # head_count_kv defaults to head_count
    ({"llama.attention.head_count_kv": 2}, "n_kv_heads", 2),
    ({}, "rope_theta", 10000.0),                              # llama.cpp's default freq_base
    ({"llama.rope.freq_base": 500000.0}, "rope_theta", 500000.0),
    ({}, "max_context", 2048),
    ({"llama.context_length": 8192}, "max_context", 8192),
    ({"llama.context_length": 131072}, "max_context", 8192),  # capped: KV cache memory
    ({}, "vocab_size", 300),                                  # from the token list
    ({"tokenizer.ggml.tokens": None, "llama.vocab_size": 500}, "vocab_size", 500),
    ({}, "tie_embeddings", True),                             # no output.weight in the header
])
def test_gguf_metadata_gives_each_config_field_its_value_or_llama_cpp_s_default(extra, field, want):
    kv = {k: v for k, v in {**LLAMA_KV, **extra}.items() if v is not None}
    config = config_from_header(GGUFHeader(version=3, kv=kv, tensors={}, data_start=0), "x.gguf", None)
    assert getattr(config, field) == want


@pytest.mark.parametrize("extra, problem", [
    ({"general.architecture": "qwen2"}, "architecture 'qwen2' is not supported"),
    ({"general.architecture": "gpt2"}, "architecture 'gpt2' is not supported"),
    ({"llama.block_count": None}, "'llama.block_count' is missing"),
    ({"llama.block_count": "two"}, "'llama.block_count' is 'two', want an integer"),
    ({"llama.attention.head_count": 5}, "inconsistent llama metadata"),
    ({"llama.attention.key_length": 32}, "llama.attention.key_length = 32"),
])
def test_bad_metadata_is_refused_naming_the_file(extra, problem):
    kv = {k: v for k, v in {**LLAMA_KV, **extra}.items() if v is not None}
    with pytest.raises(ModelFileError) as e:
        config_from_header(GGUFHeader(version=3, kv=kv, tensors={}, data_start=0), "x.gguf", None)
    assert str(e.value).startswith("x.gguf: ") and problem in str(e.value)


def test_embedding_rows_must_match_the_vocabulary():
    embd = TensorInfo("token_embd.weight", (299, 64), 0, 0, 299 * 64 * 4)
    header = GGUFHeader(version=3, kv=LLAMA_KV, tensors={embd.name: embd}, data_start=0)
    with pytest.raises(ModelFileError, match=r"token_embd.weight is \(299, 64\), want \(vocab 300, dim 64\)"):
        config_from_header(header, "x.gguf", None)


def test_foreign_architecture_file_is_refused_with_its_path(tmp_path):
    path = write(tmp_path / "q.gguf", SMALL, hf_weights(SMALL), architecture="qwen2")
    with pytest.raises(ModelFileError, match="architecture 'qwen2' is not supported") as e:
        GGUFSource(path)
    assert e.value.path == str(path)


QUANT_CONFIG = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=300)
QTYPES = {EMBEDDING: Q.Q6_K, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q8_0,
          "blk.0.ffn_down.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.F16, "blk.0.attn_output.weight": Q.BF16}


def test_quantised_tensors_load_as_gguf_py_decodes_them(tmp_path):
    weights = hf_weights(QUANT_CONFIG)
    source = GGUFSource(write(tmp_path / "m.gguf", QUANT_CONFIG, weights, qtypes=QTYPES))
    for name, qtype in QTYPES.items():
        want = gguf.quants.dequantize(quantize(weights[name], qtype), qtype)
        got = source.load(name)
        assert got.dtype == np.float32 and got.shape == weights[name].shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)


# byte offsets of each block's float16 scale fields (ggml-common.h's block_* structs), which must be finite in
# random test blocks; F16 and BF16 values are left as any bit pattern, NaNs included
F16_FIELDS = {Q.F16: [], Q.BF16: [], Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
              Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(qtype, shape, seed, *, finite_scales=True) -> np.ndarray:
    """Random bytes of a `shape` tensor of `qtype`: every bit pattern of quants and sub-block scales, not just
    what an encoder would produce; (rows, row bytes) as gguf-py takes them."""
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0] * shape[1] // block_elems, block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype] if finite_scales else []:
        raw[:, at:at + 2] = (rng.standard_normal((len(raw), 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(shape[0], -1)


def test_supported_types_are_exactly_those_real_files_use_with_ggml_block_sizes():
    assert sorted(GGML_TYPES[t][0] for t in SUPPORTED_TYPES) == sorted(
        ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
    assert set(quants.LAYOUTS) == {int(q) for q in F16_FIELDS} == SUPPORTED_TYPES - {0}
    for ggml_type, layout in quants.LAYOUTS.items():
        assert (layout.name, layout.block, layout.block_bytes) == GGML_TYPES[ggml_type]
        assert (layout.block, layout.block_bytes) == gguf.GGML_QUANT_SIZES[Q(ggml_type)]


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_random_quantised_blocks_decode_bit_exactly_as_gguf_py(qtype):
    shape = (3, 2 * 256)
    raw = random_blocks(qtype, shape, int(qtype))
    want = gguf.quants.dequantize(raw, qtype)
    got = dequantize(raw.ravel(), int(qtype), shape)
    assert got.dtype == np.float32 and got.shape == shape
    # the same bits, the sign of zero included (see worker/weights/quants.py on why it can be so)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_non_finite_scales_decode_to_what_gguf_py_gives_without_a_warning(qtype):
    # a corrupt file's inf or NaN scale: inf and NaN where ggml has them (inf * 0 is NaN), and no
    # RuntimeWarning (which this suite makes an error)
    shape = (64, 256)
    raw = random_blocks(qtype, shape, int(qtype) + 100, finite_scales=False)
    with np.errstate(all="ignore"):
        want = gguf.quants.dequantize(raw, qtype)
    assert np.isnan(want).any()  # the case is real: some scale (or, in F16/BF16, value) is not finite
    np.testing.assert_array_equal(dequantize(raw.ravel(), int(qtype), shape), want)


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_a_tensor_decodes_in_chunks_exactly_as_in_one_go(qtype, monkeypatch):
    # SmolLM2-135M's ffn_down, 576 x 1536: 3.4 default chunks; and chunks of 1000 values, which split no
    # tensor evenly and leave a short last chunk (3 blocks of 256 or 31 blocks of 32 a step)
    shape = (576, 1536)
    raw = random_blocks(qtype, shape, int(qtype) + 200)
    assert shape[0] * shape[1] > quants.CHUNK_ELEMENTS
    chunked = dequantize(raw.ravel(), int(qtype), shape)
    assert chunked.ctypes.data % ALIGN == 0  # page-aligned: the CPU device uses it in place
    monkeypatch.setattr(quants, "CHUNK_ELEMENTS", 1000)
    small_chunks = dequantize(raw.ravel(), int(qtype), shape)
    monkeypatch.setattr(quants, "CHUNK_ELEMENTS", shape[0] * shape[1])
    one_go = dequantize(raw.ravel(), int(qtype), shape)
    np.testing.assert_array_equal(chunked.view(np.uint32), one_go.view(np.uint32))
    np.testing.assert_array_equal(small_chunks.view(np.uint32), one_go.view(np.uint32))
    np.testing.assert_array_equal(one_go.view(np.uint32), gguf.quants.dequantize(raw, qtype).view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q3_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_decoding_holds_the_result_and_a_chunk_sized_working_set(qtype):
    import tracemalloc  # numpy reports its array memory to tracemalloc
    shape = (576, 1536)
    raw = random_blocks(qtype, shape, 0).ravel()
    tracemalloc.start()
    try:
        out = dequantize(raw, int(qtype), shape)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # measured: at most ~2.6 bytes per chunk value (Q3_K, Q5_K), plus the result's page-alignment slack
    assert peak - out.nbytes <= 4 * quants.CHUNK_ELEMENTS + ALIGN


def test_decoding_writes_into_a_given_output():
    raw = random_blocks(Q.Q4_K, (2, 512), 3)
    out = np.full(1024, np.nan, np.float32)
    assert quants.decode(raw, int(Q.Q4_K), out) is out
    np.testing.assert_array_equal(out, gguf.quants.dequantize(raw, Q.Q4_K).ravel())
    with pytest.raises(ValueError, match="want 1024 contiguous float32 values"):
        quants.decode(raw, int(Q.Q4_K), np.empty(1023, np.float32))
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 144"):
        quants.decode(raw.ravel()[:-1], int(Q.Q4_K))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_half_precision_widens_bit_exactly(qtype):
    x = (np.random.default_rng(1).standard_normal((4, 64)) * 100).astype(np.float32)
    raw = quantize(x, qtype)
    got = dequantize(raw.view(np.uint8).ravel(), int(qtype), x.shape)
    np.testing.assert_array_equal(got.view(np.uint32), gguf.quants.dequantize(raw, qtype).view(np.uint32))


@pytest.mark.parametrize("qtype, max_error", [(Q.Q6_K, 0.05), (Q.Q4_K, 0.1)], ids=["Q6_K", "Q4_K"])
def test_test_helper_k_quant_encoders_approximate_their_input(qtype, max_error):
    x = np.random.default_rng(2).standard_normal((8, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize(x, qtype), qtype)
    assert np.abs(back - x).max() <= max_error * np.abs(x).max()


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ4_XS, Q.TQ2_0, Q.MXFP4, Q.Q8_1], ids=lambda q: q.name)
def test_unsupported_tensor_type_is_refused_by_name(qtype):
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    with pytest.raises(ModelFileError, match=f"'w' has type {qtype.name}, which is not supported") as e:
        dequantize(np.zeros(block_bytes, np.uint8), int(qtype), (block_elems,), path="m.gguf", tensor="'w'")
    assert e.value.path == "m.gguf"
    assert "(supported: BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0)" in str(e.value)


def test_data_of_the_wrong_size_for_its_shape_is_refused():
    with pytest.raises(ModelFileError, match="has 33 bytes, which is not Q8_0 data of shape"):
        dequantize(np.zeros(33, np.uint8), int(Q.Q8_0), (32,), path="m.gguf")


def tiny_file(tmp_path):
    config = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=24)
    return write(tmp_path / "tiny.gguf", config, hf_weights(config))


def test_header_parses_from_exactly_its_own_prefix(tmp_path):
    data = tiny_file(tmp_path).read_bytes()
    full = parse_header(data, "tiny.gguf")
    reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
    assert full.data_start == reader.data_offset
    assert {t.name: (t.data_offset, t.n_bytes, int(t.tensor_type)) for t in reader.tensors} == {
        t.name: (t.offset, t.nbytes, t.ggml_type) for t in full.tensors.values()}
    needed, end = {}, None
    for n in range(full.data_start + 1):
        try:
            header = parse_header(memoryview(data)[:n], "tiny.gguf")
        except IncompleteHeader as e:
            assert end is None, f"prefix {n} incomplete after prefix {end} parsed"
            needed[n] = e.needed_bytes
            continue
        end = n if end is None else end
        assert header == full
    # the header ends within the alignment padding before the data ...
    assert end is not None and full.data_start - 32 < end <= full.data_start
    # ... and every hint asks for more than the prefix had, never for more than the header is
    assert all(n < hint <= end for n, hint in needed.items())


def test_header_is_read_by_growing_a_small_prefix(tmp_path):
    path = tiny_file(tmp_path)
    data = path.read_bytes()
    with open(path, "rb") as f:
        assert read_header(f, len(data), path, first_read=7) == parse_header(data, path)


def hdr(n_tensors: int, n_kv: int, body: bytes = b"", version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv) + body


def gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def tensor(name: bytes, ne: list[int], ggml_type: int, offset: int = 0) -> bytes:
    return gstr(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, offset)


@pytest.mark.parametrize("data, problem", [
    (hdr(0, 0, magic=b"GGML"), "not a GGUF file"),
    (hdr(0, 0, version=1), "unsupported GGUF version 1"),
    (hdr(0, 2**62), "kv count 4611686018427387904 is absurd"),
    (hdr(2**62, 0), "tensor count 4611686018427387904 is absurd"),
    (hdr(0, 1, gstr(b"k") + struct.pack("<I", 99)), "unknown kv value type 99"),
    (hdr(0, 1, struct.pack("<Q", 2**40)), "string length 1099511627776 is absurd"),
    (hdr(0, 1, gstr(b"k") + struct.pack("<IIQ", 9, 4, 2**40)), "array length 1099511627776 is absurd"),
    (hdr(0, 1, gstr(b"\xff\xfe") + struct.pack("<IB", 0, 1)), "not UTF-8"),
    (hdr(0, 2, (gstr(b"k") + struct.pack("<IB", 0, 1)) * 2), "duplicate key 'k'"),
    (hdr(0, 1, gstr(b"general.alignment") + struct.pack("<II", 4, 24)), "is not a power of two"),
    (hdr(1, 0, tensor(b"t", [1] * 5, 0)), "has 5 dimensions"),
    (hdr(1, 0, tensor(b"t", [32], 77)), "unknown ggml type 77"),
    (hdr(1, 0, tensor(b"t", [0], 0)), "absurd shape"),
    (hdr(1, 0, tensor(b"t", [100], 8)), "not whole Q8_0 blocks of 32"),
    (hdr(1, 0, tensor(b"t", [32], 0, offset=4)), "offset 4 is not 32-byte aligned"),
    (hdr(2, 0, tensor(b"t", [32], 0) * 2), "duplicate tensor 't'"),
])
def test_corrupt_header_is_refused_naming_the_file_and_problem(data, problem):
    with pytest.raises(ModelFileError) as e:
        parse_header(data, "bad.gguf")
    assert e.value.path == "bad.gguf" and problem in str(e.value)


@pytest.mark.parametrize("at, patch, problem", [
    (0, b"GGML", "not a GGUF file"),
    (16, b"\xff" * 8, "kv count 18446744073709551615 is absurd"),
])
def test_corrupt_file_is_refused_with_its_path(tmp_path, at, patch, problem):
    path = tiny_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[at:at + len(patch)] = patch
    path.write_bytes(data)
    with pytest.raises(ModelFileError, match=problem) as e:
        GGUFSource(path)
    assert e.value.path == str(path)


def test_file_truncated_inside_the_header_is_refused(tmp_path):
    path = tiny_file(tmp_path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelFileError, match="header is truncated") as e:
        GGUFSource(path)
    assert e.value.path == str(path)


def test_a_file_cut_short_in_its_tensors_is_refused_when_opened_naming_the_first_missing(tmp_path):
    path = tiny_file(tmp_path)
    by_offset = sorted(GGUFSource(path).header.tensors.values(), key=lambda t: t.offset)
    cut = by_offset[-2]  # the file ends one byte into the second-to-last tensor: two are cut off
    path.write_bytes(path.read_bytes()[:cut.offset + cut.nbytes - 1])
    with pytest.raises(ModelFileError, match=f"truncated: tensor '{cut.name}' needs bytes up to "
                                             f"{cut.offset + cut.nbytes} .*2 tensors cut off") as e:
        GGUFSource(path)
    assert e.value.path == str(path)


def test_a_file_that_shrinks_after_it_was_opened_is_refused_naming_the_tensor(tmp_path):
    path = tiny_file(tmp_path)
    source = GGUFSource(path)
    last = max(source.header.tensors.values(), key=lambda t: t.offset)
    path.write_bytes(path.read_bytes()[:last.offset + last.nbytes - 1])
    with pytest.raises(ModelFileError, match=f"tensor '{last.name}'.*truncated") as e:
        source.load(last.name)
    assert e.value.path == str(path)


def test_missing_tensor_is_refused_naming_file_and_tensor(tmp_path):
    path = tiny_file(tmp_path)
    with pytest.raises(ModelFileError, match="tensor 'blk.7.attn_q.weight' is not in the file") as e:
        GGUFSource(path).load("blk.7.attn_q.weight")
    assert e.value.path == str(path)


def test_unreadable_path_is_refused_with_its_path(tmp_path):
    with pytest.raises(ModelFileError, match="cannot read GGUF file") as e:
        GGUFSource(tmp_path / "absent.gguf")
    assert e.value.path == str(tmp_path / "absent.gguf")


def test_loading_a_tensor_touches_only_its_own_bytes(tmp_path):
    weights = hf_weights(SMALL)
    path = write(tmp_path / "m.gguf", SMALL, weights)
    tensors = parse_header(path.read_bytes(), path).tensors
    target = tensors["blk.0.ffn_up.weight"]
    end = target.offset + target.nbytes
    # every data byte but the target's becomes NaN
    data = bytearray(path.read_bytes())
    start = min(t.offset for t in tensors.values())
    data[start:target.offset] = b"\xff" * (target.offset - start)
    data[end:] = b"\xff" * (len(data) - end)
    path.write_bytes(data)
    source = GGUFSource(path)
    np.testing.assert_array_equal(source.load("blk.0.ffn_up.weight"), weights["blk.0.ffn_up.weight"])
    # the damage is real: the tensors before and after it are garbage
    assert np.isnan(source.load(EMBEDDING)).all() and np.isnan(source.load(OUTPUT)).all()
