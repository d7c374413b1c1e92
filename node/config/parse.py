"""The node's entrypoint parse: its flags and --help (with the variable each flag stands for), and
parse_config, which reads every setting once, from the flags and the environment, into a frozen NodeConfig.

Every setting has an environment variable (how orchestrators such as vast.ai pass settings) and most have a
flag; a flag wins over its variable.
"""
from __future__ import annotations

import argparse
import random
import secrets
from collections.abc import Mapping
from pathlib import Path

from node.config.cores import MACHINE_ID, MAX_THREADS, available_cores, converts_half, machine_id
from node.config.credentials import (API_KEY_ENV, API_KEY_FILE_ENV, TOKEN_ENV, TOKEN_IS_API_KEY_ENV,
                                     api_tls, client_api_keys, cluster_token)
from node.config.model import (kv_cache_dtype, kv_cache_memory, layer_partition, model_spec, precision,
                               tool_call_parser)
from node.config.network import (DEFAULT_BIND, DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT, link_faults, link_streams,
                                 listen_port, max_body, optional_url, peer_urls, public_port)
from node.config.settings import DEFAULT_CHUNKED_PREFILL, DEFAULT_LOG_LEVEL, DEFAULT_MAX_SEQS, LOG_LEVELS, NodeConfig
from node.config.sources import ConfigError, Sources, count, env_switch, required_int, switch, text
from roles import DEFAULT_MAX_QUEUE
from worker.compute.cpu_target import NATIVE, check_name, host_arch, host_cpu_flags
from worker.config import DEFAULT_CONTEXT
from worker.partition import check_stage
from worker.weights.fetch import DEFAULT_MODEL, default_cache_dir, default_ollama_dir


