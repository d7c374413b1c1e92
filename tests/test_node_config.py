"""The node's configuration (environment, flags, errors, addresses) and its JSON log lines."""
import datetime
import io
import json
import logging
import random
import re
from pathlib import Path

import pytest
import trio

from node.config import cores
from node.config.cores import available_cores, fair_share, machine_id
from node.config.network import advertised_url, normalise_url
from node.config.parse import parse_config
from node.config.settings import NodeConfig, loggable
from node.transport.faults import Faults
from node.observe.log import as_extra, error_event, event, setup_logging, warn_event

HOME = Path("/home/alice")
TOKEN = "tok-3f9a1c77e2"
BASE_ENV = {"STAGE": "1", "NUM_STAGES": "3", "PP_CLUSTER_TOKEN": TOKEN}


def parse(env_overrides=None, argv=(), *, drop=(), rng=None) -> NodeConfig:
    env = {k: v for k, v in {**BASE_ENV, **(env_overrides or {})}.items() if k not in drop}
    return parse_config(env, list(argv), home=HOME, rng=rng)


def config(**overrides) -> NodeConfig:
    fields = dict(stage=0, num_stages=2, cluster_token=TOKEN, node_id="n0", cache_dir=HOME / ".cache" / "pp",
                  ollama_models_dir=HOME / ".ollama" / "models")
    return NodeConfig(**{**fields, **overrides})


# --- parse_config: environment only -------------------------------------------------------------------------

@pytest.mark.parametrize("cores, nodes, want", [(2, 5, 1), (2, 2, 1), (16, 5, 3), (16, 4, 4), (1, 1, 1), (8, 0, 8)])
def test_nodes_on_one_machine_share_its_cores_at_least_one_each(cores, nodes, want):
    assert fair_share(cores, nodes) == want


def test_processes_of_one_machine_share_an_id_unless_their_cpu_cgroup_or_affinity_differs(monkeypatch):
    files = {"/proc/sys/kernel/random/boot_id": "b2d1e823", "/proc/self/cgroup": "4:memory:/job1\n1:cpu:/\n0::/"}
    monkeypatch.setattr(cores, "_read", lambda path: files.get(path, ""))
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1})
    base = machine_id()
    assert re.fullmatch(r"[0-9a-f]{16}", base) and machine_id() == base
    files["/proc/self/cgroup"] = "4:memory:/job2\n1:cpu:/\n0::/"  # another memory cgroup: the same cores
    assert machine_id() == base
    files["/proc/self/cgroup"] = "4:memory:/job2\n1:cpu:/pp-bench-slow\n0::/"  # a CPU quota of its own
    assert machine_id() != base
    files["/proc/self/cgroup"] = "4:memory:/job1\n1:cpu:/\n0::/"
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {1})  # pinned to one core
    assert machine_id() != base
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1})
    files["/proc/sys/kernel/random/boot_id"] = "0f00"  # another machine, or another boot
    assert machine_id() != base


def test_a_minimal_environment_gives_the_documented_defaults():
    cfg = parse({"PP_NODE_ID": "n1"})
    assert cfg == NodeConfig(
        stage=1, num_stages=3, cluster_token=TOKEN, node_id="n1", cache_dir=Path("/home/alice/.cache/pp"),
        ollama_models_dir=Path("/home/alice/.ollama/models"), seed_addr=None, peer_direct=(), model="smollm2:135m",
        port=8000, bind_host="0.0.0.0", advertise_addr=None, public_ip=None, public_port=None,
        max_body_bytes=67108864, log_level="INFO", threads=available_cores(), machine_id=machine_id())


