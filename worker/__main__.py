"""Single-process generation over the whole model (`python -m worker`), or an in-process chain of
stage slices (`--stages N`) that must print the same tokens: the reference the pipeline answers to."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .chain import run_chain
from .config import DEFAULT_CONTEXT
from .contract import Sampling
from .errors import ModelFileError, ModelNameError, WorkerError
from .partition import Shard
from .weights.fetch import DEFAULT_MODEL, default_cache_dir, default_ollama_dir
from .models import open_model, open_worker
from .reference import generate_full


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"a known name such as {DEFAULT_MODEL} or llama3.2:1b, a .gguf "
                   "file, a Hugging Face directory, or tiny / stub (built in, random weights: random text) "
                   f"(default {DEFAULT_MODEL})")
    p.add_argument("--prompt", default="Say hello")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ctx", type=int, default=DEFAULT_CONTEXT,
                   help=f"context in tokens, prompt and answer: the KV allocated (default {DEFAULT_CONTEXT})")
    p.add_argument("--stages", type=int, default=0, help="run N stage slices in-process instead of one model")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return generate(args)
    except (ModelFileError, ModelNameError, WorkerError) as exc:  # a broken file, an unknown name, a prompt it refuses
        print(f"python -m worker: error: {exc}", file=sys.stderr)
        return 2


def generate(args: argparse.Namespace) -> int:
    home = Path.home()
    model = open_model(args.model, cache_dir=default_cache_dir(home, os.environ.get("XDG_CACHE_HOME")),
                       ollama_models_dir=default_ollama_dir(home, os.environ.get("OLLAMA_MODELS")), max_context=args.ctx)
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    tok = model.tokenizer()
    prompt_ids = tok.encode_prompt(args.prompt) if args.raw else tok.encode_chat(args.prompt)
    start = time.perf_counter()
    if args.stages:
        workers = [open_worker(model, Shard.of(s, args.stages)) for s in range(args.stages)]
        ids = run_chain(workers, prompt_ids, args.max_tokens, sampling=sampling).token_ids
    else:
        ids = generate_full(model, prompt_ids, args.max_tokens, sampling).token_ids
    elapsed = time.perf_counter() - start
    text = tok.decode([i for i in ids if i not in tok.stop_ids])
    if args.json:
        print(json.dumps({"text": text, "token_ids": ids, "prompt_token_ids": prompt_ids, "seconds": elapsed}))
    else:
        print(text)
        print(f"[{len(ids)} tokens in {elapsed:.2f} s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
