"""The house's size rules (issue 35), so a room that grows several jobs is noticed when it does: in the code a
node runs, no class has more than 20 methods, no function more than 60 lines, no file more than 420 lines;
the stage driver tests no stage number; roles/ imports nothing of node/."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = sorted(p for d in ("node", "roles", "worker", "runner") for p in (ROOT / d).rglob("*.py")) + [
    ROOT / "ppnode.py", ROOT / "ppsmoke.py"]
MAX_METHODS, MAX_FUNCTION_LINES, MAX_FILE_LINES = 20, 60, 420


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _defs(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.parametrize("path", FILES, ids=_name)
def test_a_file_keeps_within_the_house_sizes(path):
    source = path.read_text()
    tree = ast.parse(source)
    assert source.count("\n") <= MAX_FILE_LINES
    long = {f"{f.name}:{f.lineno}": f.end_lineno - f.lineno + 1 for f in _defs(tree)
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES}
    assert long == {}
    crowded = {c.name: n for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
               if (n := sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in c.body)) > MAX_METHODS}
    assert crowded == {}


def test_the_stage_driver_tests_no_stage_number():
    tree = ast.parse((ROOT / "node" / "stage_node.py").read_text())
    compared = [ast.unparse(c) for c in ast.walk(tree) if isinstance(c, ast.Compare)
                and any(isinstance(x, ast.Attribute) and x.attr in ("stage", "index") for x in [c.left, *c.comparators])]
    assert compared == []


def test_roles_import_nothing_of_the_node():
    for path in (ROOT / "roles").glob("*.py"):
        modules = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in modules if m.split(".")[0] == "node"}, path.name