def test_every_variable_is_read_from_the_environment():
    cfg = parse({
        "SEED_ADDR": "10.0.0.5:7000", "PEER_DIRECT": "10.0.0.6:8000, http://10.0.0.7:8001/",
        "MODEL": "llama3.2:1b", "PP_PORT": "9000", "PP_BIND": "10.0.0.9", "PP_ADVERTISE_ADDR": "node.example:80",
        "PUBLIC_IPADDR": " 203.0.113.4\n", "VAST_TCP_PORT_9000": "41234", "VAST_TCP_PORT_8000": "1",
        "PP_NODE_ID": "alpha", "PP_MAX_BODY": "1048576", "PP_LOG_LEVEL": "debug",
        "XDG_CACHE_HOME": "/xdg", "OLLAMA_MODELS": "/models"})
    assert cfg.seed_addr == "https://10.0.0.5:7000"
    assert cfg.peer_direct == ("https://10.0.0.6:8000", "https://10.0.0.7:8001")
    assert (cfg.model, cfg.port, cfg.bind_host, cfg.advertise_addr) == ("llama3.2:1b", 9000, "10.0.0.9",
                                                                        "https://node.example:80")
    assert (cfg.public_ip, cfg.public_port) == ("203.0.113.4", 41234)  # the mapping of PP_PORT, not of 8000
    assert (cfg.node_id, cfg.max_body_bytes, cfg.log_level) == ("alpha", 1048576, "DEBUG")
    assert (cfg.cache_dir, cfg.ollama_models_dir) == (Path("/xdg/pp"), Path("/models"))


def test_empty_optional_variables_count_as_unset():
    cfg = parse({"SEED_ADDR": "", "PEER_DIRECT": " , ", "PP_PORT": "", "PUBLIC_IPADDR": "  ", "MODEL": " "})
    assert (cfg.seed_addr, cfg.peer_direct, cfg.port, cfg.public_ip, cfg.model) == (None, (), 8000, None, "smollm2:135m")


def test_the_cluster_token_loses_surrounding_whitespace():
    assert parse({"PP_CLUSTER_TOKEN": f"  {TOKEN}\n"}).cluster_token == TOKEN


# --- parse_config: flags override the environment -------------------------------------------------------------

@pytest.mark.parametrize("argv, field, expected", [
    (["--stage", "2"], "stage", 2),
    (["--num-stages", "5"], "num_stages", 5),
    (["--seed-addr", "10.1.1.1:9"], "seed_addr", "https://10.1.1.1:9"),
    (["--peer-direct", "a:1", "--peer-direct", "b:2,c:3"], "peer_direct", ("https://a:1", "https://b:2", "https://c:3")),
    (["--model", "small"], "model", "small"),
    (["--port", "0"], "port", 0),
    (["--bind", "127.0.0.2"], "bind_host", "127.0.0.2"),
    (["--advertise-addr", "https://me.example:8443/"], "advertise_addr", "https://me.example:8443"),
    (["--node-id", "beta"], "node_id", "beta"),
    (["--log-level", "warning"], "log_level", "WARNING"),
    (["--precision", "F32"], "precision", "f32"),
    (["--ctx", "4096"], "ctx", 4096),
    (["--max-model-len", "512"], "ctx", 512),  # vLLM's name for it
    (["--chunked-prefill-size", "4"], "chunked_prefill_size", 4),  # SGLang's name
    (["--no-prefix-cache"], "prefix_cache", False),
    (["--threads", "3"], "threads", 3),
    (["-t", "1"], "threads", 1),  # llama.cpp's short name
    (["--machine-id", "rack2.box-7"], "machine_id", "rack2.box-7"),
    (["--kv-cache-dtype", "FLOAT32"], "kv_cache_dtype", "float32"),
    (["--kv-cache-dtype", "auto"], "kv_cache_dtype", "float16"),  # auto: float16, half float32's bytes
    (["--kv-cache-memory", "1.5G"], "kv_cache_memory", 3 << 29),  # powers of 1024, as free -h
    (["--kv-cache-memory", "512MiB"], "kv_cache_memory", 512 << 20),
    (["--kv-cache-memory", "4096"], "kv_cache_memory", 4096),
    (["--kv-cache-memory", "AUTO"], "kv_cache_memory", None),  # a share of the free memory (node/kv_memory.py)
])
def test_a_flag_wins_over_its_variable(argv, field, expected):
    env = {"NUM_STAGES": "6", "SEED_ADDR": "s:1", "PEER_DIRECT": "p:1", "MODEL": "tiny", "PP_PORT": "8100",
           "PP_BIND": "10.0.0.1", "PP_ADVERTISE_ADDR": "x:1", "PP_NODE_ID": "alpha", "PP_LOG_LEVEL": "ERROR",
           "PP_PRECISION": "file", "PP_CTX": "1024", "PP_CHUNKED_PREFILL_SIZE": "12", "PP_NO_PREFIX_CACHE": "0",
           "PP_THREADS": "7", "PP_MACHINE_ID": "other",
           "PP_KV_CACHE_DTYPE": "float16", "PP_KV_CACHE_MEMORY": "2G"}
    assert getattr(parse(env, argv), field) == expected


