"""NodeConfig: everything one node needs to know about itself, frozen once parsed (parse.py), and the same
config as fields for a log line, without its secrets."""
from __future__ import annotations

from pathlib import Path

import attrs

from node.config.network import DEFAULT_BIND, DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT
from node.transport.faults import NONE as NO_FAULTS, Faults
from roles import DEFAULT_MAX_QUEUE
from worker.config import DEFAULT_CONTEXT
from worker.weights.fetch import DEFAULT_MODEL

DEFAULT_CHUNKED_PREFILL = 4  # bench.stall at N = 3 on SmolLM2: a stall 25x -> 9x for +35 % TTFT (docs/benchmarks.md, issue 25)
# A node's sequence slots: twice the library's (worker.batching), since a slot's KV takes memory only as it is
# written and --kv-cache-memory bounds what all of them hold: 15 questions after a shared prompt, sent at once,
# wait for slots 2.6-3.1x less than at 8 (docs/benchmarks.md, "The burst of 15 after a shared prompt")
DEFAULT_MAX_SEQS = 16
DEFAULT_LOG_LEVEL = "INFO"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


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
    threads: int = 1                    # PP_THREADS: cores a step computes on (parse: every core the process may use)
    cpu_target: str = "native"          # PP_CPU_TARGET: the CPU pp's kernels are built for (worker/compute/cpu_target.py)
    beam: int = 0                       # PP_BEAM: tinygrad's kernel search width at boot (0 = off); cached on disk
    layer_partition: tuple[int, ...] | str | None = "auto"  # PP_LAYER_PARTITION: "auto" (planned), None (even) or counts
    kv_cache_dtype: str = "float16"     # PP_KV_CACHE_DTYPE: what the KV caches hold (float16 or float32)
    kv_cache_memory: int | None = None  # PP_KV_CACHE_MEMORY: bytes this stage's KV may fill (None: auto)
    tool_call_parser: str | None = None  # PP_TOOL_CALL_PARSER: the family tool calls are read in (None: the template's)
    machine_id: str | None = None       # PP_MACHINE_ID: the cores this node shares with others (None: its own)
    precision: str = "auto"             # PP_PRECISION: which matrices keep the file's precision (worker.weights.contract.narrow_kinds)
    link_streams: bool = True           # PP_LINKS=stream: one long-lived HTTP/2 stream to the next stage; post: a POST each
    api_tls: tuple[str, str] | None = None  # PP_TLS_CERT, PP_TLS_KEY: stage 0's API over TLS with this certificate
    exit_on_stdin_eof: bool = False     # PP_STDIN_LIFELINE=1: a local runner holds our stdin; EOF = it is gone
    standby: bool = False               # PP_STANDBY=1: a warm spare; `stage` is set when it takes one (node/standby.py)
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
