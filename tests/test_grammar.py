import functools
import json
import re
import threading

import numpy as np
import pytest

from worker.grammar import GrammarCompiler, GrammarError, canonical_format
from worker.weights.fetch import DEFAULT_MODEL, installed_model
from worker.weights.gguf import GGUFSource

# A tiny vocabulary: every printable ASCII byte and newline, a few multi-byte tokens, a stop token, a control
# token that is not a stop, and ids past the last token (a padded head)
SINGLE = [bytes([b]) for b in [0x0A, *range(0x20, 0x7F)]]
MULTI = [b'{"', b'":', b'",', b'"}', b"name", b"age", b"true"]
EOS, CONTROL = len(SINGLE) + len(MULTI), len(SINGLE) + len(MULTI) + 1
TOKENS = SINGLE + MULTI + [b"<|eos|>", b"<|ctl|>"]
VOCAB_SIZE = len(TOKENS) + 5
ID = {t: i for i, t in enumerate(TOKENS)}

JSON_OBJECT = canonical_format({"type": "json_object"})
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture
def compiler():
    return GrammarCompiler(TOKENS, {EOS}, VOCAB_SIZE, control_ids={CONTROL})


def ids(text: str) -> list[int]:
    """`text` in the tiny vocabulary, longest token first (as the compiler's own greedy stand-in cuts it)."""
    out, data = [], text.encode()
    while data:
        token = max((t for t in TOKENS[:EOS] if data.startswith(t)), key=len)
        out.append(ID[token])
        data = data[len(token):]
    return out


def walk(matcher, text: str) -> None:
    for token in ids(text):
        assert matcher.allowed()[token], f"{TOKENS[token]!r} refused"
        matcher.accept(token)


def test_json_object_at_the_start_allows_an_opening_brace_but_not_a_letter_nor_the_stop(compiler):
    allowed = compiler.matcher(JSON_OBJECT).allowed()
    assert allowed.shape == (VOCAB_SIZE,) and allowed.dtype == bool
    assert allowed[ID[b"{"]] and allowed[ID[b'{"']]
    assert not allowed[ID[b"a"]] and not allowed[ID[b"["]] and not allowed[EOS]


@pytest.mark.parametrize("grammar, text", [
    (JSON_OBJECT, '{"a":[1,2.5,{"b":null}],"c":"x y","d":true}'),
    (JSON_OBJECT, "{}"),
    (canonical_format(PERSON_FORMAT), '{"name":"Bob","age":42}'),
])
def test_walking_a_valid_document_is_always_allowed_and_ends_done_with_the_stop_allowed(compiler, grammar, text):
    m = compiler.matcher(grammar)
    walk(m, text)
    assert m.complete and m.done
    assert m.allowed()[EOS] and m.allowed().sum() == 1
    m.accept(EOS)
    assert m.done


def test_the_stop_token_is_refused_until_the_document_is_complete(compiler):
    m = compiler.matcher(JSON_OBJECT)
    walk(m, '{"a":1')
    assert not m.complete and not m.allowed()[EOS]
    with pytest.raises(GrammarError, match="not allowed"):
        m.accept(EOS)


@pytest.mark.parametrize("text", ['{ "a":1}', '{"a": 1}', '{"a":1 }', '{"a":1,\n"b":2}'])
def test_whitespace_between_tokens_is_refused_so_a_small_model_cannot_loop_on_it(compiler, text):
    m = compiler.matcher(JSON_OBJECT)
    with pytest.raises(AssertionError, match="refused"):
        walk(m, text)