def test_the_port_flag_also_selects_the_vast_port_mapping():
    cfg = parse({"PP_PORT": "8000", "VAST_TCP_PORT_8000": "1111", "VAST_TCP_PORT_9100": "2222",
                 "PUBLIC_IPADDR": "203.0.113.4"}, ["--port", "9100"])
    assert (cfg.port, cfg.public_port) == (9100, 2222)


# --- parse_config: bad values -----------------------------------------------------------------------------------

@pytest.mark.parametrize("env, argv, drop, message", [
    ({"STAGE": "abc"}, [], (), "STAGE='abc' is not a whole number"),
    ({}, ["--stage", "x"], (), "--stage='x' is not a whole number"),
    ({}, [], ("STAGE",), "STAGE is not set"),
    ({}, [], ("NUM_STAGES",), "NUM_STAGES is not set"),
    ({"STAGE": "0", "NUM_STAGES": "1"}, [], (), "python -m worker"),
    ({"STAGE": "3", "NUM_STAGES": "3"}, [], (), "STAGE=3 is outside 0..2"),
    ({"STAGE": "-1"}, [], (), "STAGE=-1 is outside 0..2"),
    ({}, [], ("PP_CLUSTER_TOKEN",), "PP_CLUSTER_TOKEN is not set"),
    ({"PP_CLUSTER_TOKEN": " \n"}, [], (), "PP_CLUSTER_TOKEN is not set"),
    ({"PP_PORT": "70000"}, [], (), "PP_PORT=70000 is outside 0..65535"),
    ({"PP_PORT": "-1"}, [], (), "PP_PORT=-1 is outside 0..65535"),
    ({}, ["--port", "65536"], (), "--port=65536 is outside 0..65535"),
    ({"PP_PORT": "http"}, [], (), "PP_PORT='http' is not a whole number"),
    ({"VAST_TCP_PORT_8000": "none"}, [], (), "VAST_TCP_PORT_8000='none' is not a whole number"),
    ({"VAST_TCP_PORT_8000": "0"}, [], (), "VAST_TCP_PORT_8000=0 is outside 1..65535"),
    ({"SEED_ADDR": "ftp://10.0.0.5:21"}, [], (), "SEED_ADDR='ftp://10.0.0.5:21' is not an http(s) address"),
    ({"SEED_ADDR": "10.0.0.5:http"}, [], (), "SEED_ADDR='10.0.0.5:http': the port is not a number"),
    ({"PEER_DIRECT": "a:1,b:2/ping"}, [], (), "PEER_DIRECT='b:2/ping': give a base address without a path"),
    ({"PP_ADVERTISE_ADDR": "http://"}, [], (), "PP_ADVERTISE_ADDR='http://' is not an http(s) address"),
    ({"PP_MAX_BODY": "0"}, [], (), "PP_MAX_BODY=0 must be a positive number of bytes"),
    ({"PP_CTX": "8"}, [], (), "PP_CTX=8 must be at least 16"),
    ({"PP_CTX": "lots"}, [], (), "PP_CTX='lots' is not a whole number"),
    ({"PP_CHUNKED_PREFILL_SIZE": "0"}, [], (), "PP_CHUNKED_PREFILL_SIZE=0 must be at least 1"),
    ({"PP_LOG_LEVEL": "LOUD"}, [], (), "PP_LOG_LEVEL='LOUD' is not one of DEBUG, INFO"),
    ({"PP_PRECISION": "q4"}, [], (), "PP_PRECISION='q4': expected auto, file, f32"),
    ({"PP_NODE_ID": "my node"}, [], (), "PP_NODE_ID='my node': a node id must be printable and without spaces"),
    ({}, ["--model", ""], (), "--model is empty"),
    ({}, ["--model", "no-such-model"], (), "--model='no-such-model' is neither a built-in model"),
    ({"MODEL": "/no/such/file.gguf"}, [], (), "MODEL='/no/such/file.gguf' is neither"),
    ({"PP_FAULTS": "loss=0.1"}, [], (), "PP_FAULTS: 'loss=0.1': expected drop=P, delay=P"),
    ({"PP_FAULTS": "drop=1.5"}, [], (), "'drop=1.5': a probability is 0..1"),
    ({"PP_FAULTS": "delay=x"}, [], (), "'delay=x': 'x' is not a number"),
    ({"PP_FAULTS": "delay_ms=-1"}, [], (), "0..60000 ms"),
    ({"PP_LAYER_PARTITION": "10,20"}, [], (), "PP_LAYER_PARTITION='10,20': the layer partition 10,20 names 2 stages"),
    ({}, ["--layer-partition", "a,b,c"], (), "--layer-partition='a,b,c': give auto, equal, or each stage's block count"),
    ({"PP_THREADS": "0"}, [], (), "PP_THREADS=0 must be at least 1"),
    ({"PP_KV_CACHE_MEMORY": "lots"}, [], (), "PP_KV_CACHE_MEMORY='lots': expected auto or a size in bytes"),
    ({}, ["--kv-cache-memory", "0G"], (), "--kv-cache-memory='0G': the KV memory must be more than 0 bytes"),
    ({}, ["--kv-cache-memory", "-1"], (), "--kv-cache-memory='-1': expected auto or a size in bytes"),
    ({}, ["--threads", "257"], (), "--threads=257: at most 256 threads"),
    ({"PP_THREADS": "all"}, [], (), "PP_THREADS='all' is not a whole number"),
    ({"PP_KV_CACHE_DTYPE": "fp8"}, [], (), "PP_KV_CACHE_DTYPE='fp8': expected auto, float16, float32"),
    ({"PP_MACHINE_ID": "my box"}, [], (), "PP_MACHINE_ID='my box': a machine id is 1-64 letters, digits"),
    ({}, ["--machine-id", "x" * 65], (), "a machine id is 1-64 letters"),
])
def test_a_bad_value_exits_with_a_message_naming_its_source(capsys, env, argv, drop, message):
    with pytest.raises(SystemExit) as exc_info:
        parse(env, argv, drop=drop)
    err = capsys.readouterr().err
    assert exc_info.value.code == 2
    assert message in err
    assert TOKEN not in err


