"""Constrained decoding: a request's `response_format` as a grammar that says which tokens may come next.

The whole interface:

  canonical_format(response_format: dict) -> str
      At the API, before a request is admitted. Checks OpenAI's shapes, `{"type": "text"}`,
      `{"type": "json_object"}` and `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
      "description"}}`, and that a schema compiles (bounded: at most MAX_SCHEMA_CHARS of JSON, MAX_SCHEMA_DEPTH
      deep, and each $ref satisfiable by a finite document); returns the text that travels in `Sampling.grammar`:
      "" for text (unconstrained), else a JSON object with sorted keys, {"type": "json_object"} or
      {"schema": ..., "type": "json_schema"}. A bad shape or schema is a GrammarError (a ValueError) whose
      message starts with the dotted name of the bad part (`response_format.json_schema.schema: ...`).
      No vocabulary is needed; about 1 ms for a schema like bench/grammar.py's (14 properties, nested). Call it
      in a worker thread: a schema at the bounds takes longer. A forced tool call's text, {"type": "tool_calls",
      ...}, is worker/tool_grammar.py's canonical_tool_calls.
  GrammarCompiler(token_bytes, stop_ids, vocab_size, *, control_ids=(), encode=None, max_cached=64)
      Once per worker (the last stage), from its vocabulary: token_bytes[i] is token i's bytes (control
      tokens as their text), stop_ids end a request, vocab_size is the logits' width (ids past
      len(token_bytes) are never allowed). control_ids are never text: only the stop ids among them are ever
      allowed. encode(text) -> ids is the model's tokenizer (Tokenizer.encode); llguidance restricts forced
      text (a required key's name, say) to its canonical tokens, so without it a greedy longest match stands in.
  compiler.compile(grammar_text) -> CompiledGrammar
      The grammar of a Sampling.grammar text, compiled once and kept (the last `max_cached` texts, least
      recently used dropped): the same text gives the same object.
  compiler.matcher(grammar_text) -> Matcher
      One per request, from the compiled grammar. "" (type text) has none: its request samples unconstrained;
      a GrammarError for "" or any text canonical_format would not give.
  Matcher.allowed() -> np.ndarray of bool, shape (vocab_size,), read-only
      The tokens that may come next; the stop ids are among them only once the text so far is complete.
      Computed once per position: a second call before accept() returns the same array.
  Matcher.accept(token_id)
      Advances by one token. A token allowed() refuses (a stop id too early, a token after done, an id outside
      the vocabulary) is a GrammarError, and the matcher is left as it was.
  Matcher.complete, Matcher.done
      complete: the text so far is a whole document (a stop token is allowed). done: nothing but a stop token
      may follow, or one was accepted: the request can end here.

A compile costs 1-10 ms, a mask with its step 0.04-0.2 ms at 49k-128k tokens (docs/benchmarks.md, "Structured
output"): call them on the compute thread, never the event loop. Each Matcher holds a lock, so one may be used from more than one thread; the
compiler's cache is locked too.

The library is llguidance (Rust, a 3 MB wheel with no dependencies): chosen over xgrammar, which pulls torch,
on the figures of bench/grammar.py. Its JSON schema defaults are kept but one: whitespace is not free (see
_library_grammar); properties come in the schema's order, and a schema without
`additionalProperties: false` allows more keys, as JSON Schema says. Hence the schema's own text is kept in its
key order (the envelope alone is sorted): sorting it would reorder the properties the model must write.
`strict` is checked but changes nothing: every schema is enforced.
"""
from __future__ import annotations

import functools
import json
import operator
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import llguidance
import numpy as np

from worker.tool_formats import forced_lark

TEXT, JSON_OBJECT, JSON_SCHEMA, TOOL_CALLS = "text", "json_object", "json_schema", "tool_calls"
DEFAULT_MAX_CACHED = 64  # compiled grammars kept per worker
MAX_SCHEMA_CHARS = 64 * 1024  # a schema's JSON text: compiling one at the cap costs about a second of CPU
MAX_SCHEMA_DEPTH = 64  # objects and arrays in a schema's JSON, nested (OpenAI: 10 levels of schemas)
# the matcher's errors go back to the client: no parser state or grammar dump in them
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarError(ValueError):
    """A response_format or grammar text we refuse, or a token its grammar does not allow here."""


