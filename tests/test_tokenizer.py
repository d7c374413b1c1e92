"""Tokenizers loaded from GGUF metadata and tokenizer.json encode like Meta's Llama 3 tokenizer."""
import json
import re

import pytest
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

from tests import tokfiles
from worker.errors import ModelFileError
from worker.tokenizer import (BYTE_SPECIALS, Tokenizer, byte_tokenizer, bytes_to_unicode, split_long_runs,
                              tokenizer_from_gguf_metadata, tokenizer_from_json)

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
    llama3 = tokfiles.llama3_tokenizer()
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


def test_stop_ids_are_end_of_turn_and_end_of_text(loaded):
    assert loaded.stop_ids == {128001, 128009}


@pytest.mark.parametrize("text", VARIED)
def test_encoding_matches_meta_tokenizer(loaded, meta, text):
    assert loaded.encode(text) == meta.encode(text, bos=False, eos=False)


def test_very_long_runs_are_encoded_like_meta(loaded, meta):
    text = "x" * 60_000 + " " * 30_000 + "tail"
    assert loaded.encode(text) == meta.encode(text, bos=False, eos=False)


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
    kv = tokfiles.gguf_metadata(byte_tokenizer())
    del kv["tokenizer.ggml.merges"]  # GGUF writers drop empty arrays
    tok = tokenizer_from_gguf_metadata(kv, "tiny.gguf")
    assert (tok.vocab_size, tok.special_ids, tok.encode("hi")) == (261, byte_tokenizer().special_ids, [104, 105])


def test_byte_tokenizer_chat_prompt():
    tok = byte_tokenizer()
    assert tok.encode_chat("hi") == [256, 258, *b"user", 259, *b"\n\n", *b"hi", 260, 258, *b"assistant", 259,
                                     *b"\n\n"]


# --- cutting long runs, as Meta does -----------------------------------------------------------

@pytest.mark.parametrize("text", ["", "a", "aaaaaaa", "aaa   bbbbbbb", "  \n\t\t\t\t x", "ab cd ef", "xxxxxx      "])
def test_long_runs_are_cut_where_meta_cuts_them(text):
    assert split_long_runs(text, max_chars=1000, max_run=3) == list(
        MetaTokenizer._split_whitespaces_or_nonwhitespaces(text, 3))


def test_text_is_cut_into_chunks_of_at_most_max_chars():
    assert split_long_runs("ab cd ef g", max_chars=4, max_run=100) == ["ab c", "d ef", " g"]


# --- refusing files that would tokenize wrongly --------------------------------------------------

def small_tokenizer(eos: str = "<|eot_id|>") -> Tokenizer:
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world"):
        ranks[word] = len(ranks)
    specials = {name: len(ranks) + n for n, name in enumerate((*BYTE_SPECIALS, "<|eom_id|>"))}
    return Tokenizer("small", ranks, specials, bos_id=specials["<|begin_of_text|>"], eos_id=specials[eos])


def test_declared_eos_is_a_stop_id_too():
    small = small_tokenizer(eos="<|eom_id|>")
    tok = tokenizer_from_gguf_metadata(tokfiles.gguf_metadata(small), "small.gguf")
    assert tok.stop_ids == {small.special_ids[n] for n in ("<|eom_id|>", "<|eot_id|>", "<|end_of_text|>")}


def test_small_vocabulary_loads_from_both_file_kinds(tmp_path):
    small = small_tokenizer()
    from_gguf = tokenizer_from_gguf_metadata(tokfiles.gguf_metadata(small), "small.gguf")
    from_json = tokenizer_from_json(tokfiles.write_tokenizer_json(small, tmp_path))
    for tok in (from_gguf, from_json):
        assert tok.encode("hello world") == [small.mergeable_ranks[b"hello"], small.mergeable_ranks[b" world"]]


def refused_gguf(kv, match):
    with pytest.raises(ModelFileError, match=match) as err:
        tokenizer_from_gguf_metadata(kv, "/models/bad.gguf")
    assert err.value.path == "/models/bad.gguf"


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                 "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                                 "tokenizer.ggml.eos_token_id"])
def test_gguf_missing_key_is_refused_naming_it(key):
    kv = tokfiles.gguf_metadata(small_tokenizer())
    del kv[key]
    refused_gguf(kv, key)


@pytest.mark.parametrize("key, value, match", [
    ("tokenizer.ggml.model", "bert", "tokenizer.ggml.model is 'bert'; supported: 'gpt2', 'llama'"),
    ("tokenizer.ggml.model", "llama", "'tokenizer.ggml.scores' is missing"),  # SentencePiece needs its scores
    ("tokenizer.ggml.pre", "qwen2", "tokenizer.ggml.pre is 'qwen2'; supported"),
    ("tokenizer.ggml.bos_token_id", 9999, "bos token id 9999"),
    ("tokenizer.ggml.eos_token_id", "2", "eos_token_id"),
    ("tokenizer.ggml.tokens", "abc", "want an array"),
])
def test_gguf_unsupported_or_malformed_value_is_refused(key, value, match):
    kv = tokfiles.gguf_metadata(small_tokenizer())
    kv[key] = value
    refused_gguf(kv, match)


