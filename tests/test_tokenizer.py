"""Llama 3's vocabulary, loaded from GGUF metadata and from tokenizer.json through Hugging Face tokenizers,
encodes like Meta's own tokenizer; the tiny model's byte vocabulary; what a malformed file gets."""
import json

import pytest
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
from tokenizers import Tokenizer as HFTokenizer

from tests import tokfiles
from worker.errors import ModelFileError, WorkerError
from worker.tokens.gguf_vocab import bytes_to_unicode
from worker.tokens.tokenizer import BYTE_SPECIALS, byte_tokenizer, tokenizer_from_gguf_metadata, tokenizer_from_json

VARIED = [
    "Hello world",
    "  leading and trailing whitespace runs \t\t\n\n\n  ",
    "Ünïcödé: 日本語のテキスト, emoji 🦙🔥, Ελληνικά, עברית",
    "digits 1234567890 3.14159 -42 1e10 and 100,000",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # code\n",
    "I'm sure they'll say it's fine, we'd've DON'T",
    "\u0000 control \u0007 chars \r\n and a zero-width\u200bjoiner",
]


@pytest.fixture(scope="module")
def meta():
    """Meta's own tokenizer class: the reference the loaded vocabularies must agree with."""
    return MetaTokenizer(tokfiles.LLAMA3_RANKS_FILE)


@pytest.fixture(scope="module", params=["gguf", "json-strings", "json-pairs"])
def loaded(request, tmp_path_factory):
    """The Llama 3 vocabulary written as a model file would carry it, then loaded back."""
    llama3 = tokfiles.llama3_vocab()
    if request.param == "gguf":
        return tokenizer_from_gguf_metadata(tokfiles.gguf_metadata(llama3), "model.gguf")
    directory = tmp_path_factory.mktemp(request.param)
    return tokenizer_from_json(tokfiles.write_tokenizer_json(llama3, directory,
                                                             pair_merges=request.param == "json-pairs"))


def test_bytes_map_to_gpt2_printable_characters():
    table = bytes_to_unicode()
    assert {b: table[b] for b in (0, 10, 32, 33, 126, 127, 160, 161, 172, 173, 174, 255)} == {
        0: "Ā", 10: "Ċ", 32: "Ġ", 33: "!", 126: "~", 127: "ġ", 160: "ł", 161: "¡", 172: "¬", 173: "Ń",
        174: "®", 255: "ÿ"}
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256


def test_hello_world_is_two_llama3_tokens(loaded):
    assert loaded.encode("Hello world") == [9906, 1917]
    assert loaded.encode("Hello world", bos=True) == [128000, 9906, 1917]


def test_vocabulary_has_llama3_size_and_special_ids(loaded, meta):
    assert loaded.vocab_size == 128256 == meta.n_words
    assert loaded.special_ids == meta.special_tokens
    assert (loaded.bos_id, loaded.special_ids["<|eot_id|>"]) == (128000, 128009)


def test_stop_ids_are_end_of_text_turn_and_message(loaded):
    # llama.cpp's end-of-generation tokens; Llama 3.2's generation_config.json lists the same three
    assert loaded.stop_ids == {128001, 128008, 128009}


@pytest.mark.parametrize("text", VARIED)
def test_encoding_matches_meta_tokenizer(loaded, meta, text):
    assert loaded.encode(text) == meta.encode(text, bos=False, eos=False)


def test_very_long_runs_are_one_piece_as_llama_cpp_and_transformers_read_them(loaded, meta):
    short = "x" * 24_000 + " " * 20_000 + "tail"
    assert loaded.encode(short) == meta.encode(short, bos=False, eos=False)
    # Meta's reference cuts runs at 25,000 characters; llama.cpp and transformers (tokenizer.json) do not
    text = "x" * 60_000 + " " * 30_000 + "tail"
    as_transformers = HFTokenizer.from_str(json.dumps(tokfiles.tokenizer_json(tokfiles.llama3_vocab())))
    assert loaded.encode(text) == as_transformers.encode(text, add_special_tokens=False).ids
    assert loaded.encode(text) != meta.encode(text, bos=False, eos=False)
    assert loaded.decode(loaded.encode(text)) == text


@pytest.mark.parametrize("text", VARIED)
def test_decode_round_trips(loaded, text):
    assert loaded.decode(loaded.encode(text)) == text


def test_special_token_text_in_a_prompt_stays_text(loaded, meta):
    text = "stop here<|eot_id|><|start_header_id|>system"
    ids = loaded.encode(text)
    assert not set(ids) & set(meta.special_tokens.values())
    assert ids == meta.encode(text, bos=False, eos=False)
    assert loaded.decode(ids) == text


def test_chat_prompt_follows_llama3_instruct_template(loaded, meta):
    s = meta.special_tokens

    def header(role):
        return [s["<|start_header_id|>"], *meta.encode(role, bos=False, eos=False), s["<|end_header_id|>"],
                *meta.encode("\n\n", bos=False, eos=False)]

    prompt = "What is 2+2?"
    assert loaded.encode_chat(prompt) == [s["<|begin_of_text|>"], *header("user"),
                                          *meta.encode(prompt, bos=False, eos=False), s["<|eot_id|>"],
                                          *header("assistant")]