def canonical_format(response_format) -> str:
    """OpenAI's `response_format` checked, as the text Sampling.grammar carries ("" = unconstrained)."""
    kind = _field(response_format, "type", str, "response_format", required=True)
    if kind == TEXT:
        return ""
    if kind == JSON_OBJECT:
        return _dumps({"type": JSON_OBJECT})
    if kind != JSON_SCHEMA:
        raise GrammarError(f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'")
    spec = _field(response_format, "json_schema", dict, "response_format", required=True)
    _field(spec, "name", str, "response_format.json_schema", required=True)
    _field(spec, "description", str, "response_format.json_schema")
    _field(spec, "strict", bool, "response_format.json_schema")
    schema = _field(spec, "schema", dict, "response_format.json_schema", required=True)
    return '{"schema":' + checked_schema(schema, "response_format.json_schema.schema") + ',"type":"json_schema"}'


def checked_schema(schema: dict, where: str) -> str:
    """A JSON Schema checked within the bounds and compiled, as its JSON text in its own key order; a
    GrammarError naming `where` otherwise."""
    if _depth(schema) > MAX_SCHEMA_DEPTH:  # first: json.dumps recurses through it
        raise GrammarError(f"{where}: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError (a lone surrogate) is a ValueError
        raise GrammarError(f"{where}: not JSON: {str(exc)[:200]}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{where}: {len(text)} characters of JSON, more than {MAX_SCHEMA_CHARS}")
    if (ref := _unsatisfiable_ref(schema)) is not None:
        raise GrammarError(f"{where}: $ref {ref!r} has no finite instance: each way through it requires itself")
    problem = _library_problem(text)
    if problem:
        raise GrammarError(f"{where}: {problem}")
    return text  # the schema's own order kept: it is the order the model must write the properties in


@functools.lru_cache(maxsize=DEFAULT_MAX_CACHED)  # a client sends its schema again with each request
def _library_problem(schema_text: str) -> str:
    """What llguidance says is wrong with a schema (its JSON text), "" for nothing: compiled against a
    vocabulary of single bytes, it must take each byte it allows first, as some limits bind only once the
    parser runs (validation alone took a schema of 1,300 optional properties that then failed its request at
    the first token at the last stage, "Current row has 4495 items; max is 2000"; a required recursion fails
    there too, as the text it forces never ends). A value the library cannot take (an integer past 64 bits)
    raises rather than answering: that is the schema's problem too, and so is a panic of its Rust code (pyo3's
    PanicException, a BaseException). The library releases the GIL while it compiles."""
    try:
        matcher = byte_matcher(_library_grammar(json.loads(schema_text)))
        if matcher.is_error():
            return matcher.get_error()
        for byte in np.flatnonzero(Matcher(matcher, _BYTE_EOS + 1).allowed()[:_BYTE_EOS]):
            first = matcher.deep_copy()
            if not first.consume_token(int(byte)):
                return f"a document starting {bytes([byte])!r}: {first.get_error()}"
        return ""
    except BaseException as exc:
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        return f"the grammar library refused it: {str(exc)[:200]}"


_BYTE_EOS = 256  # the byte vocabulary's stop token: bytes 0..255 are ids 0..255


def byte_matcher(grammar: str) -> llguidance.LLMatcher:
    """A grammar compiled against a vocabulary of single bytes: its errors, before any model's vocabulary."""
    return llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=_LIMITS)


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    vocab = _Vocabulary([bytes([b]) for b in range(256)] + [b"<eos>"], frozenset({_BYTE_EOS}), _BYTE_EOS, None)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=_BYTE_EOS + 1, eos_token=[_BYTE_EOS])


