"""What a request's tools cost, at the bounds the API allows: checking `tools` and building the forced call's
grammar text at the entry (a worker thread there), compiling it against SmolLM2's 49k vocabulary at the last
stage (its compute thread), and the first mask. The tools are as many copies as fit in MAX_TOOLS_CHARS (at
most MAX_TOOLS) of a function with 20 enum properties, under tool_choice "required".

  python -m bench.tool_cost                 # the worst case the bounds allow
  python -m bench.tool_cost --tools 1       # one such tool
"""
from __future__ import annotations

import argparse
import json
import time

from node.api.openai_tools import MAX_TOOLS, MAX_TOOLS_CHARS
from node.api.openai_wire import Limits, parse_request
from worker.tokens.tokenizer import tokenizer_from_gguf_metadata
from worker.tokens.vocabulary import Vocabulary
from worker.weights.fetch import DEFAULT_MODEL, installed_model
from worker.weights.gguf_header import read_header

PROPERTIES = {f"p{i}": {"type": "string", "enum": [f"v{j}" for j in range(8)]} for i in range(20)}


def tools(count: int) -> list[dict]:
    one = lambda i: {"type": "function", "function": {"name": f"f{i}", "parameters": {  # noqa: E731
        "type": "object", "properties": PROPERTIES, "required": list(PROPERTIES)[:5]}}}
    out = [one(i) for i in range(count)]
    while len(json.dumps(out)) > MAX_TOOLS_CHARS:
        out.pop()
    return out


def smollm2() -> Vocabulary:
    path = installed_model(DEFAULT_MODEL)
    with path.open("rb") as f:
        kv = read_header(f, path.stat().st_size, path).kv
    tok = tokenizer_from_gguf_metadata(kv, path)
    return Vocabulary(tok, vocab_size=tok.vocab_size, max_context=2048)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", type=int, default=MAX_TOOLS)
    args = p.parse_args()
    listed = tools(args.tools)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": listed, "tool_choice": "required"}
    t0 = time.perf_counter()
    api = parse_request(body, chat=True, seed_if_unset=0, limits=Limits())
    t1 = time.perf_counter()
    compiler = smollm2().grammar_compiler()
    t2 = time.perf_counter()
    matcher = compiler.matcher(api.sampling.grammar)
    t3 = time.perf_counter()
    matcher.allowed()
    t4 = time.perf_counter()
    print(f"{len(listed)} tools, {len(json.dumps(listed))} characters of JSON: checked at the entry in "
          f"{t1 - t0:.3f} s; compiled at the last stage in {t3 - t2:.3f} s; first mask {1e3 * (t4 - t3):.2f} ms")


if __name__ == "__main__":
    main()
