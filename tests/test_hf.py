"""The Hugging Face directory source: config parsing, lazy safetensors reads, and its refusals."""
import json
import math
import struct
import sys
import types

import attrs
import numpy as np
import pytest

from hfmake import hf_config_dict, safetensors_bytes, write_hf_dir
from worker.config import ModelConfig, RopeScaling, llama3_freq_factors
from worker.errors import ModelFileError
from worker.weights.hf import HFSource, config_from_hf, internal_name
from worker.weights.contract import block_tensor_names

CONFIG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=300,
                     norm_eps=1e-5, rope_theta=500000.0, max_context=4096)
SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def random_weights(config=CONFIG, *, seed=0, with_output=True):
    """HF-layout arrays, magnitudes in [0.01, 2) so f16 rounding stays away from subnormals."""
    rng = np.random.default_rng(seed)
    d, f, kv = config.dim, config.ffn_dim, config.n_kv_heads * config.head_dim
    shapes = {"token_embd.weight": (config.vocab_size, d), "output_norm.weight": (d,)}
    if with_output:
        shapes["output.weight"] = (config.vocab_size, d)
    for i in range(config.n_layers):
        kinds = {"attn_norm": (d,), "attn_q": (d, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, d),
                 "ffn_norm": (d,), "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}
        shapes.update({f"blk.{i}.{k}.weight": s for k, s in kinds.items()})
    return {n: (rng.uniform(0.01, 2.0, s) * rng.choice([-1.0, 1.0], s)).astype(np.float32) for n, s in shapes.items()}


def round_to_significant_bits(x, bits):
    """Nearest-even rounding to `bits` significant bits, by arithmetic rather than bit tricks."""
    mantissa, exponent = np.frexp(x.astype(np.float64))  # mantissa in [0.5, 1)
    return np.ldexp(np.round(mantissa * 2.0 ** bits) / 2.0 ** bits, exponent).astype(np.float32)


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def header_of(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), 8 + length


# --- loading -----------------------------------------------------------------------------------

def test_f32_tensors_load_exactly_as_written(tmp_path):
    weights = random_weights()
    source = HFSource(write_hf_dir(tmp_path, CONFIG, weights))
    for name, array in weights.items():
        loaded = source.load(name)
        assert loaded.dtype == np.float32
        np.testing.assert_array_equal(loaded, array, err_msg=name)


@pytest.mark.parametrize("dtype, significant_bits", [("F16", 11), ("BF16", 8)])
def test_half_precision_tensors_load_as_the_rounded_values(tmp_path, dtype, significant_bits):
    weights = random_weights(seed=1)
    source = HFSource(write_hf_dir(tmp_path, CONFIG, weights, dtype=dtype))
    for name, array in weights.items():
        loaded = source.load(name)
        assert loaded.dtype == np.float32
        np.testing.assert_array_equal(loaded, round_to_significant_bits(array, significant_bits), err_msg=name)


def test_sharded_checkpoint_loads_the_same_tensors_as_a_single_file(tmp_path):
    weights = random_weights(seed=2)
    single = HFSource(write_hf_dir(tmp_path / "single", CONFIG, weights, dtype="BF16"))
    sharded = HFSource(write_hf_dir(tmp_path / "sharded", CONFIG, weights, dtype="BF16", shards=3))
    assert len(list((tmp_path / "sharded").glob("model-*-of-00003.safetensors"))) == 3
    assert sharded.names() == single.names()
    assert sharded.config == single.config
    for name in single.names():
        np.testing.assert_array_equal(sharded.load(name), single.load(name), err_msg=name)


def test_names_are_the_internal_llama_cpp_names(tmp_path):
    source = HFSource(write_hf_dir(tmp_path, CONFIG, random_weights()))
    expected = {*block_tensor_names(0), *block_tensor_names(1), "token_embd.weight", "output_norm.weight",
                "output.weight"}
    assert source.names() == expected


@pytest.mark.parametrize("hf, internal", [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
    ("model.layers.7.self_attn.q_proj.weight", "blk.7.attn_q.weight"),
    ("model.layers.7.self_attn.k_proj.weight", "blk.7.attn_k.weight"),
    ("model.layers.7.self_attn.v_proj.weight", "blk.7.attn_v.weight"),
    ("model.layers.12.self_attn.o_proj.weight", "blk.12.attn_output.weight"),
    ("model.layers.3.post_attention_layernorm.weight", "blk.3.ffn_norm.weight"),
    ("model.layers.3.mlp.gate_proj.weight", "blk.3.ffn_gate.weight"),
    ("model.layers.3.mlp.up_proj.weight", "blk.3.ffn_up.weight"),
    ("model.layers.3.mlp.down_proj.weight", "blk.3.ffn_down.weight"),
    ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
    ("model.layers.0.mlp.gate_proj.bias", None),
])
def test_hf_tensor_names_map_to_llama_cpp_names(hf, internal):
    assert internal_name(hf) == internal


def test_loading_a_tensor_reads_only_its_own_bytes(tmp_path):
    weights = random_weights(seed=3)
    write_hf_dir(tmp_path, CONFIG, weights)
    path = tmp_path / "model.safetensors"
    header, data_start = header_of(path)
    start, end = header["model.layers.1.mlp.down_proj.weight"]["data_offsets"]
    raw = bytearray(path.read_bytes())
    raw[data_start:data_start + start] = b"\xff" * start  # all-ones f32 words are NaN
    raw[data_start + end:] = b"\xff" * (len(raw) - data_start - end)
    path.write_bytes(bytes(raw))

    source = HFSource(tmp_path)
    np.testing.assert_array_equal(source.load("blk.1.ffn_down.weight"), weights["blk.1.ffn_down.weight"])
    assert np.isnan(source.load("token_embd.weight")).all()  # the corruption did land elsewhere


def test_tokenizer_comes_from_tokenizer_json_with_the_directory_s_chat_template(tmp_path, monkeypatch):
    opened = []
    fake = types.ModuleType("worker.tokens.tokenizer")
    fake.tokenizer_from_json = lambda path, chat_template: opened.append((path, chat_template)) or "tok"
    fake.chat_template_from_config = lambda directory: f"template of {directory.name}"
    monkeypatch.setitem(sys.modules, "worker.tokens.tokenizer", fake)
    source = HFSource(write_hf_dir(tmp_path, CONFIG, random_weights()))
    assert source.tokenizer() == "tok"
    assert opened == [(tmp_path / "tokenizer.json", f"template of {tmp_path.name}")]


# --- config ------------------------------------------------------------------------------------

def rename_rope_type_to_type(cfg):
    cfg["rope_scaling"]["type"] = cfg["rope_scaling"].pop("rope_type")


@pytest.mark.parametrize("rope_form, edit", [
    ("legacy", lambda cfg: None),
    ("legacy", rename_rope_type_to_type),
    ("parameters", lambda cfg: None),
])
def test_every_config_form_gives_the_same_model_config(tmp_path, rope_form, edit):
    write_hf_dir(tmp_path, CONFIG, random_weights(), rope_form=rope_form, rope_scaling=SCALING)
    edit_json(tmp_path / "config.json", edit)
    factors = llama3_freq_factors(SCALING, CONFIG.rope_theta, CONFIG.head_dim)
    assert HFSource(tmp_path).config == attrs.evolve(CONFIG, rope_freq_factors=factors)
    assert factors[0] == 1.0 and factors[-1] == SCALING.factor  # the case exercises both ends


def test_llama3_2_rope_factors_follow_the_llama3_formula():
    cfg = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
           "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    factors = config_from_hf(cfg, "config.json").rope_freq_factors
    # head_dim 64: pair k has wavelength 2*pi*500000**(2k/64). Below 8192/4 = 2048 it is unscaled
    # (pairs 0..14), above 8192/1 it is divided by 32 (pairs 18..31), in between it is smoothed.
    assert len(factors) == 32
    assert factors[:15] == (1.0,) * 15
    assert factors[18:] == (32.0,) * 14
    wavelength_16 = 2 * math.pi * math.sqrt(500000.0)  # pair 16: exponent 32/64
    smooth = (8192 / wavelength_16 - 1.0) / (4.0 - 1.0)
    assert factors[16] == pytest.approx(1.0 / ((1 - smooth) / 32.0 + smooth), rel=1e-12)
    assert 1.0 < factors[15] < factors[16] < factors[17] < 32.0


def small_cfg(**changes):
    cfg = hf_config_dict(CONFIG)
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not ...}  # `...` deletes a key


