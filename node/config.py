"""The node's configuration: read once from the environment and flags at the entrypoint, then passed down.

Nothing below the entrypoint reads the environment; it gets a NodeConfig. Every setting has an environment
variable (how orchestrators such as vast.ai pass settings) and most have a flag; a flag wins over its variable.
"""
from __future__ import annotations

import argparse
import random
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from roles import DEFAULT_MAX_QUEUE
from worker.batching import DEFAULT_MAX_SEQS
from worker.config import DEFAULT_CONTEXT
from roles.messages import is_http_url
from worker.weights.fetch import DEFAULT_MODEL, REGISTRY, default_cache_dir, default_ollama_dir
from worker.partition import check_stage
from worker.weights.tiny import BUILT_IN
from worker.weights.contract import PRECISIONS

from node.transport.faults import NONE as NO_FAULTS, Faults, FaultSpecError, parse_faults

DEFAULT_PORT = 8000
DEFAULT_BIND = "0.0.0.0"
DEFAULT_CHUNKED_PREFILL = 4  # bench.stall at N = 3 on SmolLM2: a stall 25x -> 9x for +35 % TTFT (docs/benchmarks.md, issue 25)
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # a few prefill activations of an 8B model, with room to spare
DEFAULT_LOG_LEVEL = "INFO"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
LOOPBACK = "127.0.0.1"
TOKEN_ENV = "PP_CLUSTER_TOKEN"
API_KEY_ENV, API_KEY_FILE_ENV, TOKEN_IS_API_KEY_ENV = "PP_API_KEY", "PP_API_KEY_FILE", "PP_TOKEN_IS_API_KEY"


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable or flag it came from."""


@attrs.frozen(kw_only=True)
class NodeConfig:
    """Everything one node needs to know about itself. Its repr (and str) never shows the cluster token or a
    client API key."""

    stage: int
    num_stages: int
    cluster_token: str = attrs.field(repr=False)  # opens the cluster's own endpoints (node/transport/auth.py)
    node_id: str
    cache_dir: Path
    ollama_models_dir: Path
    seed_addr: str | None = None        # base URL, e.g. http://10.0.0.5:8000
    peer_direct: tuple[str, ...] = ()   # base URLs dialled directly
    model: str = DEFAULT_MODEL
    # what the OpenAI API calls the model (default: `model` as given)
    model_name: str = attrs.field(default=attrs.Factory(lambda self: self.model, takes_self=True))
    port: int = DEFAULT_PORT            # 0 = any free port (tests)
    bind_host: str = DEFAULT_BIND
    advertise_addr: str | None = None   # base URL that overrides every other guess
    public_ip: str | None = None        # vast.ai's PUBLIC_IPADDR
    public_port: int | None = None      # vast.ai's VAST_TCP_PORT_<port>: the public port mapped to `port`
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_seqs: int = DEFAULT_MAX_SEQS    # requests whose KV caches a stage holds at once (its sequence slots)
    max_queue: int = DEFAULT_MAX_QUEUE  # stage 0: requests waiting for a slot before the entry answers 429
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL  # prompt rows a step takes at most (roles/schedule.py)
    prefix_cache: bool = True           # stage 0 keeps finished requests' KV for later ones (roles/prefix.py)
    ctx: int = DEFAULT_CONTEXT          # PP_CTX: positions a slot's KV holds (prompt + answer), at most the model's
    beam: int = 0                       # PP_BEAM: tinygrad's kernel search width at boot (0 = off); cached on disk
    precision: str = "auto"             # PP_PRECISION: which matrices keep the file's precision (worker.weights.contract.narrow_kinds)
    link_streams: bool = True           # PP_LINKS=stream: one long-lived HTTP/2 stream to the next stage; post: a POST each
    exit_on_stdin_eof: bool = False     # PP_STDIN_LIFELINE=1: a local runner holds our stdin; EOF = it is gone
    faults: Faults = NO_FAULTS          # PP_FAULTS: drop or delay link sends (chaos tests; node/transport/faults.py)
    log_level: str = DEFAULT_LOG_LEVEL
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)  # PP_API_KEY(_FILE): open the client surface
    token_is_api_key: bool = False      # PP_TOKEN_IS_API_KEY=1: the cluster token opens the client surface too


def loggable(config: NodeConfig) -> dict[str, object]:
    """The config as JSON-friendly fields for a log line, without the fields hidden from repr (the secrets)."""
    return {f.name: _plain(getattr(config, f.name)) for f in attrs.fields(NodeConfig) if f.repr}


def _plain(value: object) -> object:
    if isinstance(value, Faults):
        return attrs.asdict(value, filter=lambda a, _: a.init)
    return str(value) if isinstance(value, Path) else value


def advertised_url(config: NodeConfig, bound_port: int) -> str:
    """The base URL other nodes should use to reach this one, once the listener is bound to `bound_port`."""
    if config.advertise_addr:
        return config.advertise_addr
    if config.public_ip and config.public_port:
        return f"http://{_url_host(config.public_ip)}:{config.public_port}"
    # A wildcard bind is reachable on loopback; without better information that is the only safe guess.
    host = LOOPBACK if config.bind_host in WILDCARD_HOSTS else config.bind_host
    return f"http://{_url_host(host)}:{bound_port}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def normalise_url(raw: str, label: str) -> str:
    """`host:port` -> `http://host:port`, no trailing slash; refuses anything but a plain http(s) base URL."""
    text = raw.strip()
    if "://" not in text:
        text = "http://" + text
    text = text.rstrip("/")
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 -- urlsplit checks the port only when asked
    except ValueError:
        raise ConfigError(f"{label}={raw!r}: the port is not a number in 0..65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{label}={raw!r} is not an http(s) address such as http://10.0.0.5:8000")
    if parts.path or parts.query or parts.fragment:
        raise ConfigError(f"{label}={raw!r}: give a base address without a path, e.g. http://10.0.0.5:8000")
    return text


# (variable, flag, meaning): the --help epilog, and the variable each flag stands for.
ENV_TABLE = (
    ("STAGE", "--stage", "this node's stage, 0 .. NUM_STAGES-1 (required)"),
    ("NUM_STAGES", "--num-stages", "how many stages the pipeline has, at least 2 (required)"),
    (TOKEN_ENV, "", "secret shared by the cluster's nodes, for them only (required; no flag: it would show in ps)"),
    (API_KEY_ENV, "--api-key", "the clients' API key; several comma-separated, or the flag repeated: opens the "
                               "OpenAI API, /v1/pipeline and /metrics, nothing else (none: those answer 401)"),
    (API_KEY_FILE_ENV, "--api-key-file", "a file of client API keys, one a line (taken with PP_API_KEY's)"),
    (TOKEN_IS_API_KEY_ENV, "--token-is-api-key", "1: the cluster token opens the client surface too (0)"),
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
    ("PP_CTX", "--ctx", f"context of each request, prompt and answer, in tokens; KV for it is allocated per slot "
                        f"at boot, so it sets the node's memory; at most the model's own ({DEFAULT_CONTEXT})"),
    ("PP_CHUNKED_PREFILL_SIZE", "--chunked-prefill-size", "prompt rows one step takes at most, beside the decode "
     f"rows: smaller keeps streams decoding while a long prompt is read, larger reads it sooner ({DEFAULT_CHUNKED_PREFILL})"),
    ("PP_NO_PREFIX_CACHE", "--no-prefix-cache", "1: stage 0 keeps no finished request's KV, so every request computes "
     "its whole prompt (the prefix cache is on by default)"),
    ("PP_MAX_QUEUE", "--max-queue", f"stage 0: requests waiting for a free slot; past it, 429 ({DEFAULT_MAX_QUEUE})"),
    ("PP_BEAM", "--beam", "kernel search at boot: tinygrad's BEAM width, e.g. 2; minutes once, cached on disk for the next boot (0 = off)"),
    ("PP_PRECISION", "--precision", "auto: Q8_0 weights stay as the file holds them, F16/BF16 too with --beam; file: all of them always; f32: every weight widened at load (auto)"),
    ("PP_LINKS", "--links", "stream: messages to the next stage as frames of one long-lived HTTP/2 stream; post: a POST each (stream)"),
    ("PP_FAULTS", "", "chaos testing: drop=P,delay=P,delay_ms=MS,seed=N drops or delays that share of link sends (off)"),
    ("PP_STDIN_LIFELINE", "", "1: exit when stdin closes (set by ppsmoke --seed, so no node outlives it)"),
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
nodes to each other. Clients (the OpenAI API on stage 0, /metrics on every node) use a client API key: a
key is visible ASCII without spaces or commas, and differs from the cluster token."""

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
    p.add_argument("--beam", metavar="W", help="kernel search width at boot, 0 = off (PP_BEAM, default 0)")
    p.add_argument("--precision", metavar="P", help="auto, file or f32: which weights stay as the file holds them (PP_PRECISION, default auto)")
    p.add_argument("--links", metavar="KIND", help="stream or post: how messages go to the next stage (PP_LINKS)")
    p.add_argument("--log-level", metavar="LEVEL", help=f"{', '.join(LOG_LEVELS)} (PP_LOG_LEVEL)")
    p.add_argument("--api-key", metavar="KEY", action="append",
                   help="a client API key; repeat for several (PP_API_KEY; in argv every local user sees it: "
                        "prefer PP_API_KEY or --api-key-file)")
    p.add_argument("--api-key-file", metavar="PATH", help="file of client API keys, one a line (PP_API_KEY_FILE)")
    p.add_argument("--token-is-api-key", action="store_const", const="1",
                   help="let the cluster token open the client surface too (PP_TOKEN_IS_API_KEY=1)")
    return p