# (variable, flag, meaning): the --help epilog, and the variable each flag stands for.
ENV_TABLE = (
    ("STAGE", "--stage", "this node's stage, 0 .. NUM_STAGES-1 (required, but for a standby)"),
    ("NUM_STAGES", "--num-stages", "how many stages the pipeline has, at least 2 (required)"),
    (TOKEN_ENV, "", "secret shared by the cluster's nodes, for them only (required; no flag: it would show in ps)"),
    (API_KEY_ENV, "--api-key", "the clients' API key; several comma-separated, or the flag repeated: opens the "
                               "OpenAI API, /tokenize, /detokenize, /tokenizer_info, /v1/pipeline and /metrics, "
                               "nothing else (none: those answer 401); /health and the chat page (/) need no key"),
    (API_KEY_FILE_ENV, "--api-key-file", "a file of client API keys, one a line (taken with PP_API_KEY's)"),
    (TOKEN_IS_API_KEY_ENV, "--token-is-api-key", "1: the cluster token opens the client surface too (0)"),
    ("PP_TLS_CERT", "--tls-cert", "stage 0: a PEM certificate (chain) to serve the API over TLS with, for clients "
     "that connect straight to it; with it, plain HTTP is refused. Between nodes everything is TLS whatever this "
     "says, under certificates derived from PP_CLUSTER_TOKEN (none: the API is plain HTTP)"),
    ("PP_TLS_KEY", "--tls-key", "the private key of PP_TLS_CERT"),
    ("SEED_ADDR", "--seed-addr", "a node to join through, e.g. http://10.0.0.5:8000 or 10.0.0.5:8000"),
    ("PEER_DIRECT", "--peer-direct", "comma-separated addresses of peers to dial directly"),
    ("MODEL", "--model", f"a known name such as {DEFAULT_MODEL} or llama3.2:1b, a .gguf file, a Hugging Face "
                          f"directory, or tiny / stub (built in, random) (default {DEFAULT_MODEL})"),
    ("PP_MODEL_NAME", "--model-name", "the model's name in the OpenAI API on stage 0 (default: MODEL as given)"),
    ("PP_PORT", "--port", f"port to listen on; 0 = any free port ({DEFAULT_PORT})"),
    ("PP_BIND", "--bind", f"address to listen on ({DEFAULT_BIND})"),
    ("PP_ADVERTISE_ADDR", "--advertise-addr", "address other nodes use to reach this one (default: guessed)"),
    ("PUBLIC_IPADDR", "", "this machine's public IP (vast.ai sets it inside its containers)"),
    ("VAST_TCP_PORT_<PP_PORT>", "", "public port mapped to PP_PORT (vast.ai sets it)"),
    ("PP_NODE_ID", "--node-id", "unique name of this node (stage<STAGE>-<8 random hex digits>)"),
    ("PP_MAX_BODY", "", f"largest request body accepted, in bytes ({DEFAULT_MAX_BODY_BYTES >> 20} MiB)"),
    ("PP_MAX_SEQS", "--max-seqs", f"requests in flight at once: each holds a KV cache on every stage ({DEFAULT_MAX_SEQS})"),
    ("PP_CTX", "--ctx", f"context of each request, prompt and answer, in tokens; its KV is taken as it is written, "
                        f"within PP_KV_CACHE_MEMORY; at most the model's own ({DEFAULT_CONTEXT})"),
    ("PP_CHUNKED_PREFILL_SIZE", "--chunked-prefill-size", "prompt rows one step takes at most, beside the decode "
     f"rows: smaller keeps streams decoding while a long prompt is read, larger reads it sooner ({DEFAULT_CHUNKED_PREFILL})"),
    ("PP_NO_PREFIX_CACHE", "--no-prefix-cache", "1: stage 0 keeps no finished request's KV, so every request computes "
     "its whole prompt (the prefix cache is on by default)"),
    ("PP_MAX_QUEUE", "--max-queue", f"stage 0: requests waiting for a free slot; past it, 429 ({DEFAULT_MAX_QUEUE})"),
    ("PP_THREADS", "--threads", "cores a step computes on, like llama.cpp's -t: its matrices and attention split over "
     "them (default: every core this process may use)"),
    ("PP_CPU_TARGET", "--cpu-target", "the CPU pp's kernels are built for: native (this one), or a clang CPU name "
     "such as x86-64-v2, x86-64-v3, znver3, neoverse-n1: portable code, one build for a fleet; where they cannot be "
     "built the node computes on tinygrad's own kernels and says why (native)"),
    ("PP_BEAM", "--beam", "kernel search at boot: tinygrad's BEAM width, e.g. 2; minutes once, cached on disk for the next boot (0 = off)"),
    ("PP_LAYER_PARTITION", "--layer-partition", "auto: each node measures a block's step and the head's, and stage 0 "
     "plans the split; equal: the spec's even split; or each stage's block count, comma-separated, e.g. 8,8,14 "
     "(vLLM's VLLM_PP_LAYER_PARTITION); every stage must be given the same (auto)"),
    ("PP_MACHINE_ID", "--machine-id", "which machine's cores this node computes on. With auto, the nodes of one "
     "machine are timed once, by the lowest stage among them, and where every stage shares one machine none is "
     "timed (they count as one speed). Default: from the kernel's boot id and the process's CPU cgroup and affinity"),
    ("PP_PRECISION", "--precision", "which weights stay as the file holds them, read so by the kernels. auto: Q8_0 "
     "and Q4_1, F16 and BF16 too with --beam; file: those four always; f32: none. Every other weight is widened to "
     "f32 at load (auto)"),
    ("PP_KV_CACHE_DTYPE", "--kv-cache-dtype", "what the KV caches hold: float16 (half the bytes) or float32; "
     "auto = float16, or float32 on an x86 CPU without F16C (vLLM's --kv-cache-dtype)"),
    ("PP_TOOL_CALL_PARSER", "--tool-call-parser", "the format tool calls are read in (vLLM's flag): auto = the chat "
     "template's family, or the generic format where the template takes no tools; or hermes, llama3_json, mistral, "
     "generic (auto)"),
    ("PP_KV_CACHE_MEMORY", "--kv-cache-memory", "the memory this stage's KV may fill, e.g. 2G or 512M; stage 0 admits "
     "requests, and preempts the newest, so that no stage's KV outgrows it. auto: half the memory free at boot, "
     "shared by the stages on this machine, and no more than every slot's whole context (auto)"),
    ("PP_LINKS", "--links", "stream: messages to the next stage as frames of one long-lived HTTP/2 stream; post: a POST each (stream)"),
    ("PP_FAULTS", "", "chaos testing: drop=P,delay=P,delay_ms=MS,seed=N drops or delays that share of link sends (off)"),
    ("PP_STDIN_LIFELINE", "", "1: exit when stdin closes (set by ppsmoke --seed, so no node outlives it)"),
    ("PP_STANDBY", "--standby", "1: a warm spare (ppsmoke --seed --serve --standby K starts them): it loads every "
     "stage but the first and takes the one its runner names on stdin (`take <stage>`); needs PP_STDIN_LIFELINE=1"),
    ("PP_LOG_LEVEL", "--log-level", f"{', '.join(LOG_LEVELS)} ({DEFAULT_LOG_LEVEL})"),
    ("XDG_CACHE_HOME", "", "downloaded models go to $XDG_CACHE_HOME/pp (~/.cache/pp)"),
    ("OLLAMA_MODELS", "", "ollama's model store, used before downloading (~/.ollama/models)"),
)
_ENV_OF_FLAG = {flag: env for env, flag, _ in ENV_TABLE if flag}