def _depth(value) -> int:
    """How many objects and arrays deep a parsed JSON value nests (without recursing)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:  # past it, the answer is known
                stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return deepest


def _unsatisfiable_ref(schema: dict) -> str | None:
    """A local $ref of the schema that no finite document satisfies, or None. llguidance takes
    {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, then at some token finds that
    the text it must force never ends and fails the request at the last stage. Which refs have a finite
    instance is a least fixed point: none at first, then each whose schema has one given the others, until
    nothing changes. JSON Schema's own semantics: object and array rules bind only where `type` says so."""
    refs = _local_refs(schema)
    finite: dict[str, bool] = dict.fromkeys(refs, False)
    changed = True
    while changed:
        changed = False
        for ref, target in refs.items():
            if not finite[ref] and _has_finite(target, finite):
                finite[ref] = changed = True
    return next((ref for ref, ok in finite.items() if not ok), None)


def _local_refs(schema: dict) -> dict[str, object]:
    """Each "#..." $ref in the schema that resolves, with the subschema it names (depth is already bounded)."""
    refs, stack = {}, [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            ref = value.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in refs:
                if (target := _resolve(schema, ref)) is not None:
                    refs[ref] = target
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return refs


def _resolve(schema: dict, ref: str):
    """The subschema a "#/a/b" JSON pointer names, or None (an anchor, a missing path: llguidance's to judge)."""
    pointer = urllib.parse.unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return None
    node = schema
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdecimal() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _has_finite(schema, finite: dict[str, bool]) -> bool:
    """Whether `schema` has a finite instance, given which refs are known to (`finite`)."""
    if not isinstance(schema, dict):
        return schema is not False
    ref = schema.get("$ref")
    if isinstance(ref, str) and not finite.get(ref, True):
        return False
    if not all(_has_finite(s, finite) for s in _list(schema, "allOf")):
        return False
    if any(not any(_has_finite(s, finite) for s in _list(schema, key)) for key in ("anyOf", "oneOf")
           if _list(schema, key)):
        return False
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return any(_kind_has_finite(schema, kind, finite) for kind in kinds)


def _kind_has_finite(schema: dict, kind, finite: dict[str, bool]) -> bool:
    if kind == "object":
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        extra = schema.get("additionalProperties", True)
        return all(_has_finite(properties.get(name, extra), finite) for name in _list(schema, "required")
                   if isinstance(name, str))
    if kind == "array":
        least = schema.get("minItems", 0)
        if not isinstance(least, int) or least <= 0:
            return True
        prefix, items = _list(schema, "prefixItems"), schema.get("items", True)
        return all(_has_finite(prefix[i] if i < len(prefix) else items, finite) for i in range(min(least, len(prefix) + 1)))
    return True  # any other type (or none named) has a finite instance of its own


def _list(schema: dict, key: str) -> list:
    value = schema.get(key)
    return value if isinstance(value, list) else []


def _field(obj, key: str, kind: type, where: str, *, required: bool = False):
    if not isinstance(obj, dict):
        raise GrammarError(f"{where}: expected an object, got {type(obj).__name__} {obj!r:.80}")
    value = obj.get(key)
    if value is None:
        if required:
            raise GrammarError(f"{where}.{key}: required")
        return None
    if not isinstance(value, kind):
        want = {str: "a string", dict: "an object", bool: "true or false"}[kind]
        raise GrammarError(f"{where}.{key}: expected {want}, got {type(value).__name__} {value!r:.80}")
    return value


def _dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _library_grammar(schema: dict) -> str:
    """No free whitespace: the separators are JSON's own (", " and ": "). A small model let loose on free
    whitespace spends its tokens on it (the tiny model wrote 40 tokens of tabs and newlines inside one object,
    three seeds out of three); a schema's own "x-guidance" options still win."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def _grammar_of(grammar_text: str, specials: dict[str, int]) -> str:
    """A Sampling.grammar text as llguidance's grammar; what canonical_format cannot have made is refused."""
    try:
        spec = json.loads(grammar_text)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"grammar: not JSON: {exc}") from None
    kind = _field(spec, "type", str, "grammar", required=True)
    if kind == JSON_OBJECT:
        return _library_grammar({"type": "object"})
    if kind == JSON_SCHEMA:
        return _library_grammar(_field(spec, "schema", dict, "grammar", required=True))
    if kind == TOOL_CALLS:  # worker/tool_grammar.py's canonical_tool_calls made it
        tools = [(t["name"], json.dumps(t["schema"], ensure_ascii=False)) for t in spec["tools"]]
        return llguidance.LLMatcher.grammar_from_lark(forced_lark(spec["family"], tools, spec["parallel"], specials))
    raise GrammarError(f"grammar.type: {kind!r} is not 'json_object', 'json_schema' or 'tool_calls'")


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: tokens, special ids, EOS, and a callable that tokenizes bytes."""

    def __init__(self, tokens: list[bytes], control_ids: frozenset[int], eos_id: int,
                 encode: Callable[[str], list[int]] | None):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos_id, None
        self.special_token_ids = sorted(control_ids)
        self._encode = encode
        self._greedy = {}  # bytes -> lowest id, ordinary tokens only
        for i, t in enumerate(tokens):
            if t and i not in control_ids:
                self._greedy.setdefault(t, i)
        self._longest = max(map(len, self._greedy), default=1)

    def __call__(self, data: bytes) -> list[int]:
        if self._encode is not None:
            try:
                return list(self._encode(data.decode("utf-8")))
            except ValueError:  # not UTF-8, or text the tokenizer refuses (WorkerError is a ValueError)
                pass
        return self._greedy_ids(data)

    def _greedy_ids(self, data: bytes) -> list[int]:
        ids, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                if (i := self._greedy.get(data[at:at + n])) is not None:
                    ids.append(i)
                    at += n
                    break
            else:
                at += 1  # a byte no token spells: the vocabulary cannot write it anyway
        return ids


class CompiledGrammar:
    """One grammar text compiled against the vocabulary; matchers are copies of a matcher never advanced."""

    def __init__(self, text: str, template: llguidance.LLMatcher):
        self.text, self._template, self._lock = text, template, threading.Lock()

    def fresh(self) -> llguidance.LLMatcher:
        with self._lock:
            return self._template.deep_copy()


class GrammarCompiler:
    """A worker's vocabulary as llguidance sees it, and its compiled grammars (bounded, least recently used)."""

    def __init__(self, token_bytes: Sequence[bytes], stop_ids: Iterable[int], vocab_size: int, *,
                 control_ids: Iterable[int] = (), encode: Callable[[str], list[int]] | None = None,
                 max_cached: int = DEFAULT_MAX_CACHED):
        stops = sorted(set(stop_ids))
        if not stops or not all(0 <= i < vocab_size for i in stops):
            raise ValueError(f"stop_ids {stops}: want at least one, each below the vocabulary size {vocab_size}")
        if len(token_bytes) > vocab_size:
            raise ValueError(f"{len(token_bytes)} tokens do not fit a vocabulary of size {vocab_size}")
        tokens = list(token_bytes) + [b""] * (vocab_size - len(token_bytes))  # padding ids: never allowed
        controls = frozenset(control_ids)
        vocab = _Vocabulary(tokens, controls | frozenset(stops), stops[0], encode)
        self.vocab_size, self.stop_ids = vocab_size, frozenset(stops)
        self._specials = {tokens[i].decode("utf-8", "replace"): i for i in controls if i < vocab_size}
        self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=vocab_size,
                                                 eos_token=stops)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._max_cached, self._lock = max_cached, threading.Lock()

    def compile(self, grammar_text: str) -> CompiledGrammar:
        with self._lock:
            if (hit := self._cache.get(grammar_text)) is not None:
                self._cache.move_to_end(grammar_text)
                return hit
        template = llguidance.LLMatcher(self._tokenizer, _grammar_of(grammar_text, self._specials), log_level=0,
                                        limits=_LIMITS)
        if template.is_error():
            raise GrammarError(f"grammar: {template.get_error()}")
        with self._lock:  # another thread may have compiled the same text meanwhile: keep the first
            compiled = self._cache.setdefault(grammar_text, CompiledGrammar(grammar_text, template))
            self._cache.move_to_end(grammar_text)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return compiled

    def matcher(self, grammar_text: str) -> Matcher:
        return Matcher(self.compile(grammar_text).fresh(), self.vocab_size)