def parse_config(environ: Mapping[str, str], argv: list[str], *, home: Path,
                 rng: random.Random | None = None) -> NodeConfig:
    """Build the config from `environ` and `argv` (without the program name); exits 2 with a message on
    any bad value. `rng` makes the default node id reproducible (tests); without it `secrets` is used."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _config_from(_Sources(vars(args), environ), home=home, rng=rng)
    except ConfigError as exc:
        parser.error(str(exc))


@attrs.frozen
class _Sources:
    flags: Mapping[str, object] = attrs.field(repr=False)  # they may hold client API keys
    environ: Mapping[str, str] = attrs.field(repr=False)  # it holds the cluster token

    def get(self, flag: str) -> tuple[object | None, str]:
        """The raw value for `flag` (flag first, then its variable) and the name to blame in errors."""
        value = self.flags[flag.removeprefix("--").replace("-", "_")]
        if value is not None:
            return value, flag
        env = _ENV_OF_FLAG[flag]
        return self.environ.get(env), env


def _config_from(src: _Sources, *, home: Path, rng: random.Random | None) -> NodeConfig:
    stage, num_stages = _required_int(src, "--stage"), _required_int(src, "--num-stages")
    try:
        check_stage(stage, num_stages)
    except ValueError as exc:  # its message already names STAGE / NUM_STAGES and the way out
        raise ConfigError(str(exc)) from None
    env, port, token = src.environ, _port(src), _token(src.environ)
    token_is_api_key = _flag_of(src, "--token-is-api-key")
    return NodeConfig(
        stage=stage, num_stages=num_stages, cluster_token=token, node_id=_node_id(src, stage, rng),
        api_keys=_api_keys(src, token, token_is_api_key=token_is_api_key), token_is_api_key=token_is_api_key,
        cache_dir=default_cache_dir(home, env.get("XDG_CACHE_HOME")),
        ollama_models_dir=default_ollama_dir(home, env.get("OLLAMA_MODELS")),
        seed_addr=_optional_url(*src.get("--seed-addr")), peer_direct=_peer_direct(*src.get("--peer-direct")),
        model=_model(src),
        model_name=_text(src, "--model-name") or _text(src, "--model") or DEFAULT_MODEL, port=port, bind_host=_text(src, "--bind") or DEFAULT_BIND,
        advertise_addr=_optional_url(*src.get("--advertise-addr")),
        public_ip=(env.get("PUBLIC_IPADDR") or "").strip() or None, public_port=_public_port(env, port),
        max_body_bytes=_max_body(env), log_level=_log_level(*src.get("--log-level")),
        max_seqs=_count(src, "--max-seqs", DEFAULT_MAX_SEQS, lowest=1),
        max_queue=_count(src, "--max-queue", DEFAULT_MAX_QUEUE, lowest=0),
        chunked_prefill_size=_count(src, "--chunked-prefill-size", DEFAULT_CHUNKED_PREFILL, lowest=1),
        prefix_cache=not _flag_of(src, "--no-prefix-cache"),
        ctx=_count(src, "--ctx", DEFAULT_CONTEXT, lowest=16),
        beam=_count(src, "--beam", 0, lowest=0), precision=_precision(src), link_streams=_links(src), exit_on_stdin_eof=_flag(env, "PP_STDIN_LIFELINE"),
        faults=_faults(env))


def _model(src: _Sources) -> str:
    """A model the node can load or fetch: built-in, a known name, an http(s) URL, or an existing path
    (whether the file is a usable model is found when it is opened). An empty variable means the default."""
    raw, label = src.get("--model")
    if raw is not None and not raw.strip() and label == "--model":
        raise ConfigError("--model is empty: name a model (tiny, llama3.2:1b, ...), a URL or a path")
    model = (raw or "").strip() or DEFAULT_MODEL
    name = model.lower()
    if name in ("stub", *BUILT_IN, *(k.lower() for k in REGISTRY)) or is_http_url(model) or Path(model).exists():
        return model
    raise ConfigError(f"{label}={raw!r} is neither a built-in model ({', '.join(['stub', *BUILT_IN])}), a known "
                      f"name ({', '.join(sorted(REGISTRY))}), an http(s) URL nor an existing path")


def _precision(src: _Sources) -> str:
    raw, label = src.get("--precision")
    value = (raw or "auto").strip().lower()
    if value not in PRECISIONS:
        raise ConfigError(f"{label}={raw!r}: expected {', '.join(PRECISIONS)}")
    return value


def _links(src: _Sources) -> bool:
    raw, label = src.get("--links")
    kind = (raw or "stream").strip().lower()
    if kind not in ("stream", "post"):
        raise ConfigError(f"{label}={raw!r}: expected stream or post")
    return kind == "stream"


def _int(raw: str, label: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"{label}={raw!r} is not a whole number") from None


def _required_int(src: _Sources, flag: str) -> int:
    raw, label = src.get(flag)
    if raw is None or not raw.strip():
        raise ConfigError(f"{_ENV_OF_FLAG[flag]} is not set (or pass {flag})")
    return _int(raw, label)


def _text(src: _Sources, flag: str) -> str:
    raw, _ = src.get(flag)
    return (raw or "").strip()


def _port(src: _Sources) -> int:
    raw, label = src.get("--port")
    if raw is None or not raw.strip():
        return DEFAULT_PORT
    return _port_number(raw, label, lowest=0, note=" (0 = any free port)")


def _public_port(environ: Mapping[str, str], port: int) -> int | None:
    name = f"VAST_TCP_PORT_{port}"
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    return _port_number(raw, name, lowest=1)


def _port_number(raw: str, label: str, *, lowest: int, note: str = "") -> int:
    port = _int(raw, label)
    if not lowest <= port <= 65535:
        raise ConfigError(f"{label}={port} is outside {lowest}..65535{note}")
    return port


def _optional_url(raw: str | None, label: str) -> str | None:
    return normalise_url(raw, label) if raw and raw.strip() else None


def _peer_direct(raw: str | list[str] | None, label: str) -> tuple[str, ...]:
    texts = raw if isinstance(raw, list) else [raw or ""]  # a list when given as repeated flags
    entries = [part for text in texts for part in text.split(",") if part.strip()]
    return tuple(normalise_url(entry, label) for entry in entries)


def _token(environ: Mapping[str, str]) -> str:
    # Surrounding whitespace is stripped: `$(cat token-file)` and friends often leave a newline.
    token = (environ.get(TOKEN_ENV) or "").strip()
    if not token:
        raise ConfigError(f"{TOKEN_ENV} is not set: every node of a cluster needs the same secret token, "
                          "given in the environment only")
    return token


def _api_keys(src: _Sources, token: str, *, token_is_api_key: bool) -> tuple[str, ...]:
    """The client API keys: those of --api-key (or PP_API_KEY) and of --api-key-file (or PP_API_KEY_FILE)."""
    raw, label = src.get("--api-key")
    texts = raw if isinstance(raw, list) else [raw or ""]  # a list when given as repeated flags
    keys = [key for text in texts for key in split_keys(text, label)]
    path, path_label = src.get("--api-key-file")
    if path is not None and path.strip():
        keys += read_key_file(path.strip(), path_label)
    return check_keys(keys, token, label="client API keys", token_is_api_key=token_is_api_key)


# A key travels in an Authorization header and, from the runner to its nodes, in PP_API_KEY (comma-separated):
# visible ASCII, no spaces, no commas.
KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {","}


def split_keys(text: str, label: str) -> list[str]:
    """Comma-separated keys; blanks around them are dropped. A message names the key by position, never by value."""
    keys = [part.strip() for part in text.split(",") if part.strip()]
    for n, key in enumerate(keys, 1):
        if not set(key) <= KEY_CHARS:
            raise ConfigError(f"{label}: key {n} holds a space or a character outside visible ASCII")
    return keys


def read_key_file(path: str, label: str) -> list[str]:
    """One key a line; blank lines are skipped, blanks around a key dropped."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{label}={path!r}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if key and not set(key) <= KEY_CHARS:
            raise ConfigError(f"{label}={path!r}: line {n} holds a space, a comma or a character outside "
                              "visible ASCII")
        keys += [key] if key else []
    if not keys:
        raise ConfigError(f"{label}={path!r} holds no key")
    return keys


