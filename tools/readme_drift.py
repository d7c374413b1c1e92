"""What the README claims of the code, read out of its markdown, and what the code has, read out of its source:
the flags a command line gives ppsmoke.py or ppnode.py, the flags and PP_* variables the prose names, and the
HTTP routes it lists against those the node serves. Pure functions over text and syntax trees: tests/test_readme.py
holds the README to them.
"""
from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

import attrs

PROGRAMS = ("ppsmoke.py", "ppnode.py")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
FLAG = re.compile(r"(?<![\w-])--[A-Za-z0-9][\w-]*")
OPTION = re.compile(r"^(--[A-Za-z0-9][\w-]*|-[A-Za-z])(=.*)?$")
PP_VARIABLE = re.compile(r"(?<![A-Za-z0-9_])PP_[A-Z0-9_]*[A-Z0-9]")
SHELL_BREAKS = frozenset({"&&", "||", ";", "|", "&", "(", ")", "$(", ";;"})
ROUTE_PREFIXES = ("/v1/", "/health", "/metrics", "/tokenize", "/detokenize", "/tokenizer_info", "/swim/")
NAMED_PATH = re.compile(r"^(?:(GET|POST|PUT|PATCH|DELETE|HEAD)\s+)?(/\S*)$")
PLACEHOLDER = re.compile(r"\{[^}/]*\}|<[^>/]*>")


# --- markdown ---------------------------------------------------------------------------------------------------

def split_markdown(text: str) -> tuple[str, list[str]]:
    """The prose (each fenced block's lines blanked, so line numbers hold) and the fenced blocks' contents."""
    prose, blocks, block, fence = [], [], [], None
    for line in text.splitlines():
        opened = FENCE.match(line)
        if fence is None and opened:
            fence, block = opened.group(1), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            fence = None
            blocks.append("\n".join(block))
            prose.append("")
        elif fence is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    if fence is not None:  # an unclosed fence runs to the end, as in CommonMark
        blocks.append("\n".join(block))
    return "\n".join(prose), blocks


def inline_code(prose: str) -> list[str]:
    """The inline code spans of `prose`, a span's line breaks read as spaces (CommonMark's rule); a span never
    crosses a blank line, so one stray backtick costs its paragraph's spans, not the rest of the file's."""
    return [" ".join(m.group(2).split()) for paragraph in re.split(r"\n[ \t]*\n", prose)
            for m in INLINE_CODE.finditer(paragraph)]


def command_lines(block: str) -> list[str]:
    """A code block's lines, each `\\` continuation joined to its line."""
    lines, pending = [], ""
    for line in block.splitlines():
        line = line.lstrip() if pending else line
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].rstrip() + " "
        else:
            lines.append(pending + line)
            pending = ""
    return lines + ([pending.rstrip()] if pending else [])


def _words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unclosed quote: a sketch of a command, not one; read it by spaces
        return line.split("#")[0].split()


def program_flags(line: str) -> list[tuple[str, str]]:
    """(program, option) for each option a command line gives ppsmoke.py or ppnode.py, however it runs them
    (`python ppnode.py`, `.venv/bin/python ppsmoke.py`, `FOO=1 python ppnode.py`, after `&&`). Comments and
    quoted values are not options; `--flag=value` is `--flag`."""
    found, program = [], None
    for word in _words(line):
        if word in SHELL_BREAKS:
            program = None
        elif program is None:
            program = PurePosixPath(word).name if PurePosixPath(word).name in PROGRAMS else None
        elif m := OPTION.match(word):
            found.append((program, m.group(1)))
    return found


@attrs.frozen
class Attributed:
    program: str
    flag: str
    where: str  # the command line, as the README has it