class Matcher:
    """One request's place in its grammar: the tokens allowed next, and the token taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._m, self._vocab_size = matcher, vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype="<i4")  # little-endian: token 32w + b is word w's bit b
        self._mask: np.ndarray | None = None  # allowed() since the last accept
        self._lock = threading.Lock()

    def allowed(self) -> np.ndarray:
        with self._lock:
            return self._allowed()

    def _allowed(self) -> np.ndarray:
        if self._mask is None:
            self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self._vocab_size].view(bool)
            mask.flags.writeable = False  # accept() checks against it
            self._mask = mask
        return self._mask

    def accept(self, token_id: int) -> None:
        token_id = operator.index(token_id)
        with self._lock:
            if not 0 <= token_id < self._vocab_size:
                raise GrammarError(f"token {token_id} is not in the vocabulary (size {self._vocab_size})")
            if not self._allowed()[token_id]:
                raise GrammarError(f"token {token_id} is not allowed here by the response_format")
            if not self._m.consume_token(token_id):
                raise GrammarError(f"token {token_id}: {self._m.get_error()}")
            self._mask = None

    @property
    def complete(self) -> bool:
        with self._lock:
            return self._m.is_accepting()

    @property
    def done(self) -> bool:
        with self._lock:
            return self._m.is_stopped()