def test_a_number_may_end_or_go_on_complete_but_not_done(compiler):
    m = compiler.matcher(canonical_format({"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "integer"}}}))
    walk(m, "12")
    assert m.complete and not m.done
    assert m.allowed()[EOS] and m.allowed()[ID[b"3"]]


def test_a_refused_token_raises_and_leaves_the_matcher_where_it_was(compiler):
    m = compiler.matcher(JSON_OBJECT)
    walk(m, "{")
    for bad in (ID[b"a"], ID[b"}"] + 10_000, -1):
        with pytest.raises(GrammarError):
            m.accept(bad)
    walk(m, '"k":1}')
    assert m.done


def test_a_missing_required_property_is_refused_at_the_closing_brace(compiler):
    m = compiler.matcher(canonical_format(PERSON_FORMAT))
    walk(m, '{"name":"Bob"')
    assert not m.allowed()[ID[b"}"]]
    with pytest.raises(GrammarError):
        m.accept(ID[b"}"])
    assert m.allowed()[ID[b","]]


def test_properties_are_written_in_the_schemas_order_which_canonical_format_keeps(compiler):
    reordered = canonical_format({"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"age": {"type": "integer"}, "name": {"type": "string"}},
        "required": ["name", "age"]}}})
    assert reordered.index('"age"') < reordered.index('"name"')
    m = compiler.matcher(reordered)
    walk(m, '{"')
    assert m.allowed()[ID[b"age"]] and not m.allowed()[ID[b"name"]]


def test_control_tokens_and_padding_ids_are_never_allowed_even_inside_a_string(compiler):
    m = compiler.matcher(JSON_OBJECT)
    walk(m, '{"a":"x')
    allowed = m.allowed()
    assert allowed[ID[b"<"]] and allowed[ID[b"x"]]  # the control token's bytes are string text...
    assert not allowed[CONTROL] and not allowed[EOS] and not allowed[len(TOKENS):].any()  # ...it is not


def test_canonical_format_is_the_envelope_sorted_and_the_schema_as_given():
    assert canonical_format({"type": "text"}) == ""
    assert canonical_format({"type": "json_object"}) == '{"type":"json_object"}'
    text = canonical_format(PERSON_FORMAT)
    assert json.loads(text) == {"schema": PERSON, "type": "json_schema"}  # name and strict change no token
    assert text == canonical_format({"json_schema": {"strict": False, "schema": PERSON, "name": "other"},
                                     "type": "json_schema"})


@pytest.mark.parametrize("response_format, message", [
    ("json", r"^response_format: expected an object"),
    ({}, r"^response_format\.type: required"),
    ({"type": "yaml"}, r"^response_format\.type: 'yaml' is not one of 'text', 'json_object', 'json_schema'"),
    ({"type": 3}, r"^response_format\.type: expected a string"),
    ({"type": "json_schema"}, r"^response_format\.json_schema: required"),
    ({"type": "json_schema", "json_schema": []}, r"^response_format\.json_schema: expected an object"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, r"^response_format\.json_schema\.name: required"),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, r"^response_format\.json_schema\.schema: required"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": [PERSON]}},
     r"^response_format\.json_schema\.schema: expected an object, got list"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}},
     r"^response_format\.json_schema\.strict: expected true or false"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "frog"}}},
     r"^response_format\.json_schema\.schema: Invalid type: frog"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"$ref": "#/nowhere"}}},
     r"^response_format\.json_schema\.schema: .*/nowhere"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "number", "minimum": float("nan")}}},
     r"^response_format\.json_schema\.schema: not JSON"),
])
def test_canonical_format_refuses_bad_shapes_naming_the_bad_part(response_format, message):
    with pytest.raises(GrammarError, match=message):
        canonical_format(response_format)


@pytest.mark.parametrize("text", ["", "not json", '{"type":"text"}', '{"type":"json_schema"}', "[]"])
def test_a_grammar_text_canonical_format_would_not_give_is_refused(compiler, text):
    with pytest.raises(GrammarError):
        compiler.matcher(text)


def test_the_cache_returns_the_same_compiled_grammar_for_the_same_text_and_forgets_the_least_recent():
    compiler = GrammarCompiler(TOKENS, {EOS}, VOCAB_SIZE, max_cached=2)
    person = canonical_format(PERSON_FORMAT)
    first = compiler.compile(JSON_OBJECT)
    assert compiler.compile(JSON_OBJECT) is first
    compiler.compile(person)
    compiler.compile(JSON_OBJECT)  # now the most recent: the next text evicts person
    compiler.compile(canonical_format({"type": "json_schema", "json_schema": {"name": "s",
                                                                                "schema": {"type": "string"}}}))
    assert compiler.compile(JSON_OBJECT) is first
    assert compiler.compile(person) is not compiler.compile(JSON_OBJECT)


def test_matchers_of_one_grammar_walk_apart_on_many_threads(compiler):
    failures = []

    def one(text):
        try:
            m = compiler.matcher(JSON_OBJECT)
            walk(m, text)
            assert m.done
        except Exception as exc:  # reported below, on the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=one, args=(f'{{"k{n}":[{n},"{"x" * n}"]}}',)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@pytest.fixture(scope="module")
