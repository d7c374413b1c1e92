#!/usr/bin/env python3
"""ppsmoke.py — run a pipeline end to end: start N nodes, converge them, send one prompt, print the
answer as it is generated, tear everything down. Any failure stops every node and exits 1, naming the
stage at fault. With --serve, keep the cluster up behind an OpenAI-compatible API until Ctrl-C.

Two kinds of secret: the cluster token (--token, --token-file, PP_CLUSTER_TOKEN; random per run by default)
is the nodes' own and never leaves them; clients use a client API key (--api-key, --api-key-file,
PP_API_KEY; random and printed as OPENAI_API_KEY=... by default). The vast.ai key is --vast-api-key or
VAST_API_KEY. A secret in argv is visible to every local user: prefer the variables or the files.

  python ppsmoke.py --seed -n 5                                  # 5 local node processes, SmolLM2-135M
  python ppsmoke.py --seed -n 5 --model llama3.2:1b --prompt "Say hello"
  python ppsmoke.py --seed -n 5 --serve --port 8000              # then use http://127.0.0.1:8000/v1
  python ppsmoke.py --seed -n 5 --serve --host 0.0.0.0 --port 8000  # reachable from other machines too
  PP_API_KEY=... python ppsmoke.py --seed -n 5 --serve --port 8000  # the clients' key of your choosing
  python ppsmoke.py --seed -n 3 --serve --standby 1               # a warm spare takes a lost stage in seconds
  VAST_API_KEY=... python ppsmoke.py --vastai -n 5 --image you/pp-node:1 --model llama3.2:1b
  VAST_API_KEY=... python ppsmoke.py --vastai --destroy-leftovers
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path

import trio

from node.transport.app import ListenError, check_listenable
from node.config.cores import MAX_THREADS, available_cores, fair_share
from node.config.model import KV_CACHE_DTYPES, memory_size
from node.config.network import LOOPBACK
from node.config.sources import ConfigError
from roles import DEFAULT_MAX_QUEUE
from roles.messages import MAX_TOKENS_LIMIT, is_http_url
from runner.report import as_json, stats_line
from runner.secrets import secrets_of
from runner.common import RunFailed, Stopped
from runner.seed import SeedOptions, run_seed
from runner.vastai import VastOptions, destroy_leftovers, run_vastai
from node.config.settings import DEFAULT_MAX_SEQS
from worker.compute.cpu_target import check_name
from worker.config import DEFAULT_CONTEXT
from worker.contract import Sampling
from worker.tool_formats import FAMILIES
from worker.weights.contract import PRECISIONS
from worker.weights.fetch import DEFAULT_MODEL, REGISTRY, default_cache_dir, default_ollama_dir
from worker.partition import AUTO, Shard, parse_partition
from worker.sources import check_source, open_source
from worker.weights.tiny import BUILT_IN


def build_parser() -> argparse.ArgumentParser:
    """ppsmoke's flags, without parsing: parse_args's, and the README's table (tools/reference_tables.py)."""
    p = argparse.ArgumentParser(prog="ppsmoke.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for add_group in (_cluster_arguments, _prompt_arguments, _timeout_arguments, _node_arguments, _serve_arguments,
                      _secret_arguments, _vast_arguments):
        add_group(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    problems = [*flag_problems(args), *argument_problems(args)]
    if args.vastai and not args.destroy_leftovers and not args.image:
        problems.append("--vastai needs --image: build this repo's Dockerfile, push it, and name it here")
    if problems:
        p.error(problems[0])
    args.host = args.host and args.host.strip()
    return args


def _cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the cluster (--seed or --vastai)")
    mode = g.add_mutually_exclusive_group(required=True)
    mode.add_argument("--seed", action="store_true", help="spawn the N nodes as local processes")
    mode.add_argument("--vastai", action="store_true", help="rent N GPU instances on vast.ai")
    g.add_argument("-n", "--num-stages", type=int, default=5, help="number of stages, at least 2 (default 5)")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"a known name such as {DEFAULT_MODEL} (SmolLM2-135M-Instruct, "
                   "installed by install.sh) or llama3.2:1b, a .gguf file, a Hugging Face directory, or tiny "
                   f"(built in, random weights: its output is random text) (default {DEFAULT_MODEL})")