def check_keys(keys: list[str], token: str | None, *, label: str, token_is_api_key: bool = False) -> tuple[str, ...]:
    """The keys without repeats, refused if one is the cluster token: it would open the cluster to clients."""
    if token is not None and token in keys and not token_is_api_key:
        raise ConfigError(f"{label}: one of them is the cluster token ({TOKEN_ENV}); a client holding it could "
                          f"steer the cluster: give the clients a key of their own (or set "
                          f"{TOKEN_IS_API_KEY_ENV}=1 to let the token open the client surface too)")
    return tuple(dict.fromkeys(keys))


def _node_id(src: _Sources, stage: int, rng: random.Random | None) -> str:
    raw, label = src.get("--node-id")
    node_id = (raw or "").strip()
    if not node_id:
        suffix = f"{rng.getrandbits(32):08x}" if rng is not None else secrets.token_hex(4)
        return f"stage{stage}-{suffix}"
    if not node_id.isprintable() or " " in node_id:
        raise ConfigError(f"{label}={raw!r}: a node id must be printable and without spaces")
    return node_id


def _faults(environ: Mapping[str, str]) -> Faults:
    try:
        return parse_faults(environ.get("PP_FAULTS"))
    except FaultSpecError as exc:
        raise ConfigError(f"PP_FAULTS: {exc}") from None


def _flag_of(src: _Sources, flag: str) -> bool:
    raw, label = src.get(flag)
    raw = (raw or "0").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"{label}={raw!r}: use 1 or 0")
    return raw == "1"


def _flag(environ: Mapping[str, str], name: str) -> bool:
    raw = (environ.get(name) or "0").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"{name}={raw!r}: use 1 or 0")
    return raw == "1"


def _max_body(environ: Mapping[str, str]) -> int:
    raw = environ.get("PP_MAX_BODY")
    if raw is None or not raw.strip():
        return DEFAULT_MAX_BODY_BYTES
    size = _int(raw, "PP_MAX_BODY")
    if size < 1:
        raise ConfigError(f"PP_MAX_BODY={size} must be a positive number of bytes")
    return size


def _count(src: _Sources, flag: str, default: int, *, lowest: int) -> int:
    raw, label = src.get(flag)
    if raw is None or not raw.strip():
        return default
    value = _int(raw, label)
    if value < lowest:
        raise ConfigError(f"{label}={value} must be at least {lowest}")
    return value


def _log_level(raw: str | None, label: str) -> str:
    level = (raw or DEFAULT_LOG_LEVEL).strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"{label}={raw!r} is not one of {', '.join(LOG_LEVELS)}")
    return level
