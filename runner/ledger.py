"""Rented instance ids on disk from the moment they exist, so a runner that is killed outright can be
cleaned up after with `ppsmoke.py --vastai --destroy-leftovers`."""
from __future__ import annotations

import json
import os
from pathlib import Path


class Ledger:
    def __init__(self, path: Path):
        self.path = path

    def ids(self) -> list[int]:
        try:
            return [int(i) for i in json.loads(self.path.read_text())["instances"]]
        except FileNotFoundError:
            return []

    def add(self, instance_id: int) -> None:
        self._write([*self.ids(), instance_id])

    def remove(self, instance_id: int) -> None:
        self._write([i for i in self.ids() if i != instance_id])

    def _write(self, ids: list[int]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"instances": sorted(set(ids))}))
        os.replace(tmp, self.path)  # atomic: a crash leaves the old or the new list, never half of one