@pytest.mark.parametrize("changes, field, expected", [
    ({"max_position_embeddings": 131072}, "max_context", 8192),
    ({"max_position_embeddings": 2048}, "max_context", 2048),
    ({"num_key_value_heads": ...}, "n_kv_heads", 4),
    ({"tie_word_embeddings": ...}, "tie_embeddings", False),
    ({"tie_word_embeddings": True}, "tie_embeddings", True),
    ({"head_dim": 16}, "dim", 64),
    ({"rope_scaling": None}, "rope_freq_factors", None),
    ({"rope_scaling": {"rope_type": "default"}}, "rope_freq_factors", None),
    ({"rope_scaling": ..., "rope_theta": ..., "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_theta", 1e4),
    ({"rope_scaling": ..., "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_freq_factors", None),
    ({"rms_norm_eps": 1e-6}, "norm_eps", 1e-6),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None}, "max_context", 4096),
    # within its window, sliding-window attention is full attention: the context stops there
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 1024}, "max_context", 1024),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "n_kv_heads", 2),
])
def test_a_hugging_face_config_gives_each_config_field_its_value_or_default(changes, field, expected):
    assert getattr(config_from_hf(small_cfg(**changes), "config.json"), field) == expected


@pytest.mark.parametrize("changes, words", [
    ({"model_type": "mistral", "architectures": ["LlamaForCausalLM"]}, "'mistral'"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "Qwen2ForCausalLM"),
    ({"attention_bias": True}, "attention_bias is True"),
    ({"mlp_bias": True}, "mlp_bias is True"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": "4k"}, "sliding_window"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ({"head_dim": 32}, "head_dim 32"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "'linear'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"hidden_size": ...}, "hidden_size"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_size": 66}, "dim 66"),
])
def test_unsupported_or_inconsistent_configs_are_refused(changes, words):
    with pytest.raises(ModelFileError) as err:
        config_from_hf(small_cfg(**changes), "dir/config.json")
    assert err.value.path == "dir/config.json"
    assert words in err.value.problem