def _prompt_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the prompt (without --serve)")
    g.add_argument("--prompt", default="Say hello", help="sent as one user turn, through the model's chat template")
    g.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: draw from the fewest most likely "
                   "tokens whose probabilities reach this (1 = every token)")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of text")


def _timeout_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("timeouts (seconds)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer (default 600)")
    g.add_argument("--converge-timeout", type=float, default=180.0,
                   help="seconds for all stages to load and join (default 180)")


def _node_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("each node (memory, kernels, caching)")
    g.add_argument("--max-seqs", type=int, default=DEFAULT_MAX_SEQS,
                   help=f"requests each node serves at once, each with its own KV (default {DEFAULT_MAX_SEQS})")
    g.add_argument("--ctx", "--max-model-len", dest="ctx", type=int, default=DEFAULT_CONTEXT,
                   help=f"context per request in tokens, prompt and answer; a request's KV is taken as it is "
                        f"written, within --kv-cache-memory; at most the model's own (default {DEFAULT_CONTEXT})")
    g.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests waiting at the entry for a free slot before it answers 429 "
                        f"(default {DEFAULT_MAX_QUEUE})")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="turn the prefix cache off: every request computes its whole prompt, even where an earlier "
                        "one shared its start (multi-turn chat, a system prompt); default on")
    g.add_argument("--threads", "-t", type=int, metavar="T",
                   help="cores each node computes on (PP_THREADS); default: with --seed, this machine's cores shared "
                        "out among the nodes (at least 1 each); rented, every core of its machine")
    g.add_argument("--cpu-target", default="native", metavar="CPU",
                   help="the CPU every node's kernels are built for: native, or a clang CPU name such as x86-64-v2 "
                        "or x86-64-v3 for portable code (PP_CPU_TARGET; default native)")
    g.add_argument("--beam", type=int, default=0, help="kernel search at each node's boot (tinygrad's BEAM width, "
                   "e.g. 2): minutes the first time, cached on disk after (default 0 = off)")
    g.add_argument("--layer-partition", default="auto", metavar="SPLIT",
                   help="how the model's blocks are split over the stages: auto (each node measures a block's step "
                        "and the head's, and stage 0 plans), equal, or each stage's block count, comma-separated, "
                        "e.g. 8,8,14 (vLLM's VLLM_PP_LAYER_PARTITION; default auto)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="what every node's KV caches hold: float16 (half the bytes) or float32 (PP_KV_CACHE_DTYPE; "
                        "default auto = float16; float32 on an x86 CPU without F16C)")
    g.add_argument("--kv-cache-memory", default="auto", metavar="BYTES", help="the memory each node's KV may fill, "
                   "e.g. 2G; past it requests wait or the newest is preempted (default auto: half the free memory)")
    g.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="which weights stay as the model file holds them, read so by the kernels (less memory): "
                        "auto = Q8_0 and Q4_1, F16 and BF16 too with --beam; file = those four always; f32 = none; "
                        "every other weight is widened to f32 at load (default auto)")


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving the OpenAI API (--serve)")
    g.add_argument("--serve", action="store_true",
                   help="keep the cluster up and serve the OpenAI API on stage 0 until Ctrl-C, instead of one prompt")
    g.add_argument("--host", help="--seed: the interface stage 0 (the API) listens on, as vllm serve's --host: "
                   "0.0.0.0 or :: for every one (default 127.0.0.1, this machine only; the other stages stay there)")
    g.add_argument("--standby", type=int, default=0, metavar="K",
                   help="--seed --serve: K warm spares, each with every stage but the first loaded, started once the "
                        "cluster is up; a lost stage is handed to one instead of a new process (default 0)")
    g.add_argument("--port", type=int, help="--seed: the port stage 0 (the API) listens on, so the API's URL stays "
                   "the same (default: any free port)")
    g.add_argument("--tool-call-parser", choices=("auto", *FAMILIES), default="auto", help="the format tool calls "
                   "are read in (vLLM's flag; default auto: the chat template's, or generic where it takes no tools)")