DESCRIPTION = """\
Run one stage of a pipeline-parallel Llama. The model's blocks are split over NUM_STAGES nodes, one
process each, usually on different machines: stage 0 tokenizes the prompt and embeds it, every stage runs
its own range of blocks and passes the activations on, and the last stage samples the next token and
sends it back to stage 0. Nodes find each other through a seed node (SEED_ADDR) and keep track of each
other by gossip.

Every setting can be given as an environment variable (below); a flag wins over its variable. The cluster
token is read only from the environment, so that it never shows in the process list; it authenticates the
nodes to each other. Clients use a client API key: it opens the OpenAI API with /tokenize, /detokenize and
/tokenizer_info and the chat page's /v1/pipeline on stage 0, and /metrics on every node, nothing else; /health
and the chat page (/) need no key. A key is visible ASCII without spaces or commas, and differs from the
cluster token."""

EXAMPLE = """example, a two-stage pipeline on one machine (two shells):
  PP_CLUSTER_TOKEN=s3cret PP_API_KEY=client-key STAGE=0 NUM_STAGES=2 PP_PORT=8000 {prog}
  PP_CLUSTER_TOKEN=s3cret PP_API_KEY=client-key STAGE=1 NUM_STAGES=2 PP_PORT=8001 SEED_ADDR=127.0.0.1:8000 {prog}"""


