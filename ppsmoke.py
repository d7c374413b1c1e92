#!/usr/bin/env python3
"""ppsmoke.py — run a pipeline end to end: start N nodes, converge them, send one prompt, print the
answer, tear everything down. Any failure stops every node and exits 1, naming the stage at fault.

  python ppsmoke.py --seed -n 5                                  # 5 local node processes, the tiny model
  python ppsmoke.py --seed -n 5 --model llama3.2:1b --prompt "Say hello"
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import trio

from runner.report import as_json, stats_line
from runner.seed import RunFailed, SeedOptions, run_seed
from worker.fetch import REGISTRY, default_cache_dir, default_ollama_dir, resolve_model
from worker.sampling import Sampling


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ppsmoke.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--seed", action="store_true", help="spawn the N nodes as local processes")
    mode.add_argument("--vastai", action="store_true", help="rent N GPU instances on vast.ai (not available yet)")
    p.add_argument("-n", "--num-stages", type=int, default=5, help="number of stages, at least 2 (default 5)")
    p.add_argument("--model", default="tiny", help="tiny (built-in, random weights: its output is random text), "
                   "stub, a .gguf file, a Hugging Face directory, or a name such as llama3.2:1b (default tiny)")
    p.add_argument("--prompt", default="Say hello")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer (default 600)")
    p.add_argument("--converge-timeout", type=float, default=180.0,
                   help="seconds for all stages to load and join (default 180)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of text")
    args = p.parse_args(argv)
    if args.num_stages < 2:
        p.error(f"-n {args.num_stages}: a pipeline needs at least 2 stages; for one process run "
                "`python -m worker --model ...`")
    if args.vastai:
        p.error("--vastai is not available yet; use --seed")
    return args


def local_model(spec: str, env: dict[str, str]) -> str:
    """Fetch a named model (llama3.2:1b ...) once, here, so N local nodes don't each download it.
    Paths, tiny and stub go to the nodes as given: each node reports its own trouble with them."""
    if spec.strip().lower() not in REGISTRY:
        return spec
    ref = resolve_model(spec, cache_dir=default_cache_dir(Path.home(), env.get("XDG_CACHE_HOME")),
                        ollama_models_dir=default_ollama_dir(Path.home(), env.get("OLLAMA_MODELS")))
    return str(ref.path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    progress = lambda line: print(f"ppsmoke: {line}", file=sys.stderr, flush=True)  # noqa: E731
    opts = SeedOptions(num_stages=args.num_stages, model=local_model(args.model, env), prompt=args.prompt,
                       max_tokens=args.max_tokens, sampling=Sampling(args.temperature, args.top_p),
                       timeout_s=args.timeout, converge_timeout_s=args.converge_timeout, base_env=env)
    try:
        result = trio.run(run_seed, opts, progress)
    except RunFailed as exc:
        progress(f"FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        progress("interrupted; every node was stopped")
        return 1
    if args.json:
        print(as_json(result, args.model))
    else:
        print(result.response.text)
        progress(stats_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