def attributed_flags(text: str) -> list[Attributed]:
    """Every option the README gives ppsmoke.py or ppnode.py on a command line: in fenced blocks, and in inline
    code that runs one (`ppsmoke.py --seed -n 2 --serve`)."""
    prose, blocks = split_markdown(text)
    lines = [line for block in blocks for line in command_lines(block)] + inline_code(prose)
    return [Attributed(program, flag, line.strip()) for line in lines for program, flag in program_flags(line)]


def prose_flags(text: str) -> list[str]:
    """Every `--flag` named in inline code outside fenced blocks, in order, repeats kept."""
    prose, _ = split_markdown(text)
    return [flag for span in inline_code(prose) for flag in FLAG.findall(span)]


def command_drift(text: str, options: Mapping[str, Iterable[str]]) -> list[str]:
    """The options the README's command lines give a program that its parser lacks: `options` maps each program
    (ppsmoke.py, ppnode.py) to its option strings. One message per finding, naming the line."""
    options = {program: set(names) for program, names in options.items()}
    return list(dict.fromkeys(f"{a.flag} is not an option of {a.program} (README: {a.where})"
                              for a in attributed_flags(text) if a.flag not in options[a.program]))


def prose_drift(text: str, options: Mapping[str, Iterable[str]], allowed: Iterable[str] = ()) -> list[str]:
    """The `--flags` the prose names that no program of `options` has, but for `allowed`: other programs' flags
    named for comparison."""
    known = set().union(*map(set, options.values())) | set(allowed)
    return [f"`{flag}` in the prose is an option of neither {' nor '.join(options)}"
            for flag in dict.fromkeys(prose_flags(text)) if flag not in known]


def named_variables(text: str) -> set[str]:
    """Every PP_* name in the README, prose and code alike (VLLM_PP_... is vLLM's, not ours)."""
    return set(PP_VARIABLE.findall(text))


# --- source -----------------------------------------------------------------------------------------------------

def source_variables(paths: Iterable[Path]) -> set[str]:
    """The PP_* variables the source names as a string of their own: `environ.get("PP_X")`, a table's key, a
    stdout line's prefix ("PP_GPU_NODE_ADDR="). A name only inside a message does not count."""
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if m := re.fullmatch(r"(PP_[A-Z0-9_]*[A-Z0-9])(=.*)?", node.value, re.S):
                    found.add(m.group(1))
    return found


@attrs.frozen
class Route:
    rule: str  # quart's, with its converters: /v1/models/<path:model_id>
    methods: frozenset[str]
    file: str

    def serves(self, path: str, method: str | None = None) -> bool:
        """Whether a path the README names (`{id}` or `<id>` for a segment; a trailing `*` for anything under
        it) is this route's, with `method` where it says one."""
        if method is not None and method not in self.methods:
            return False
        path = PLACEHOLDER.sub("x", path.split("?")[0])
        if path.endswith("*"):
            return self.rule.startswith(path[:-1])
        return re.fullmatch(rule_pattern(self.rule), path) is not None


def rule_pattern(rule: str) -> str:
    """A quart rule as a regex: `<path:x>` any text, `<x>` or `<int:x>` one segment."""
    parts = re.split(r"(<[^>]+>)", rule)
    return "".join((".+" if p.startswith("<path:") else "[^/]+") if p.startswith("<") else re.escape(p)
                   for p in parts)


_DECORATED = {"get": "GET", "post": "POST", "put": "PUT", "patch": "PATCH", "delete": "DELETE"}


def served_routes(paths: Iterable[Path], root: Path) -> tuple[list[Route], list[str]]:
    """The routes the source registers (`@app.get(...)`, `@app.route(...)`, `app.add_url_rule(...)`), and the
    registrations whose path the reader could not work out (each `file:line`), so none goes missing silently.
    Paths are read from literals, module constants joined with `+`, and a `for` loop over a module-level list."""
    routes, unresolved = [], []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        constants = _module_constants(tree)
        for call, scope in _registrations(tree, constants):
            rules = _strings(call.args[0], scope) if call.args else []
            name = f"{path.relative_to(root)}:{call.lineno}"
            if not rules:
                unresolved.append(name)
            routes += [Route(rule, _methods(call), str(path.relative_to(root))) for rule in rules]
    return routes, unresolved


