"""A GGUF vocabulary through Hugging Face `tokenizers`, built as llama.cpp reads it: the same ids as
llama.cpp itself (recorded once by record_llamacpp_ids.py into llamacpp_ids.json) and as the same
vocabulary's tokenizer.json, on a hard text."""
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tokfiles import llama3_vocab, tokenizer_json
from vocabfiles import HARD, JSON_VOCABS, VOCABS, gguf_fields_of, template_of, trained_bpe, trained_spm
from worker.errors import ModelFileError
from worker.tokens.gguf_vocab import vocab_from_gguf
from worker.tokens.tokenizer import tokenizer_from_gguf_metadata

RECORDED = json.loads((Path(__file__).with_name("llamacpp_ids.json")).read_text())["vocabs"]


def metadata(name: str, **extra) -> dict:
    """The tokenizer keys write_llama_gguf writes for vocabulary `name`, as a GGUF reader returns them."""
    f = gguf_fields_of(name)
    kv = {"tokenizer.ggml.model": f.get("model", "gpt2"), "tokenizer.ggml.tokens": f["tokens"],
          "tokenizer.ggml.token_type": f["token_types"], "tokenizer.ggml.bos_token_id": f["bos_id"],
          "tokenizer.ggml.eos_token_id": f["eos_id"]}
    kv.update({key: f[field] for key, field in [("tokenizer.ggml.pre", "pre"), ("tokenizer.ggml.scores", "scores"),
                                                ("tokenizer.ggml.unknown_token_id", "unk_id")] if field in f})
    if f["merges"]:
        kv["tokenizer.ggml.merges"] = f["merges"]
    return {**kv, **extra}


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request):
    return request.param, tokenizer_from_gguf_metadata(metadata(request.param), "m.gguf")


def test_a_hard_text_gives_llama_cpps_ids(vocab):
    name, v = vocab
    assert v.encode(HARD) == RECORDED[name]["hard"]


def test_special_tokens_in_a_template_give_llama_cpps_ids(vocab):
    name, v = vocab
    assert v.encode_special(template_of(name)) == RECORDED[name]["template"]


def test_the_ids_decode_back_to_the_text(vocab):
    name, _ = vocab
    hf = vocab_from_gguf(metadata(name), "m.gguf").tokenizer  # the tokenizers decoder, which strips SPM's prefix
    assert hf.decode(RECORDED[name]["hard"], skip_special_tokens=False) == HARD


@pytest.mark.parametrize("name", JSON_VOCABS)
def test_the_tokenizer_json_of_the_same_vocabulary_gives_the_same_ids(name, tmp_path):
    """Through the loader a Hugging Face directory goes through, with BOS and EOS named beside it."""
    from worker.tokens.tokenizer import tokenizer_from_json
    tok = (Tokenizer.from_str(json.dumps(tokenizer_json(llama3_vocab()))) if name == "llama-bpe"
           else trained_spm() if name == "spm" else trained_bpe(name))
    fields = gguf_fields_of(name)
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": fields["tokens"][fields["bos_id"]], "eos_token": fields["tokens"][fields["eos_id"]]}))
    loaded = tokenizer_from_json(tmp_path / "tokenizer.json")
    assert loaded.encode(HARD) == RECORDED[name]["hard"]
    assert loaded.encode_special(template_of(name)) == RECORDED[name]["template"]
    assert loaded.stop_ids == tokenizer_from_gguf_metadata(metadata(name), "m.gguf").stop_ids


@pytest.mark.parametrize("name, add_bos", [("llama-bpe", True), ("smollm", False), ("gpt-2", False), ("spm", True)])
def test_bos_follows_llama_cpps_default_for_the_pre_tokenizer(name, add_bos):
    assert vocab_from_gguf(metadata(name), "m.gguf").add_bos is add_bos
    said = {"tokenizer.ggml.add_bos_token": not add_bos}
    assert vocab_from_gguf(metadata(name, **said), "m.gguf").add_bos is (not add_bos)