def build_parser(prog: str = "python ppnode.py") -> argparse.ArgumentParser:
    epilog = "environment variables:\n" + "\n".join(
        f"  {env:<24} {flag:<18} {meaning}" for env, flag, meaning in ENV_TABLE) + "\n\n" + EXAMPLE.format(prog=prog)
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=epilog, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # Flags are read as strings, so that one set of checks and messages covers flags and variables alike.
    p.add_argument("--stage", metavar="I", help="this node's stage (STAGE)")
    p.add_argument("--standby", action="store_const", const="1",
                   help="a warm spare that takes the stage its runner names later (PP_STANDBY=1)")
    p.add_argument("--num-stages", metavar="N", help="number of stages (NUM_STAGES)")
    p.add_argument("--seed-addr", metavar="URL", help="node to join through (SEED_ADDR)")
    p.add_argument("--peer-direct", metavar="URL", action="append",
                   help="peer to dial directly; repeat for several (PEER_DIRECT)")
    p.add_argument("--model", help=f"model to serve (MODEL, default {DEFAULT_MODEL})")
    p.add_argument("--model-name", metavar="NAME", help="the model's name in the OpenAI API (PP_MODEL_NAME)")
    p.add_argument("--port", help=f"listen port, 0 = any (PP_PORT, default {DEFAULT_PORT})")
    p.add_argument("--bind", metavar="HOST", help=f"listen address (PP_BIND, default {DEFAULT_BIND})")
    p.add_argument("--advertise-addr", metavar="URL", help="address others reach us at (PP_ADVERTISE_ADDR)")
    p.add_argument("--node-id", metavar="ID", help="unique node name (PP_NODE_ID)")
    p.add_argument("--max-seqs", metavar="K", help=f"requests in flight at once (PP_MAX_SEQS, default {DEFAULT_MAX_SEQS})")
    p.add_argument("--ctx", "--max-model-len", dest="ctx", metavar="TOKENS",
                   help=f"context per request, prompt and answer (PP_CTX, default {DEFAULT_CONTEXT})")
    p.add_argument("--chunked-prefill-size", metavar="ROWS",
                   help=f"prompt rows per step at most (PP_CHUNKED_PREFILL_SIZE, default {DEFAULT_CHUNKED_PREFILL})")
    p.add_argument("--no-prefix-cache", action="store_const", const="1",
                   help="turn the prefix cache off: no request starts from another's KV (PP_NO_PREFIX_CACHE=1)")
    p.add_argument("--max-queue", metavar="Q", help=f"requests waiting at stage 0 (PP_MAX_QUEUE, default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--threads", "-t", metavar="T", help="cores a step computes on (PP_THREADS, default: every core "
                   "this process may use)")
    p.add_argument("--cpu-target", metavar="CPU", help="the CPU pp's kernels are built for: native or a clang CPU "
                   "name, e.g. x86-64-v2 (PP_CPU_TARGET, default native)")
    p.add_argument("--beam", metavar="W", help="kernel search width at boot, 0 = off (PP_BEAM, default 0)")
    p.add_argument("--layer-partition", metavar="SPLIT",
                   help="auto, equal, or each stage's block count, e.g. 8,8,14 (PP_LAYER_PARTITION, default auto: "
                        "planned from what each node measures)")
    p.add_argument("--machine-id", metavar="ID", help="which machine's cores this node computes on, for the "
                   "planner (PP_MACHINE_ID, default: this kernel's boot, CPU cgroup and affinity)")
    p.add_argument("--precision", metavar="P", help="auto, file or f32: which weights stay as the file holds them (PP_PRECISION, default auto)")
    p.add_argument("--kv-cache-dtype", metavar="DTYPE", help="auto, float16 or float32: what the KV caches hold "
                   "(PP_KV_CACHE_DTYPE, default auto = float16; float32 on an x86 CPU without F16C)")
    p.add_argument("--tool-call-parser", metavar="NAME", help="the format tool calls are read in: auto, hermes, "
                   "llama3_json, mistral or generic (PP_TOOL_CALL_PARSER, default auto: from the chat template)")
    p.add_argument("--kv-cache-memory", metavar="BYTES", help="the memory this stage's KV may fill, e.g. 2G or "
                   "512M (PP_KV_CACHE_MEMORY, default auto: half the memory free at boot, shared by this machine's stages)")
    p.add_argument("--links", metavar="KIND", help="stream or post: how messages go to the next stage (PP_LINKS)")
    p.add_argument("--log-level", metavar="LEVEL", help=f"{', '.join(LOG_LEVELS)} (PP_LOG_LEVEL)")
    p.add_argument("--api-key", metavar="KEY", action="append",
                   help="a client API key; repeat for several (PP_API_KEY; in argv every local user sees it: "
                        "prefer PP_API_KEY or --api-key-file)")
    p.add_argument("--api-key-file", metavar="PATH", help="file of client API keys, one a line (PP_API_KEY_FILE)")
    p.add_argument("--token-is-api-key", action="store_const", const="1",
                   help="let the cluster token open the client surface too (PP_TOKEN_IS_API_KEY=1)")
    p.add_argument("--tls-cert", metavar="PATH", help="stage 0: serve the API over TLS with this PEM certificate "
                   "(PP_TLS_CERT; between nodes it is always TLS)")
    p.add_argument("--tls-key", metavar="PATH", help="the key of --tls-cert (PP_TLS_KEY)")
    return p