def test_gguf_ids_that_are_not_merge_ranks_are_refused():
    kv = tokfiles.gguf_metadata(small_tokenizer())
    tokens = kv["tokenizer.ggml.tokens"]
    he, world = tokens.index("he"), tokens.index("Ġworld")
    tokens[he], tokens[world] = tokens[world], tokens[he]
    refused_gguf(kv, "not merge ranks")


def test_gguf_merges_lacking_a_split_are_refused():
    kv = tokfiles.gguf_metadata(small_tokenizer())
    kv["tokenizer.ggml.merges"].remove("Ġwor ld")
    refused_gguf(kv, "splits")


@pytest.mark.parametrize("change, match", [
    (lambda kv: kv["tokenizer.ggml.merges"].append("Ġ zz"), "not in the vocabulary"),
    (lambda kv: kv["tokenizer.ggml.merges"].append("hello"), "not a pair"),
    (lambda kv: kv["tokenizer.ggml.token_type"].__setitem__(258, 6), "type 6"),
    (lambda kv: kv["tokenizer.ggml.tokens"].__setitem__(0, " "), "byte-level"),
    (lambda kv: kv["tokenizer.ggml.tokens"].__setitem__(32, "!"), "repeats token"),
    (lambda kv: kv["tokenizer.ggml.token_type"].pop(), "entries for"),
    (lambda kv: kv["tokenizer.ggml.token_type"].__setitem__(ord("a"), 3), "single bytes"),
])
def test_gguf_inconsistent_vocabulary_is_refused(change, match):
    kv = tokfiles.gguf_metadata(small_tokenizer())
    change(kv)
    refused_gguf(kv, match)


def refused_json(tmp_path, change, match):
    doc = tokfiles.tokenizer_json(small_tokenizer())
    change(doc)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(ModelFileError, match=match) as err:
        tokenizer_from_json(path)
    assert err.value.path == str(path)


def swap_vocab_ids(doc, a, b):
    vocab = doc["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]


@pytest.mark.parametrize("change, match", [
    (lambda doc: doc["model"].pop("vocab"), "model.vocab"),
    (lambda doc: doc["model"].pop("merges"), "model.merges"),
    (lambda doc: doc.pop("model"), "'model' is missing"),
    (lambda doc: doc.pop("added_tokens"), "added_tokens"),
    (lambda doc: doc["model"].update(type="WordPiece"), "only 'BPE'"),
    (lambda doc: doc["model"]["vocab"].update(he="7"), "not a token id"),
    (lambda doc: doc["added_tokens"].pop(0), re.escape("<|begin_of_text|>")),
    (lambda doc: doc["added_tokens"].append({"content": "<|x|>"}), r"added_tokens\[6\]"),
    (lambda doc: swap_vocab_ids(doc, "he", "Ġworld"), "not merge ranks"),
    (lambda doc: doc["added_tokens"][1].update(id=10**12), "out of range"),
    (lambda doc: doc["model"]["vocab"].update(he=0), "repeated"),
    (lambda doc: doc["model"]["merges"].remove("Ġwor ld"), "splits"),
])
def test_malformed_tokenizer_json_is_refused_naming_the_file_and_field(tmp_path, change, match):
    refused_json(tmp_path, change, match)


@pytest.mark.parametrize("change", [
    lambda doc: doc["pre_tokenizer"]["pretokenizers"].pop(0),
    lambda doc: doc["pre_tokenizer"]["pretokenizers"][1].update(use_regex=True),
    lambda doc: doc.update(normalizer={"type": "NFC"}),
], ids=["no-split", "gpt2-regex", "normalizer"])
def test_a_tokenizer_json_of_another_shape_goes_through_tokenizers_as_it_is(tmp_path, change):
    from tokenizers import Tokenizer as HFTokenizer
    doc = tokfiles.tokenizer_json(small_tokenizer())
    change(doc)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(ModelFileError, match="no tokenizer_config.json beside it"):
        tokenizer_from_json(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}}), encoding="utf-8")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}), encoding="utf-8")
    tok, ref = tokenizer_from_json(path), HFTokenizer.from_file(str(path))
    ref.encode_special_tokens = True
    text = "hello world, <|eot_id|> héllo"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.stop_ids == {1, 2, tok.eos_id} and tok.bos_id == tok.special_ids["<|begin_of_text|>"]


def test_unreadable_tokenizer_json_is_refused_with_its_path(tmp_path):
    path = tmp_path / "tokenizer.json"
    with pytest.raises(ModelFileError, match="cannot read") as err:
        tokenizer_from_json(path)
    assert err.value.path == str(path)
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelFileError, match="not valid JSON"):
        tokenizer_from_json(path)