@pytest.mark.parametrize("key, value, message", [
    ("tokenizer.ggml.model", "bert", "tokenizer.ggml.model is 'bert'; supported: 'gpt2', 'llama'"),
    ("tokenizer.ggml.pre", "qwen2", "tokenizer.ggml.pre is 'qwen2'; supported: default, gpt-2, llama-bpe"),
    ("tokenizer.ggml.merges", ["ab"], "tokenizer.ggml.merges[0] is 'ab', not two tokens"),
    ("tokenizer.ggml.token_type", [1], "token_type is not a list of 374 entries, one per token"),
])
def test_what_llama_cpp_would_not_read_is_refused_naming_file_and_value(key, value, message):
    with pytest.raises(ModelFileError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        vocab_from_gguf(metadata("gpt-2", **{key: value}), "m.gguf")
    assert e.value.path == "m.gguf"


# --- the same tiny random weights with each vocabulary, through the pipeline ----------------------------------

@pytest.fixture(scope="module")
def vocab_ggufs(tmp_path_factory):
    """name -> a GGUF of the same tiny random blocks with that vocabulary (written on first use)."""
    from vocabfiles import write_vocab_gguf
    directory, paths = tmp_path_factory.mktemp("vocab-ggufs"), {}

    def path(name: str) -> Path:
        if name not in paths:
            write_vocab_gguf(paths.setdefault(name, directory / f"{name}.gguf"), name)
        return paths[name]
    return path


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("name", ["spm", "smollm", "gpt-2", "default"])
def test_each_vocabulary_generates_through_the_chain_what_one_process_does(vocab_ggufs, name, num_stages):
    from worker.chain import run_chain
    from worker.partition import Shard
    from worker.weights.gguf import GGUFSource
    from worker.models import open_worker, tinygrad_model
    from worker.reference import generate_full
    model = tinygrad_model(GGUFSource(vocab_ggufs(name)))
    prompt = model.tokenizer().encode_chat("Say hello, wörld 🦙")
    chain = run_chain([open_worker(model, Shard.of(s, num_stages)) for s in range(num_stages)], prompt, 8)
    assert chain.token_ids == generate_full(model, prompt, 8).token_ids
    assert chain.text == model.tokenizer().decode(chain.token_ids, specials=False)


# SentencePiece with byte fallback at N = 3 in the default suite (its time budget), the rest in the slow tier:
# SmolLM's byte-level BPE runs through 3 stages on the real model in the default suite (test_real_model), and
# Llama 3's, GPT-2's and the default splitting only differ in the tokenizer (checked in-process above)
QUICK_RUNS = {("spm", 3)}
TOKENIZER_RUNS = [pytest.param(name, n, marks=[] if (name, n) in QUICK_RUNS else [pytest.mark.slow])
                  for name in ("smollm", "spm", "llama-bpe", "gpt-2", "default") for n in (2, 3)]


@pytest.mark.parametrize("name, num_stages", TOKENIZER_RUNS)
def test_ppsmoke_seed_gives_generate_fulls_tokens_with_each_tokenizer(vocab_ggufs, name, num_stages):
    import uuid

    from test_smoke_seed import assert_all_gone, start
    from worker.weights.gguf import GGUFSource
    from worker.models import tinygrad_model
    from worker.reference import generate_full
    mark, path = uuid.uuid4().hex, vocab_ggufs(name)
    proc = start(["-n", str(num_stages), "--model", str(path), "--max-tokens", "6", "--json"], mark)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out)
    model = tinygrad_model(GGUFSource(path))
    assert result["prompt_token_ids"] == model.tokenizer().encode_chat("Say hello")
    assert result["token_ids"] == generate_full(model, result["prompt_token_ids"], 6).token_ids
    assert result["text"] == model.tokenizer().decode(result["token_ids"], specials=False)
    assert_all_gone(mark)


@pytest.mark.parametrize("name", ["smollm", "spm", "gpt-2"])
def test_a_hugging_face_directory_with_that_tokenizer_json_tokenizes_as_llama_cpp_and_generates(tmp_path, name):
    import numpy as np

    from hfmake import write_hf_dir
    from test_gguf import hf_weights
    from worker.chain import run_chain
    from worker.config import ModelConfig
    from worker.partition import Shard
    from worker.weights.hf import HFSource
    from worker.models import open_worker, tinygrad_model
    from worker.reference import generate_full
    fields = gguf_fields_of(name)
    config = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=len(fields["tokens"]),
                         max_context=128)
    directory = write_hf_dir(tmp_path / name, config, {n: w.astype(np.float32) for n, w in hf_weights(config).items()})
    tok = trained_spm() if name == "spm" else trained_bpe(name)
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": fields["tokens"][fields["bos_id"]], "eos_token": fields["tokens"][fields["eos_id"]]}))
    source = HFSource(directory)
    assert source.tokenizer().encode(HARD) == RECORDED[name]["hard"]
    model = tinygrad_model(source)
    prompt = model.tokenizer().encode_chat("Say hello")
    assert run_chain([open_worker(model, Shard.of(s, 2)) for s in range(2)], prompt, 6).token_ids == \
        generate_full(model, prompt, 6).token_ids


def test_generated_ids_stream_as_text_each_character_once_it_is_whole(vocab):
    from node.api.text_stream import TextStream
    name, v = vocab
    stream, ids = TextStream(), RECORDED[name]["hard"]
    pieces = [stream.push(v.decode_bytes([i])) for i in ids] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)  # emoji and CJK split into byte pieces wait for their last
    # SentencePiece marks the start of the text with a space that a generated continuation keeps
    assert "".join(pieces) == (" " + HARD if name == "spm" else HARD)