def _secret_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("secrets (on a command line every local user sees them: prefer the variables or files)")
    token = s.add_mutually_exclusive_group()
    token.add_argument("--token", help="the cluster token: the nodes' own secret, never a client's "
                       "(default: $PP_CLUSTER_TOKEN, else random per run)")
    token.add_argument("--token-file", metavar="PATH", type=Path, help="a file holding the cluster token")
    s.add_argument("--api-key", metavar="KEY", action="append", help="a client API key: it opens the OpenAI API, "
                   "/tokenize, /detokenize, /tokenizer_info, /v1/pipeline and /metrics, nothing else; repeat for "
                   "several (default: $PP_API_KEY, comma-separated, else a random one, printed)")
    s.add_argument("--api-key-file", metavar="PATH", help="a file of client API keys, one a line, taken with "
                   "--api-key's (default: $PP_API_KEY_FILE)")


def _vast_arguments(p: argparse.ArgumentParser) -> None:
    v = p.add_argument_group("vast.ai (--vastai)")
    v.add_argument("--vast-api-key", metavar="KEY", help="your vast.ai API key (default: $VAST_API_KEY)")
    v.add_argument("--vastai-url", help="API base URL (default: $VAST_URL, else https://console.vast.ai)")
    v.add_argument("--image", help="the node image to run: build and push this repo's Dockerfile")
    v.add_argument("--max-dph", type=float, help="most $/hour per instance")
    v.add_argument("--min-gpu-ram", type=float, default=8.0, help="GB of GPU memory per instance (default 8)")
    v.add_argument("--min-reliability", type=float, default=0.98, help="vast.ai host reliability (default 0.98)")
    v.add_argument("--disk", type=float, default=20.0, help="GB of disk per instance (default 20)")
    v.add_argument("--running-timeout", type=float, default=600.0,
                   help="seconds for each instance to reach running (default 600)")
    v.add_argument("--status-poll", type=float, default=5.0, help="seconds between instance status checks (default 5)")
    v.add_argument("--ledger", type=Path, help="where live instance ids are recorded "
                   "(default: $XDG_CACHE_HOME/pp/vastai-live.json)")
    v.add_argument("--destroy-leftovers", action="store_true",
                   help="destroy every instance a killed run left in the ledger, then exit")


def flag_problems(args: argparse.Namespace) -> list[str]:
    """Flags that contradict each other or the launch mode, and counts out of range."""
    problems = []
    if args.num_stages < 2:
        problems.append(f"-n {args.num_stages}: a pipeline needs at least 2 stages; for one process run "
                        "`python -m worker --model ...`")
    if args.port is not None and (args.vastai or not 1 <= args.port <= 65535):
        problems.append("--port is for --seed (vast.ai maps its own public ports), 1..65535")
    if args.host is not None and args.vastai:
        problems.append("--host is for --seed: a rented node listens on every interface of its container, behind "
                        "vast.ai's port mapping")
    if args.host is not None and not args.host.strip():
        problems.append("--host is empty: name an interface's address, such as 127.0.0.1 or 0.0.0.0")
    if args.standby and (args.standby < 0 or args.vastai or not args.serve):
        problems.append("--standby K is for --seed --serve: K >= 0 local spares that take a lost stage (a rented "
                        "cluster gets none yet)")
    if args.serve and args.json:
        problems.append("--json describes one answer; --serve answers many")
    if args.max_seqs < 1 or args.max_queue < 0:
        problems.append("--max-seqs must be at least 1 and --max-queue at least 0")
    try:
        parse_partition(args.layer_partition, max(args.num_stages, 2))
    except ValueError as exc:
        problems.append(f"--layer-partition {args.layer_partition}: {exc}")
    try:
        memory_size(args.kv_cache_memory)
    except ValueError as exc:
        problems.append(f"--kv-cache-memory {args.kv_cache_memory}: {exc}")
    if args.beam < 0:
        problems.append("--beam must be 0 (off) or a search width of at least 1")
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        problems.append(f"--threads must be 1..{MAX_THREADS}")
    try:
        check_name(args.cpu_target)
    except ValueError as exc:
        problems.append(f"--cpu-target: {exc}")
    return problems