def test_there_is_no_token_flag_and_help_says_why(capsys):
    with pytest.raises(SystemExit) as exc_info:
        parse(argv=["--cluster-token", "x"])
    assert exc_info.value.code == 2
    with pytest.raises(SystemExit) as exc_info:
        parse(argv=["--help"])
    out = capsys.readouterr().out
    assert exc_info.value.code == 0
    assert "PP_CLUSTER_TOKEN" in out and "ps" in out
    assert all(name in out for name in ("STAGE", "NUM_STAGES", "SEED_ADDR", "PEER_DIRECT", "PUBLIC_IPADDR"))


# --- node id ----------------------------------------------------------------------------------------------------

def test_the_default_node_id_is_the_stage_and_8_hex_digits():
    assert re.fullmatch(r"stage1-[0-9a-f]{8}", parse().node_id)


def test_the_default_node_id_is_reproducible_with_an_injected_rng_and_differs_across_seeds():
    ids = [parse(rng=random.Random(seed)).node_id for seed in (7, 7, 8)]
    assert ids[0] == ids[1] != ids[2]
    assert f"stage1-{random.Random(7).getrandbits(32):08x}" == ids[0]


# --- addresses --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    ("10.0.0.5:7000", "https://10.0.0.5:7000"),
    ("http://10.0.0.5:7000/", "https://10.0.0.5:7000"),
    (" https://node.example:8443// ", "https://node.example:8443"),
    ("node.example", "https://node.example"),
    ("[::1]:7000", "https://[::1]:7000"),
])
def test_addresses_are_normalised_to_base_urls(raw, expected):
    assert normalise_url(raw, "SEED_ADDR") == expected