def smollm2():
    tok = GGUFSource(installed_model(DEFAULT_MODEL)).tokenizer()
    token_bytes = [tok.decode_bytes([i]) for i in range(tok.vocab_size)]
    return tok, GrammarCompiler(token_bytes, tok.stop_ids, tok.vocab_size, control_ids=tok.control_ids,
                                encode=tok.encode)


def test_the_real_vocabulary_walks_a_schema_document_as_its_tokenizer_cuts_it(smollm2):
    tok, compiler = smollm2
    m = compiler.matcher(canonical_format(PERSON_FORMAT))
    assert not m.allowed()[tok.encode("a")[0]]
    for token in tok.encode('{"name":"Zoë Müller","age":42}'):
        assert m.allowed()[token], tok.decode_bytes([token])
        m.accept(token)
    allowed = m.allowed()
    assert m.done and set(np.flatnonzero(allowed)) == set(tok.stop_ids)
    im_start = tok.special_ids["<|im_start|>"]
    assert im_start not in tok.stop_ids and not allowed[im_start]


# -- admission: what the grammar library would refuse, or fail on later, is refused by canonical_format --------

def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize("schema,ref", [
    ({"$ref": "#"}, "#"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "#/$defs/a"),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "#"),
    ({"type": "object", "properties": {"a": {"type": "string"}, "x": {"$ref": "#"}}, "required": ["a", "x"]}, "#"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
    ({"type": "object", "properties": {"n": {"$ref": "#/definitions/node"}},
      "definitions": {"node": {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/definitions/b"}}},
                      "b": {"allOf": [{"type": "integer"}, {"$ref": "#/definitions/node"}]}}},
     "#/definitions/node"),  # optional at the top, but a document that starts an "n" can never end it
    ({"anyOf": [{"$ref": "#/$defs/x"}, {"type": "null"}],
      "$defs": {"x": {"type": "object", "required": ["y"], "additionalProperties": {"$ref": "#/$defs/x"}}}},
     "#/$defs/x"),
])
def test_a_ref_that_no_finite_document_satisfies_is_refused_at_admission(schema, ref):
    """The audit's recursive $ref was accepted, then failed at the last stage when llguidance found the text it
    had to force never ends ("Too many items ... ff_tokens")."""
    with pytest.raises(GrammarError, match=rf"^response_format\.json_schema\.schema: \$ref '{re.escape(ref)}' has no"):
        canonical_format(schema_format(schema))


@pytest.mark.parametrize("schema,document", [
    ({"type": "object", "properties": {"v": {"type": "integer"},
                                       "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["v", "next"]},
     '{"v":1,"next":{"v":2,"next":null}}'),
    ({"type": "object", "properties": {"name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
      "required": ["name", "kids"]}, '{"name":"a","kids":[{"name":"b","kids":[]}]}'),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}}, '{"x":{}}'),  # x is optional
    ({"properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "true"),  # no type: any value, true among them
])
def test_a_recursive_schema_with_a_way_out_is_taken_and_walked(compiler, schema, document):
    matcher = compiler.matcher(canonical_format(schema_format(schema)))
    walk(matcher, document)
    assert matcher.complete


def test_a_schema_the_parser_cannot_start_is_refused_at_admission_not_at_the_last_stage(compiler):
    """Validation alone took an object of 600 optional properties, whose first token then failed its request at
    the last stage: the parser's row of alternatives is past llguidance's 2000 items."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    with pytest.raises(GrammarError, match=r"^response_format\.json_schema\.schema: a document starting b'\{': .*row"):
        canonical_format(schema_format(wide))
    narrow = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    walk(compiler.matcher(canonical_format(schema_format(narrow))), '{"p7":"x"}')


@pytest.mark.parametrize("schema,message", [
    ({"type": "integer", "minimum": -10 ** 30, "maximum": 10 ** 30}, "the grammar library refused it"),  # ValueError
    ({"type": "integer", "minimum": -1e300, "maximum": 1e300}, "integer range"),
    ({"type": "string", "pattern": "a" * (65 * 1024)}, "characters of JSON, more than 65536"),
    (functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(70), {"type": "string"}),
     "nested deeper than"),
])
def test_a_schema_the_library_cannot_take_or_past_the_bounds_is_a_grammar_error(schema, message):
    with pytest.raises(GrammarError, match=message):
        canonical_format(schema_format(schema))