def argument_problems(args: argparse.Namespace) -> list[str]:
    """Values argparse's types let through that the run would only trip over once nodes exist."""
    problems = []
    if not args.model.strip():
        problems.append("--model is empty: name a model (tiny, llama3.2:1b, ...) or a file")
    elif args.vastai and not args.destroy_leftovers and not rentable_model(args.model):
        problems.append(f"--model {args.model!r}: a rented node cannot read this machine's files; give a built-in "
                        f"model, a known name ({', '.join(sorted(REGISTRY))}) or an http(s) URL of a GGUF")
    if args.ctx < 16:
        problems.append(f"--ctx {args.ctx}: must be at least 16 tokens")
    if not 1 <= args.max_tokens <= MAX_TOKENS_LIMIT:
        problems.append(f"--max-tokens {args.max_tokens}: must be 1..{MAX_TOKENS_LIMIT}")
    if not 0.0 <= args.temperature < math.inf:
        problems.append(f"--temperature {args.temperature}: must be 0 (greedy) or more")
    if not 0.0 < args.top_p <= 1.0:
        problems.append(f"--top-p {args.top_p}: must be in (0, 1]")
    for flag in ("timeout", "converge_timeout", "running_timeout", "status_poll"):
        value = getattr(args, flag)
        if not 0.0 < value < math.inf:
            problems.append(f"--{flag.replace('_', '-')} {value}: must be a positive number of seconds")
    for flag in ("min_gpu_ram", "disk", "min_reliability", "max_dph"):
        value = getattr(args, flag)
        if value is not None and not 0.0 <= value < math.inf:
            problems.append(f"--{flag.replace('_', '-')} {value}: must be 0 or more")
    return problems


def rentable_model(spec: str) -> bool:
    """Whether a rented node can get this model by itself: built in, a known name, or a URL it fetches."""
    name = spec.strip().lower()
    return name == "stub" or name in BUILT_IN or name in REGISTRY or is_http_url(spec.strip())


def local_model(spec: str, env: dict[str, str]) -> tuple[str, int | None]:
    """Fetch a named model (llama3.2:1b ...) once, here, so N local nodes don't each download it, and check
    that a model file is one (header, config, vocabulary: worker.sources) before any node starts. Built-in
    models and URLs go to the nodes as given (each fetches its own slice). Returns what the nodes are given and
    the model's blocks where known here. Raises ValueError (ModelFileError included) naming what is wrong."""
    name = spec.strip().lower()
    if name == "stub" or name in BUILT_IN or is_http_url(spec.strip()):
        return spec, None
    source = open_source(spec, cache_dir=default_cache_dir(Path.home(), env.get("XDG_CACHE_HOME")),
                         ollama_models_dir=default_ollama_dir(Path.home(), env.get("OLLAMA_MODELS")))
    check_source(source)
    blocks = None if source is None else source.config.n_layers
    return (source.path if name in REGISTRY else spec), blocks