@pytest.mark.parametrize("overrides, bound_port, expected", [
    ({"advertise_addr": "http://me.example:80", "public_ip": "203.0.113.4", "public_port": 41234}, 8000,
     "http://me.example:80"),
    ({"public_ip": "203.0.113.4", "public_port": 41234}, 8000, "https://203.0.113.4:41234"),
    ({"public_ip": "2001:db8::4", "public_port": 41234}, 8000, "https://[2001:db8::4]:41234"),
    ({"public_ip": "203.0.113.4"}, 8000, "https://127.0.0.1:8000"),   # no port mapping: not reachable there
    ({"public_port": 41234}, 8000, "https://127.0.0.1:8000"),
    ({}, 43111, "https://127.0.0.1:43111"),                            # 0.0.0.0 and an ephemeral port
    ({"bind_host": "::"}, 8000, "https://127.0.0.1:8000"),
    ({"bind_host": "10.0.0.9"}, 8000, "https://10.0.0.9:8000"),
    ({"bind_host": "::1"}, 8000, "https://[::1]:8000"),
])
def test_the_advertised_url_prefers_explicit_then_public_then_bound_address(overrides, bound_port, expected):
    assert advertised_url(config(**overrides), bound_port) == expected


# --- secrets ----------------------------------------------------------------------------------------------------

def test_the_token_never_shows_in_repr_str_or_loggable_fields():
    cfg = parse({"PP_NODE_ID": "n1"})
    assert cfg.cluster_token == TOKEN
    for text in (repr(cfg), str(cfg), f"{cfg}", repr([cfg]), json.dumps(loggable(cfg))):
        assert TOKEN not in text
    assert "n1" in repr(cfg) and loggable(cfg)["node_id"] == "n1"


# --- client API keys (node/transport/auth.py says what they open) ----------------------------------------------------

KEY_A, KEY_B, KEY_C = "key-a-71c2", "key-b-9e04", "key-c-33d1"


def test_no_client_key_is_the_default_and_the_token_is_not_one():
    cfg = parse()
    assert (cfg.api_keys, cfg.token_is_api_key) == ((), False)


def test_client_keys_come_from_pp_api_key_comma_separated_or_from_repeated_flags_which_win():
    assert parse({"PP_API_KEY": f" {KEY_A} , {KEY_B},"}).api_keys == (KEY_A, KEY_B)
    assert parse({"PP_API_KEY": KEY_A}, ["--api-key", KEY_B, "--api-key", f"{KEY_C},{KEY_B}"]).api_keys == (KEY_B, KEY_C)


def test_client_keys_come_from_a_file_one_a_line_together_with_pp_api_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_B}\n\n  {KEY_C}  \n{KEY_A}\n")
    assert parse({"PP_API_KEY": KEY_A, "PP_API_KEY_FILE": str(keys)}).api_keys == (KEY_A, KEY_B, KEY_C)
    other = tmp_path / "other"
    other.write_text(KEY_C)
    assert parse({"PP_API_KEY_FILE": str(keys)}, ["--api-key-file", str(other)]).api_keys == (KEY_C,)


def test_the_cluster_token_opens_the_client_surface_only_when_the_operator_says_so():
    assert parse({"PP_TOKEN_IS_API_KEY": "1"}).token_is_api_key
    assert parse({}, ["--token-is-api-key"]).token_is_api_key
    assert parse({"PP_TOKEN_IS_API_KEY": "1", "PP_API_KEY": TOKEN}).api_keys == (TOKEN,)  # said so: allowed