def test_special_ids_decode_to_their_text(loaded):
    assert loaded.decode([128000, 9906, 128009]) == "<|begin_of_text|>Hello<|eot_id|>"
    assert loaded.decode([128000, 9906, 128009], specials=False) == "Hello"  # an answer's text


@pytest.mark.parametrize("bad", [128256, -1, 10**9])
def test_decoding_an_id_outside_the_vocabulary_names_it(loaded, bad):
    with pytest.raises(ValueError, match=str(bad)):
        loaded.decode([9906, bad])


# --- the tiny model's byte vocabulary ----------------------------------------------------------

def test_byte_tokenizer_ids_are_bytes_then_five_specials():
    tok = byte_tokenizer()
    assert tok.vocab_size == 261
    assert tok.special_ids == {"<|begin_of_text|>": 256, "<|end_of_text|>": 257, "<|start_header_id|>": 258,
                               "<|end_header_id|>": 259, "<|eot_id|>": 260}
    assert tok.encode("hé", bos=True) == [256, 104, 0xC3, 0xA9]
    assert tok.stop_ids == {257, 260}


def test_byte_tokenizer_round_trips_and_replaces_invalid_utf8():
    tok = byte_tokenizer()
    text = "llama 🦙\n<|eot_id|>"
    assert tok.encode(text) == list(text.encode())
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([0xFF, ord("h"), 0xE2, 0x82]) == "\ufffdh\ufffd"


def test_byte_tokenizer_loads_from_gguf_without_merges():
    kv = tokfiles.gguf_metadata(tokfiles.byte_vocab())
    del kv["tokenizer.ggml.merges"]  # GGUF writers drop empty arrays
    tok = tokenizer_from_gguf_metadata(kv, "tiny.gguf")
    assert (tok.vocab_size, tok.special_ids, tok.encode("hi")) == (261, byte_tokenizer().special_ids, [104, 105])
    assert tok.encode_chat("hi 🦙") == byte_tokenizer().encode_chat("hi 🦙")


def test_byte_tokenizer_chat_prompt():
    tok = byte_tokenizer()
    assert tok.encode_chat("hi") == [256, 258, *b"user", 259, *b"\n\n", *b"hi", 260, 258, *b"assistant", 259,
                                     *b"\n\n"]


# --- a small vocabulary: stop ids, both file kinds, and what is refused --------------------------

def small_vocab(eos: str = "<|eot_id|>") -> tokfiles.Vocab:
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world"):
        ranks[word] = len(ranks)
    return tokfiles.vocab(ranks, (*BYTE_SPECIALS, "<|eom_id|>"), eos=eos)


def test_declared_eos_is_a_stop_id_too():
    small = small_vocab(eos="<|eom_id|>")
    kv = {**tokfiles.gguf_metadata(small), "tokenizer.ggml.eot_token_id": 3}
    tok = tokenizer_from_gguf_metadata(kv, "small.gguf")
    assert tok.stop_ids == {3} | {small.special_ids[n] for n in ("<|eom_id|>", "<|eot_id|>", "<|end_of_text|>")}


def test_small_vocabulary_loads_from_both_file_kinds(tmp_path):
    small = small_vocab()
    from_gguf = tokenizer_from_gguf_metadata(tokfiles.gguf_metadata(small), "small.gguf")
    from_json = tokenizer_from_json(tokfiles.write_tokenizer_json(small, tmp_path))
    for tok in (from_gguf, from_json):
        assert tok.encode("hello world") == [small.mergeable_ranks[b"hello"], small.mergeable_ranks[b" world"]]
        assert tok.encode_chat("hello") == from_gguf.encode_chat("hello")
        assert tok.stop_ids == from_gguf.stop_ids


def test_a_byte_level_vocabulary_lacking_some_bytes_loads_and_refuses_only_text_holding_them():
    # SmolLM2's vocabulary has no token for 21 bytes (0xC0, 0xF1, 0x04, ...); llama.cpp loads it and drops
    # such a character from text, which would make the model see other text than was sent
    kv = tokfiles.gguf_metadata(small_vocab())
    kv["tokenizer.ggml.tokens"][4] = "<not a byte>"
    tok = tokenizer_from_gguf_metadata(kv, "lacking.gguf")
    assert tok.encode("hello world") == tokenizer_from_gguf_metadata(tokfiles.gguf_metadata(small_vocab()),
                                                                     "small.gguf").encode("hello world")
    for text in ("hello \x04 world", "\x04"):
        with pytest.raises(WorkerError, match="byte 0x04, for which the model's vocabulary has no token"):
            tok.encode(text)
    with pytest.raises(WorkerError, match="byte 0x04"):
        tok.encode_chat("a\x04")