def partition_fits(text: str, num_stages: int, blocks: int | None) -> None:
    """--layer-partition covers the model's `blocks` (where known before the nodes start); ValueError if not."""
    partition = parse_partition(text, num_stages)
    if blocks is not None:
        Shard.of(0, num_stages, None if partition == AUTO else partition).sized(blocks)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    try:
        args.secrets = secrets_of(args, env)
    except ConfigError as exc:
        print(f"ppsmoke.py: error: {exc}", file=sys.stderr)
        return 2
    progress = lambda line: print(f"ppsmoke: {line}", file=sys.stderr, flush=True)  # noqa: E731
    live = not args.json and sys.stdout.isatty()  # a person watching: the answer as it is generated
    on_text = (lambda text: print(text, end="", flush=True)) if live else (lambda text: None)
    announce = lambda line: print(line, flush=True)  # noqa: E731
    if not args.vastai:
        try:  # a named model is fetched here, once, before any node exists
            args.model_path, blocks = local_model(args.model, env)
        except ValueError as exc:  # ModelFileError (a failed download included) or an unknown name
            print(f"ppsmoke: error: --model: {exc}", file=sys.stderr)
            return 2
        try:
            partition_fits(args.layer_partition, args.num_stages, blocks)
        except ValueError as exc:
            print(f"ppsmoke: error: --layer-partition {args.layer_partition}: {exc}", file=sys.stderr)
            return 2
        try:  # before any node exists: a taken port or an address not this machine's is one line
            if args.host is not None or args.port is not None:
                check_listenable(args.host or LOOPBACK, args.port or 0)
        except ListenError as exc:
            named = " ".join(f"{flag} {value}" for flag, value in (("--host", args.host), ("--port", args.port))
                             if value is not None)
            print(f"ppsmoke: error: {named}: {exc}", file=sys.stderr)
            return 2
    try:
        if args.vastai:
            if args.destroy_leftovers:
                trio.run(destroy_leftovers, args.secrets.vast_api_key, _vast_url(args, env), _ledger(args, env),
                         progress)
                return 0
            result = trio.run(functools.partial(run_vastai, _vast_options(args, env), progress, on_text=on_text,
                                                announce=announce))
        else:
            result = trio.run(functools.partial(run_seed, _seed_options(args, env), progress, on_text=on_text,
                                                announce=announce))
    except Stopped as exc:
        progress(f"{exc}; done")
        return 0
    except RunFailed as exc:
        if live:
            print(flush=True)
        progress(f"FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        progress("interrupted; everything was stopped")
        return 1
    if args.json:
        print(as_json(result, args.model))
    else:
        print("" if live else result.response.text)
        progress(stats_line(result))
    return 0


def _seed_options(args, env) -> SeedOptions:
    return SeedOptions(num_stages=args.num_stages, model=args.model_path, prompt=args.prompt,
                       max_tokens=args.max_tokens, sampling=Sampling(args.temperature, args.top_p),
                       timeout_s=args.timeout, converge_timeout_s=args.converge_timeout,
                       base_env={**env, **serving_env(args), "PP_THREADS": str(seed_threads(args, available_cores()))}, serve=args.serve, token=args.secrets.token,
                       api_keys=args.secrets.api_keys, host=args.host, port=args.port, model_name=args.model,
                       standby=args.standby)


def _vast_options(args, env) -> VastOptions:
    # the model goes to the nodes as given: each stage range-fetches its own slice of a named model
    return VastOptions(num_stages=args.num_stages, model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
                       sampling=Sampling(args.temperature, args.top_p), timeout_s=args.timeout,
                       converge_timeout_s=args.converge_timeout, vast_api_key=args.secrets.vast_api_key,
                       base_url=_vast_url(args, env), image=args.image, ledger_path=_ledger(args, env),
                       disk_gb=args.disk, min_gpu_ram_gb=args.min_gpu_ram, min_reliability=args.min_reliability,
                       max_dph=args.max_dph, running_timeout_s=args.running_timeout,
                       poll_status_s=args.status_poll, node_settings=serving_env(args), serve=args.serve,
                       token=args.secrets.token, api_keys=args.secrets.api_keys)


def seed_threads(args, cores: int) -> int:
    """--seed: every node and spare shares this machine's `cores`, unless --threads says otherwise."""
    return args.threads or fair_share(cores, args.num_stages + (args.standby or 0))


def serving_env(args) -> dict[str, str]:
    """The settings every node gets the same: requests at once and their context, cores, the kernels' CPU, kernel search,
    precision, the layer partition, KV, the prefix cache, the tool-call format."""
    return {**({"PP_THREADS": str(args.threads)} if args.threads else {}), "PP_MAX_SEQS": str(args.max_seqs),
            "PP_MAX_QUEUE": str(args.max_queue), "PP_CTX": str(args.ctx), "PP_BEAM": str(args.beam),
            "PP_CPU_TARGET": args.cpu_target,
            "PP_PRECISION": args.precision, "PP_LAYER_PARTITION": args.layer_partition,
            "PP_KV_CACHE_DTYPE": args.kv_cache_dtype, "PP_KV_CACHE_MEMORY": args.kv_cache_memory,
            "PP_TOOL_CALL_PARSER": args.tool_call_parser, **({"PP_NO_PREFIX_CACHE": "1"} if args.no_prefix_cache else {})}


def _vast_url(args, env) -> str:
    return (args.vastai_url or env.get("VAST_URL") or "https://console.vast.ai").rstrip("/")


def _ledger(args, env) -> Path:
    return args.ledger or default_cache_dir(Path.home(), env.get("XDG_CACHE_HOME")) / "vastai-live.json"


if __name__ == "__main__":
    sys.exit(main())