@pytest.mark.parametrize("env, argv, message", [
    ({"PP_API_KEY": f"{KEY_A},{TOKEN}"}, [], "one of them is the cluster token (PP_CLUSTER_TOKEN)"),
    ({}, ["--api-key", TOKEN], "PP_TOKEN_IS_API_KEY=1"),
    ({"PP_API_KEY": "two words"}, [], "PP_API_KEY: key 1 holds a space"),
    ({}, ["--api-key", f"{KEY_A},caf\u00e9"], "--api-key: key 2 holds a space or a character outside visible ASCII"),
    ({"PP_API_KEY_FILE": "/no/such/keys"}, [], "PP_API_KEY_FILE='/no/such/keys': cannot read it: No such file"),
    ({}, ["--api-key-file", "{empty}"], "holds no key"),
    ({}, ["--api-key-file", "{comma}"], "line 2 holds a space, a comma"),
    ({"PP_TOKEN_IS_API_KEY": "yes"}, [], "PP_TOKEN_IS_API_KEY='yes': use 1 or 0"),
])
def test_a_bad_client_key_exits_2_naming_its_source_and_never_the_secret(capsys, tmp_path, env, argv, message):
    (tmp_path / "empty").write_text("\n \n")
    (tmp_path / "comma").write_text(f"{KEY_A}\n{KEY_B},{KEY_C}\n")
    argv = [a.format(empty=tmp_path / "empty", comma=tmp_path / "comma") for a in argv]
    with pytest.raises(SystemExit) as exc_info:
        parse(env, argv)
    err = capsys.readouterr().err
    assert exc_info.value.code == 2 and message in err, err
    assert TOKEN not in err and KEY_B not in err and "two words" not in err


def test_client_keys_never_show_in_repr_or_loggable_fields():
    cfg = parse({"PP_API_KEY": f"{KEY_A},{KEY_B}"})
    for text in (repr(cfg), str(cfg), json.dumps(loggable(cfg))):
        assert KEY_A not in text and KEY_B not in text