def parse_config(environ: Mapping[str, str], argv: list[str], *, home: Path,
                 rng: random.Random | None = None) -> NodeConfig:
    """Build the config from `environ` and `argv` (without the program name); exits 2 with a message on
    any bad value. `rng` makes the default node id reproducible (tests); without it `secrets` is used."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _config_from(Sources(vars(args), environ, _ENV_OF_FLAG), home=home, rng=rng)
    except ConfigError as exc:
        parser.error(str(exc))


def _config_from(src: Sources, *, home: Path, rng: random.Random | None) -> NodeConfig:
    standby = switch(src, "--standby")
    stage = standby_stage(src) if standby else required_int(src, "--stage")
    num_stages = required_int(src, "--num-stages")
    try:
        check_stage(stage, num_stages)
    except ValueError as exc:  # its message already names STAGE / NUM_STAGES and the way out
        raise ConfigError(str(exc)) from None
    env, port, token = src.environ, listen_port(src), cluster_token(src.environ)
    if standby and not env_switch(env, "PP_STDIN_LIFELINE"):
        raise ConfigError("PP_STANDBY=1: a standby takes its stage from the runner that started it, on its stdin "
                          "(PP_STDIN_LIFELINE=1); start standbys with ppsmoke.py --seed --serve --standby K")
    token_is_api_key = switch(src, "--token-is-api-key")
    return NodeConfig(
        stage=stage, num_stages=num_stages, cluster_token=token,
        node_id=_node_id(src, "standby" if standby else f"stage{stage}", rng), standby=standby,
        api_keys=client_api_keys(src, token, token_is_api_key=token_is_api_key), token_is_api_key=token_is_api_key,
        api_tls=api_tls(src),
        cache_dir=default_cache_dir(home, env.get("XDG_CACHE_HOME")),
        ollama_models_dir=default_ollama_dir(home, env.get("OLLAMA_MODELS")),
        seed_addr=optional_url(*src.get("--seed-addr")), peer_direct=peer_urls(*src.get("--peer-direct")),
        model=model_spec(src),
        model_name=text(src, "--model-name") or text(src, "--model") or DEFAULT_MODEL,
        port=port, bind_host=text(src, "--bind") or DEFAULT_BIND,
        advertise_addr=optional_url(*src.get("--advertise-addr")),
        public_ip=(env.get("PUBLIC_IPADDR") or "").strip() or None, public_port=public_port(env, port),
        max_body_bytes=max_body(env), log_level=_log_level(*src.get("--log-level")),
        max_seqs=count(src, "--max-seqs", DEFAULT_MAX_SEQS, lowest=1),
        max_queue=count(src, "--max-queue", DEFAULT_MAX_QUEUE, lowest=0),
        chunked_prefill_size=count(src, "--chunked-prefill-size", DEFAULT_CHUNKED_PREFILL, lowest=1),
        prefix_cache=not switch(src, "--no-prefix-cache"),
        ctx=count(src, "--ctx", DEFAULT_CONTEXT, lowest=16),
        threads=threads(src), cpu_target=cpu_target(src),
        beam=count(src, "--beam", 0, lowest=0), precision=precision(src),
        kv_cache_dtype=kv_cache_dtype(src, converts_half=converts_half(host_arch(), host_cpu_flags())),
        kv_cache_memory=kv_cache_memory(src), tool_call_parser=tool_call_parser(src),
        link_streams=link_streams(src),
        layer_partition=layer_partition(src, num_stages), machine_id=_machine_id(src),
        exit_on_stdin_eof=env_switch(env, "PP_STDIN_LIFELINE"), faults=link_faults(env))


def threads(src: Sources) -> int:
    value = count(src, "--threads", available_cores(), lowest=1)
    if value > MAX_THREADS:
        raise ConfigError(f"{src.get('--threads')[1]}={value}: at most {MAX_THREADS} threads")
    return value


def cpu_target(src: Sources) -> str:
    raw, label = src.get("--cpu-target")
    try:
        return check_name((raw or "").strip() or NATIVE)
    except ValueError as exc:
        raise ConfigError(f"{label}={raw!r}: {exc}") from None


def standby_stage(src: Sources) -> int:
    """A standby's stage until it takes one: 1, the first it can take (node/standby.py); it is given none."""
    raw, label = src.get("--stage")
    if raw is not None and raw.strip():
        raise ConfigError(f"{label}={raw!r} with --standby (PP_STANDBY): a standby takes the stage its runner names "
                          f"later; give it no stage")
    return 1


def _node_id(src: Sources, prefix: str, rng: random.Random | None) -> str:
    raw, label = src.get("--node-id")
    node_id = (raw or "").strip()
    if not node_id:
        suffix = f"{rng.getrandbits(32):08x}" if rng is not None else secrets.token_hex(4)
        return f"{prefix}-{suffix}"
    if not node_id.isprintable() or " " in node_id:
        raise ConfigError(f"{label}={raw!r}: a node id must be printable and without spaces")
    return node_id


def _machine_id(src: Sources) -> str:
    raw, label = src.get("--machine-id")
    value = (raw or "").strip()
    if not value:
        return machine_id()
    if not MACHINE_ID.fullmatch(value):
        raise ConfigError(f"{label}={raw!r}: a machine id is 1-64 letters, digits, '.', '_' or '-'")
    return value


def _log_level(raw: str | None, label: str) -> str:
    level = (raw or DEFAULT_LOG_LEVEL).strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"{label}={raw!r} is not one of {', '.join(LOG_LEVELS)}")
    return level
