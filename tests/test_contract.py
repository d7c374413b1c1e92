"""worker/contract.py: light enough for the wire types to import, and what StageWorker offers the actors."""
import ast
import pathlib
import subprocess
import sys

from worker.contract import Worker
from worker.models import open_worker, stub_model
from worker.partition import Shard

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_contract_imports_neither_numpy_nor_a_backend():
    code = "import sys, worker.contract; print(sorted(m for m in ('numpy', 'tinygrad') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_wire_types_import_of_the_worker_only_its_contract():
    tree = ast.parse((ROOT / "roles" / "messages.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {m for m in imported if m.split(".")[0] == "worker"} == {"worker.contract"}


def test_every_stage_worker_has_every_op_of_the_contract():
    ops = {name for name in vars(Worker) if not name.startswith("_")}
    assert {"run", "release", "sample", "grammar_matcher", "info"} <= ops
    for s in range(3):
        worker = open_worker(stub_model(), Shard.of(s, 3))
        assert [name for name in sorted(ops) if not hasattr(worker, name)] == []
