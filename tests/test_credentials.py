"""Where the two credentials come from and where they go (node/transport/auth.py says what each opens): ppsmoke's
flags, files and variables for the cluster token, the clients' keys and the vast.ai key; the nodes' environment
the runner builds; what it announces."""
import json

import pytest

import ppsmoke
from runner.children import child_env
from runner.seed import SeedOptions
from runner.session import Use, announcement
from runner.vastai import VastOptions, node_env
from worker.contract import Sampling


# --- ppsmoke: where the secrets come from --------------------------------------------------------------------------

@pytest.fixture
def no_secret_env(monkeypatch):
    for name in ("PP_CLUSTER_TOKEN", "PP_API_KEY", "PP_API_KEY_FILE", "VAST_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def secrets(argv, env=None):
    args = ppsmoke.parse_args(["--seed", "--model", "tiny", *argv] if "--vastai" not in argv else
                              ["--image", "x", "--model", "tiny", *argv])
    return ppsmoke.secrets_of(args, env or {})


def test_ppsmoke_takes_the_token_and_client_keys_from_flags_files_or_the_environment(tmp_path):
    (tmp_path / "token").write_text("tok-from-file\n")
    (tmp_path / "keys").write_text("k-file-1\nk-file-2\n")
    assert secrets([]).token is None and secrets([]).api_keys == ()  # both random per run
    assert secrets([], {"PP_CLUSTER_TOKEN": " tok-env\n", "PP_API_KEY": "k1,k2"}).api_keys == ("k1", "k2")
    assert secrets([], {"PP_CLUSTER_TOKEN": " tok-env\n"}).token == "tok-env"
    assert secrets(["--token-file", str(tmp_path / "token")], {"PP_CLUSTER_TOKEN": "tok-env"}).token == "tok-from-file"
    got = secrets(["--api-key", "k3", "--api-key", "k4", "--api-key-file", str(tmp_path / "keys")], {"PP_API_KEY": "k1"})
    assert got.api_keys == ("k3", "k4", "k-file-1", "k-file-2")  # the flag wins over PP_API_KEY; files add
    assert secrets([], {"PP_API_KEY_FILE": str(tmp_path / "keys")}).api_keys == ("k-file-1", "k-file-2")
    assert "tok" not in repr(got) and "k3" not in repr(got)


def test_ppsmoke_takes_the_vast_key_from_vast_api_key_or_its_variable_and_api_key_stays_the_clients():
    got = secrets(["--vastai", "--vast-api-key", "vk", "--api-key", "client"])
    assert (got.vast_api_key, got.api_keys) == ("vk", ("client",))
    assert secrets(["--vastai"], {"VAST_API_KEY": "vk-env"}).vast_api_key == "vk-env"


@pytest.mark.parametrize("argv, says", [
    (["--vastai", "--image", "x", "--api-key", "k"], "--api-key is the clients' API key now; give the vast.ai key as "
                                                     "--vast-api-key or VAST_API_KEY"),
    (["--vastai", "--destroy-leftovers", "--api-key", "k"], "--vast-api-key"),
    (["--vastai", "--image", "x"], "--vastai needs your vast.ai API key: --vast-api-key or VAST_API_KEY"),
    (["--seed", "--token", "same", "--api-key", "same"], "one of them is the cluster token"),
    (["--seed", "--api-key", "a b"], "--api-key: key 1 holds a space"),
    (["--seed", "--token-file", "/no/such/token"], "--token-file '/no/such/token': cannot read it"),
])
def test_ppsmoke_refuses_bad_secrets_in_one_line_and_exit_2_pointing_the_way(capsys, no_secret_env, argv, says):
    assert ppsmoke.main([*argv, "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ppsmoke.py: error: ") and says in err[0], err
    assert "same" not in err[0]


def test_ppsmoke_takes_the_token_from_a_flag_or_a_file_not_both(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc_info:
        ppsmoke.parse_args(["--seed", "--token", "t", "--token-file", str(tmp_path / "t")])
    assert exc_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# --- the runner hands the keys on and announces the clients' ------------------------------------------------------

def use(**kw) -> Use:
    return Use("Say hello", 4, Sampling(0.0, 1.0), 5, "tiny", **kw)


def test_the_runner_announces_a_client_key_it_made_and_never_the_cluster_token():
    lines = announcement("http://127.0.0.1:8000/v1", use(api_key="made-up-key"))
    assert lines[:2] == ["OPENAI_BASE_URL=http://127.0.0.1:8000/v1", "OPENAI_API_KEY=made-up-key"]
    assert "-H 'Authorization: Bearer made-up-key'" in lines[2]
    given = announcement("http://127.0.0.1:8000/v1", use(api_key="users-own-key", key_given=True))
    assert "users-own-key" not in "".join(given) and '"Authorization: Bearer $OPENAI_API_KEY"' in given[2]
    assert "users-own-key" not in repr(use(api_key="users-own-key"))


def test_nodes_get_the_token_and_client_keys_in_their_environment_and_no_other_secret():
    env = child_env({"PP_API_KEY": "users", "PP_API_KEY_FILE": "/keys", "VAST_API_KEY": "vk", "HOME": "/h"}, stage=1,
                    num_stages=2, token="tok", model="tiny", seed="http://s:1", peer=None, api_keys=("k1", "k2"))
    assert (env["PP_CLUSTER_TOKEN"], env["PP_API_KEY"], env["HOME"]) == ("tok", "k1,k2", "/h")
    assert "PP_API_KEY_FILE" not in env and "VAST_API_KEY" not in env
    opts = VastOptions(num_stages=2, model="tiny", prompt="p", max_tokens=1, sampling=Sampling(0.0, 1.0), timeout_s=1,
                       converge_timeout_s=1, vast_api_key="secret-vast", base_url="http://v", image="i",
                       ledger_path=None, token="secret-token", api_keys=("secret-key",))
    assert node_env(opts, 0, "secret-token")["PP_API_KEY"] == "secret-key"
    assert "secret-vast" not in json.dumps(node_env(opts, 0, "secret-token"))
    seed = SeedOptions(num_stages=2, model="tiny", prompt="p", max_tokens=1, sampling=Sampling(0.0, 1.0), timeout_s=1,
                       converge_timeout_s=1, base_env={"VAST_API_KEY": "secret-vast"}, token="secret-token",
                       api_keys=("secret-key",))
    for text in (repr(opts), repr(seed)):
        assert "secret" not in text, text