def refused_gguf(kv, match):
    with pytest.raises(ModelFileError, match=match) as err:
        tokenizer_from_gguf_metadata(kv, "/models/bad.gguf")
    assert err.value.path == "/models/bad.gguf"


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                 "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"])
def test_gguf_missing_key_is_refused_naming_it(key):
    kv = tokfiles.gguf_metadata(small_vocab())
    del kv[key]
    refused_gguf(kv, key)


@pytest.mark.parametrize("key, value, match", [
    ("tokenizer.ggml.model", "bert", "tokenizer.ggml.model is 'bert'; supported: 'gpt2', 'llama'"),
    ("tokenizer.ggml.model", "llama", "'tokenizer.ggml.scores' is missing"),  # SentencePiece needs its scores
    ("tokenizer.ggml.pre", "qwen2", "tokenizer.ggml.pre is 'qwen2'; supported"),
    ("tokenizer.ggml.bos_token_id", 9999, "bos_token_id is 9999, not a token id"),
    ("tokenizer.ggml.eos_token_id", "2", "eos_token_id is '2', not a token id"),
    ("tokenizer.ggml.eot_token_id", -1, "eot_token_id is -1, not a token id"),
    ("tokenizer.ggml.tokens", "abc", "'tokenizer.ggml.tokens' is missing or not a list"),
    ("tokenizer.ggml.chat_template", 3, "chat_template' is int"),
])
def test_gguf_unsupported_or_malformed_value_is_refused(key, value, match):
    kv = tokfiles.gguf_metadata(small_vocab())
    kv[key.replace("ggml.chat_template", "chat_template")] = value
    refused_gguf(kv, match)


@pytest.mark.parametrize("change, match", [
    (lambda kv: kv["tokenizer.ggml.merges"].append("Ġ zz"), "Token `zz` out of vocabulary"),
    (lambda kv: kv["tokenizer.ggml.merges"].append("hello"), "not two tokens"),
    (lambda kv: kv["tokenizer.ggml.tokens"].__setitem__(5, 5), r"tokens\[5\] is 5"),
    (lambda kv: kv["tokenizer.ggml.tokens"].__setitem__(0, ""), r"tokens\[0\] is ''"),
    (lambda kv: kv["tokenizer.ggml.tokens"].__setitem__(32, "!"), "repeats a token"),
    (lambda kv: kv["tokenizer.ggml.token_type"].pop(), "not a list of 271 entries"),
])
def test_gguf_inconsistent_vocabulary_is_refused(change, match):
    kv = tokfiles.gguf_metadata(small_vocab())
    change(kv)
    refused_gguf(kv, match)


def write_json(tmp_path, doc, config: dict | None = None):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.mark.parametrize("change, config, match", [
    (lambda doc: doc.pop("model"), None, "tokenizers cannot read it"),
    (lambda doc: doc["model"].pop("vocab"), None, "tokenizers cannot read it"),
    (lambda doc: doc["model"]["vocab"].update(he="7"), None, "tokenizers cannot read it"),
    (lambda doc: doc["added_tokens"].pop(0), None, "needs BOS and EOS named by a tokenizer_config.json"),
    (lambda doc: None, {"bos_token": "<|begin_of_text|>", "eos_token": "<|nope|>"}, "needs BOS and EOS"),
    (lambda doc: None, {"bos_token": {"content": 7}, "eos_token": "<|eot_id|>"}, "needs BOS and EOS"),
])
def test_malformed_tokenizer_json_is_refused_naming_the_file(tmp_path, change, config, match):
    doc = tokfiles.tokenizer_json(small_vocab())
    change(doc)
    path = write_json(tmp_path, doc, config)
    with pytest.raises(ModelFileError, match=match) as err:
        tokenizer_from_json(path)
    assert err.value.path == str(path)


@pytest.mark.parametrize("change", [
    lambda doc: doc["pre_tokenizer"]["pretokenizers"].pop(0),
    lambda doc: doc["pre_tokenizer"]["pretokenizers"][1].update(use_regex=True),
    lambda doc: doc.update(normalizer={"type": "NFC"}),
    lambda doc: doc["model"]["merges"].remove("Ġwor ld"),  # ids no longer merge ranks: fine here
], ids=["no-split", "gpt2-regex", "normalizer", "merge-missing"])
def test_a_tokenizer_json_of_another_shape_is_used_as_it_is(tmp_path, change):
    doc = tokfiles.tokenizer_json(small_vocab())
    change(doc)
    path = write_json(tmp_path, doc, {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}), encoding="utf-8")
    tok, ref = tokenizer_from_json(path), HFTokenizer.from_file(str(path))
    ref.encode_special_tokens = True
    text = "hello world, <|eot_id|> héllo"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.stop_ids == {1, 2} | {tok.special_ids[n] for n in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")}
    assert tok.bos_id == tok.special_ids["<|begin_of_text|>"]


def test_unreadable_tokenizer_json_is_refused_with_its_path(tmp_path):
    path = tmp_path / "tokenizer.json"
    with pytest.raises(ModelFileError, match="cannot read tokenizer") as err:
        tokenizer_from_json(path)
    assert err.value.path == str(path)
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelFileError, match="tokenizers cannot read it"):
        tokenizer_from_json(path)