@pytest.mark.parametrize("tie_word_embeddings, with_output, tied", [
    (False, True, False),
    (False, False, True),
    (True, False, True),
])
def test_head_is_tied_when_config_says_so_or_lm_head_is_absent(tmp_path, tie_word_embeddings, with_output, tied):
    config = attrs.evolve(CONFIG, tie_embeddings=tie_word_embeddings)
    source = HFSource(write_hf_dir(tmp_path, config, random_weights(with_output=with_output)))
    assert source.config.tie_embeddings is tied
    assert ("output.weight" in source.names()) is with_output


# --- refusals ----------------------------------------------------------------------------------

def refusal(directory):
    with pytest.raises(ModelFileError) as err:
        HFSource(directory)
    return err.value


def test_missing_config_is_refused_with_its_path(tmp_path):
    write_hf_dir(tmp_path, CONFIG, random_weights())
    (tmp_path / "config.json").unlink()
    err = refusal(tmp_path)
    assert err.path == str(tmp_path / "config.json") and "missing" in err.problem


def test_malformed_config_is_refused_with_its_path(tmp_path):
    write_hf_dir(tmp_path, CONFIG, random_weights())
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    err = refusal(tmp_path)
    assert err.path == str(tmp_path / "config.json") and "JSON" in err.problem


def test_directory_without_weights_is_refused(tmp_path):
    write_hf_dir(tmp_path, CONFIG, random_weights())
    (tmp_path / "model.safetensors").unlink()
    err = refusal(tmp_path)
    assert err.path == str(tmp_path) and "model.safetensors" in err.problem


def test_missing_tensor_is_refused_naming_it_and_the_file(tmp_path):
    weights = random_weights()
    del weights["blk.1.attn_k.weight"]
    source = HFSource(write_hf_dir(tmp_path, CONFIG, weights))
    with pytest.raises(ModelFileError) as err:
        source.load("blk.1.attn_k.weight")
    assert err.value.path == str(tmp_path / "model.safetensors")
    assert "blk.1.attn_k.weight" in err.value.problem and "model.layers.1.self_attn.k_proj.weight" in err.value.problem


def test_truncated_file_is_refused_with_its_path(tmp_path):
    write_hf_dir(tmp_path, CONFIG, random_weights())
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    err = refusal(tmp_path)
    assert err.path == str(path) and "truncated" in err.problem


@pytest.mark.parametrize("corrupt", [
    lambda raw: struct.pack("<Q", len(raw) * 4) + raw[8:],  # header length past the end
    lambda raw: raw[:8] + b"#" * 16 + raw[24:],  # header bytes are not JSON
    lambda raw: raw[:5],  # not even a length prefix
])
def test_corrupt_header_is_refused_with_its_path(tmp_path, corrupt):
    write_hf_dir(tmp_path, CONFIG, random_weights())
    path = tmp_path / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    err = refusal(tmp_path)
    assert err.path == str(path) and "corrupt safetensors header" in err.problem


def test_index_naming_a_missing_shard_is_refused(tmp_path):
    write_hf_dir(tmp_path, CONFIG, random_weights(), shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    err = refusal(tmp_path)
    assert err.path == str(tmp_path / "model.safetensors.index.json")
    assert "model-00002-of-00002.safetensors" in err.problem


def test_unsupported_dtype_is_refused_naming_it(tmp_path):
    write_hf_dir(tmp_path, CONFIG, random_weights())
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes({"model.norm.weight": ("F64", (64,), np.ones(64).tobytes())}))
    with pytest.raises(ModelFileError) as err:
        HFSource(tmp_path).load("output_norm.weight")
    assert err.value.path == str(path) and "F64" in err.value.problem


def test_tensor_shape_disagreeing_with_config_is_refused(tmp_path):
    weights = random_weights()
    weights["blk.0.attn_k.weight"] = weights["blk.0.attn_q.weight"]  # as if n_kv_heads were 4
    write_hf_dir(tmp_path, CONFIG, weights)
    err = refusal(tmp_path)
    assert err.path == str(tmp_path / "model.safetensors")
    assert "model.layers.0.self_attn.k_proj.weight" in err.problem and "[32, 64]" in err.problem
