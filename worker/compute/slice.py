"""The tinygrad Slice (worker/slice.py's protocol): a stage's blocks and KV caches on a device, its weights
read from a WeightSource one tensor at a time.
"""
from __future__ import annotations

import attrs
import numpy as np

from ..batching import DEFAULT_MAX_SEQS, Segment
from ..config import ModelConfig
from . import kv_rows, warm
from .cpu_target import NATIVE
from .model import StageModel
from ..weights.packed import Packed
from ..weights.packed import dense as packed_dense
from ..weights.contract import EMBEDDING, NARROW_KINDS, OUTPUT, WeightSource, is_matrix, stage_tensor_names


class _OnDemand:
    """A slice's tensors, each read from the source only when taken, so that the host holds one weight at a
    time on its way to the device rather than all of them at once. `nbytes` counts each tensor once.

    Matrices come as Packed, in the file's precision where it is one of `keep` (weights.contract.narrow_kinds),
    else widened to float32; norm weights as float32 arrays."""

    def __init__(self, source: WeightSource, names, keep: frozenset[str] = NARROW_KINDS):
        self._source, self._names, self._keep = source, list(names), keep
        self._counted: set[str] = set()
        self.nbytes = 0

    def __iter__(self):
        return iter(list(self._names))

    def __getitem__(self, name: str) -> np.ndarray | Packed:
        if name not in self._names:
            raise KeyError(name)
        if not is_matrix(name):
            array = self._source.load(name)
        elif not self._keep:  # the f32 path: the source widens, as it always has
            array = packed_dense("f32", self._source.load(name))
        else:
            array = self._source.load_packed(name)
            if array.kind != "f32" and array.kind not in self._keep:
                array = packed_dense("f32", array.widened())
        if name not in self._counted:
            self._counted.add(name)
            self.nbytes += array.nbytes
        return array

    def pop(self, name: str) -> np.ndarray | Packed:
        array = self[name]
        self._names.remove(name)
        return array


class TinygradSlice:
    def __init__(self, source: WeightSource, layers: range, *, embed: bool, head: bool,
                 max_seqs: int = DEFAULT_MAX_SEQS, keep: frozenset[str] = NARROW_KINDS, max_context: int | None = None,
                 threads: int = 1, kv_dtype: str = "float32", cpu_target: str = NATIVE):
        config: ModelConfig = source.config
        if max_context is not None:  # KV and RoPE tables are sized by it; the file's context is the most
            if max_context < 1:
                raise ValueError(f"max_context must be at least 1, got {max_context}")
            config = attrs.evolve(config, max_context=min(max_context, config.max_context))
        tensors = _OnDemand(source, stage_tensor_names(config, layers, embed=embed, head=head), keep)
        self.hidden_dim, self.vocab_size, self.max_context = config.dim, config.vocab_size, config.max_context
        head_weight = (EMBEDDING if config.tie_embeddings else OUTPUT) if head else None
        self.model = StageModel(config, layers, tensors, head_weight=head_weight, max_seqs=max_seqs,
                                threads=threads, kv_dtype=kv_dtype, cpu_target=cpu_target)
        self._table = None
        if embed:  # the table stays on the host, where rows are looked up; a tied head's device copy will do
            view = self.model.head_host_weight() if head_weight == EMBEDDING else None
            self._table: Packed = view if view is not None else tensors[EMBEDDING]
        self.weight_bytes = tensors.nbytes
        self.max_seqs, self.max_batch = max_seqs, self.model.max_batch
        self.kv_bytes = self.model.kv_bytes
        self.kernels = self.model.kernels

    def embed(self, token_ids: list[int]) -> np.ndarray:
        return self._table.rows(np.asarray(token_ids, dtype=np.int64))

    def forward_batch(self, hidden: np.ndarray, segments: list[Segment], logit_rows=None) -> np.ndarray:
        return self.model.forward_batch(hidden, segments, logit_rows)

    def forward(self, hidden: np.ndarray, position: int) -> np.ndarray:
        return self.model.forward(hidden, position)

    def copy_rows(self, src: int, dst: int, rows: int) -> bool:
        return kv_rows.copy_rows(self.model, src, dst, rows)

    def trim(self, slot: int) -> None:
        kv_rows.trim(self.model, slot)

    def warm_up(self, beam: int = 0, *, lazy: bool = False, prompt_rows: int | None = None) -> dict[int, float]:
        return self.model.warm_up(beam, warm.boot_buckets(self.model.buckets, prompt_rows) if lazy else None)

    def warm_more(self) -> tuple[int, float] | None:
        return self.model.warm_more()

    @property
    def wants_capture(self) -> bool:
        return self.model.wants_capture