def test_help_names_the_client_key_settings(capsys):
    with pytest.raises(SystemExit):
        parse(argv=["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("PP_API_KEY", "--api-key-file", "PP_TOKEN_IS_API_KEY", "/metrics"))


# --- logging ----------------------------------------------------------------------------------------------------

@pytest.fixture
def log_lines():
    """setup_logging into a buffer; gives a function returning the lines so far as dicts; restores the loggers."""
    names = ("pp", "node", "worker")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    buffer = io.StringIO()
    setup_logging("INFO", node_id="stage0-abcdef12", stream=buffer)
    yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    for n, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(n)
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate


def test_an_event_is_one_json_line_with_time_level_node_name_and_fields(log_lines):
    before = datetime.datetime.now(datetime.timezone.utc)
    event(logging.getLogger("pp.node"), "peer_joined", peer="stage1-x", port=8001)
    [line] = log_lines()
    assert {k: line[k] for k in ("level", "node", "logger", "event", "peer", "port")} == {
        "level": "INFO", "node": "stage0-abcdef12", "logger": "pp.node", "event": "peer_joined",
        "peer": "stage1-x", "port": 8001}
    ts = datetime.datetime.fromisoformat(line["ts"])
    assert ts.utcoffset() == datetime.timedelta(0)
    assert abs(ts - before) < datetime.timedelta(seconds=60)


def test_fields_named_like_logrecord_attributes_or_base_keys_do_not_crash(log_lines):
    event(logging.getLogger("pp"), "odd", name="n", msg="m", args=(1, 2), exc_info="e", level="l", event="ev")
    [line] = log_lines()
    assert line["event"] == "odd" and line["level"] == "INFO"
    assert (line["name"], line["msg"], line["args"], line["exc_info"]) == ("n", "m", [1, 2], "e")
    assert (line["field_level"], line["field_event"]) == ("l", "ev")


def test_values_json_cannot_carry_are_written_as_their_repr(log_lines):
    event(logging.getLogger("pp"), "odd_values", path=Path("/m/x.gguf"), nan=float("nan"),
          tuple_keys={(1, 2): "a"}, nested=[{1, 2}], pct="100%")
    [line] = log_lines()
    assert line["path"] == repr(Path("/m/x.gguf"))
    assert line["nan"] == "nan"
    assert line["tuple_keys"] == "{(1, 2): 'a'}"
    assert line["nested"] == ["{1, 2}"]
    assert line["pct"] == "100%"


def test_the_level_filters_and_warn_and_error_events_carry_their_level(log_lines):
    buffer = io.StringIO()
    setup_logging("warning", node_id="n9", stream=buffer)  # replaces the fixture's handler, does not add one
    log = logging.getLogger("pp")
    event(log, "quiet")
    warn_event(log, "slow_peer", rtt_ms=900)
    error_event(log, "stage_failed", stage=2)
    lines = [json.loads(text) for text in buffer.getvalue().splitlines()]
    assert [(line["level"], line["event"], line["node"]) for line in lines] == [
        ("WARNING", "slow_peer", "n9"), ("ERROR", "stage_failed", "n9")]
    assert log_lines() == []


def test_module_loggers_write_json_too_and_exceptions_keep_their_traceback(log_lines):
    logging.getLogger("node.membership.swim").warning("probe of %s failed", "n3")
    try:
        raise OSError("connection refused")
    except OSError:
        logging.getLogger("pp").exception("send_failed", extra=as_extra(peer="n3"))
    first, second = log_lines()
    assert (first["logger"], first["event"]) == ("node.membership.swim", "probe of n3 failed")
    assert (second["event"], second["peer"]) == ("send_failed", "n3")
    assert "OSError: connection refused" in second["exc"]


def test_a_logged_config_does_not_contain_the_token(log_lines):
    cfg = parse({"PP_NODE_ID": "n1"})
    log = logging.getLogger("pp")
    event(log, "config", **loggable(cfg))
    event(log, "config_object", config=cfg)
    lines = log_lines()
    assert lines[0]["node_id"] == "n1" and lines[0]["cache_dir"] == "/home/alice/.cache/pp"
    assert "n1" in lines[1]["config"]
    assert all(TOKEN not in json.dumps(line) for line in lines)


@pytest.mark.parametrize("spec, expected", [
    (None, Faults()),
    ("", Faults()),
    ("drop=0.01,delay=0.05", Faults(drop=0.01, delay=0.05)),
    (" delay_ms=20 , seed=7 ,drop=1", Faults(drop=1.0, delay_ms=20.0, seed=7)),
])
def test_fault_injection_is_parsed_once_from_pp_faults(spec, expected):
    env = {} if spec is None else {"PP_FAULTS": spec}
    assert parse(env).faults == expected


async def test_injected_faults_drop_and_delay_about_the_share_asked_for(autojump_clock):
    faults = Faults(drop=0.1, delay=0.2, delay_ms=50, seed=3)
    start = trio.current_time()
    dropped = [await faults.before_send() for _ in range(2000)]
    assert 150 < sum(dropped) < 250  # 10% of 2000
    assert 300 * 0.05 < trio.current_time() - start < 500 * 0.05  # 20% delayed by 50 ms
    assert not any([await Faults().before_send() for _ in range(100)])


def test_the_layer_partition_is_planned_by_default_even_or_each_stage_s_count_when_given():
    assert parse().layer_partition == "auto" and parse({"PP_LAYER_PARTITION": "AUTO"}).layer_partition == "auto"
    assert parse({"PP_LAYER_PARTITION": "equal"}).layer_partition is None
    assert parse({"PP_LAYER_PARTITION": "4,20,6"}).layer_partition == (4, 20, 6)
    assert parse(argv=["--layer-partition", "1,1,28"]).layer_partition == (1, 1, 28)