def _module_constants(tree: ast.Module) -> dict[str, list[object]]:
    constants: dict[str, list[object]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            constants[stmt.targets[0].id] = [stmt.value]
    return constants


def _registrations(tree: ast.AST, constants: dict[str, list[object]]):
    """(call, scope) for every route registration; `scope` binds module constants and the loop variables of
    the `for` loops around the call."""
    def visit(node: ast.AST, scope: dict[str, list[object]]):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Name):
            items = [e for v in scope.get(node.iter.id, []) if isinstance(v, (ast.List, ast.Tuple)) for e in v.elts]
            scope = {**scope, **_bind(node.target, items)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # `.get(` elsewhere is a dict's or a query's
            yield from ((d, scope) for d in node.decorator_list if isinstance(d, ast.Call)
                        and isinstance(d.func, ast.Attribute) and d.func.attr in (*_DECORATED, "route"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_url_rule":
            yield node, scope
        for child in ast.iter_child_nodes(node):
            yield from visit(child, scope)
    yield from visit(tree, constants)


def _bind(target: ast.expr, items: list[ast.expr]) -> dict[str, list[object]]:
    if isinstance(target, ast.Name):
        return {target.id: items}
    bound: dict[str, list[object]] = {}
    if isinstance(target, ast.Tuple):
        for i, name in enumerate(target.elts):
            if isinstance(name, ast.Name):
                bound[name.id] = [e.elts[i] for e in items if isinstance(e, ast.Tuple) and len(e.elts) > i]
    return bound


def _strings(node: object, scope: dict[str, list[object]]) -> list[str]:
    """Every string `node` may be: a literal, a name bound in `scope`, or two of those joined with `+`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name):
        return [s for value in scope.get(node.id, []) for s in _strings(value, scope)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [a + b for a in _strings(node.left, scope) for b in _strings(node.right, scope)]
    return []


def _methods(call: ast.Call) -> frozenset[str]:
    if call.func.attr in _DECORATED:
        return frozenset({_DECORATED[call.func.attr]})
    for keyword in call.keywords:
        if keyword.arg == "methods" and isinstance(keyword.value, (ast.List, ast.Tuple, ast.Set)):
            return frozenset(e.value for e in keyword.value.elts if isinstance(e, ast.Constant))
    return frozenset({"GET"})  # quart's default


# --- routes against the README ----------------------------------------------------------------------------------

@attrs.frozen
class NamedPath:
    method: str | None
    path: str

    def __str__(self) -> str:
        return f"{self.method} {self.path}" if self.method else self.path


def named_paths(text: str) -> list[NamedPath]:
    """Every endpoint the README's prose names in inline code: `GET /path`, `POST /path` or `/path`, for the
    paths the node serves under (`/v1/...`, `/health`, `/metrics`, `/tokenize`, ..., `/swim/...`, `/`)."""
    prose, _ = split_markdown(text)
    found = []
    for span in inline_code(prose):
        m = NAMED_PATH.match(span)
        if m and (m.group(2) == "/" or m.group(2).startswith(ROUTE_PREFIXES)):
            found.append(NamedPath(m.group(1), m.group(2)))
    return list(dict.fromkeys(found))


def unserved(named: Iterable[NamedPath], routes: Iterable[Route]) -> list[NamedPath]:
    """The README's endpoints that no route serves (with the method it names, where it names one)."""
    routes = list(routes)
    return [n for n in named if not any(r.serves(n.path, n.method) for r in routes)]


def unnamed(required: Iterable[Route], named: Iterable[NamedPath]) -> list[Route]:
    """The routes in `required` that the README names nowhere."""
    named = list(named)
    return [r for r in required if not any(r.serves(n.path) for n in named)]
