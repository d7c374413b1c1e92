"""A contiguous slice of a Llama transformer in tinygrad: blocks [lo, hi) with their KV caches,
plus the final norm and output head when the slice is the last one.

Batched steps over sequence slots. The KV cache of every block holds `max_seqs` sequences (slots)
plus one scratch slot that padding rows write to. One step runs B rows at once, each row one token
of some slot at some position: one pass over the weights for B tokens. A decode step of k requests
is k rows; a prompt chunk of one request is consecutive rows of the same slot; both mix in one step.

Why it is built this way (tinygrad 0.14, measured in docs/benchmarks.md):
- Graphs are captured per bucket size B (1, 2, 4, ...; a batch is padded up to its bucket) at boot,
  so no request waits on a compile, and one graph serves every position: the key length is the
  symbolic `kv_len` = 1 + the largest position in the step, and each row masks the keys past its own
  position, so rows at different positions share one attention kernel.
- Per-row data (slot, position, RoPE rows) comes in as input buffers written from the host, not as
  per-row symbolic variables: the kernel count of a step then does not grow with B (32 kernels for
  two blocks at B = 1 and at B = 16), and neither does the capture time.
- New keys and values are written by one small scatter kernel per block (`_kv_store`): tinygrad's
  indexed setitem rewrites the whole cache, which at 1B scale would move ~1 GB per step.
- Reads gather each row's slot with an index tensor, which tinygrad folds into direct loads. On the CPU one
  hand-written kernel per block does a step's attention instead (worker/compute/cpu_attention.py).
- On the CPU a captured step is submitted whole, not kernel by kernel from Python (whole_graphs.py).
- The head is its own graph, run only on the rows that are sampled.
- Matrices stay in the file's precision where it is F16, BF16, Q8_0 or Q4_1 (worker/weights/packed.py) and are
  widened inside the matmul kernels (worker/compute/linear.py; on the CPU hand-written ones, cpu_matvec.py):
  decode reads every weight once a step, so fewer bytes a weight is speed, and a stage holds about the
  file's bytes.
- Each row's arithmetic is the same whatever the bucket and whatever else is in the batch (row-wise
  matmuls, a row's masked keys add exact zeros): the same request gives bit-identical logits alone
  or batched (tests/test_batching.py), and so prompts chunked through the step graph equal stepping
  them one token at a time.

The embedding lookup is not here: it is a row gather the first stage does in numpy, so every slice
takes a hidden state in and all slices compile the same kernels whatever their role.
"""
from __future__ import annotations

import mmap
from typing import Callable

import attrs
import numpy as np
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes
from tinygrad.uop.ops import KernelInfo

from . import cpu_attention, cpu_kernels, cpu_threads, device_wait, kernel_cache, replay, warm, whole_graphs
from .replay import Replay
from .host_io import FROM_BLOB, StepInputs, aligned_copy, read, write
from ..batching import DEFAULT_MAX_SEQS, Segment, bucket_sizes, default_max_batch, split_rows, unmeasured_cost
from ..config import ModelConfig
from .linear import DeviceWeight, linear, to_device
from ..weights.packed import Packed
from ..files import ALIGN, lazy_zeros, shared_zeros
from ..kv_pages import SPARE, KvPages
from ..weights.contract import EMBEDDING, OUTPUT_NORM

# What a KV cache may hold (--kv-cache-dtype), by name: float16 halves its bytes; keys and values are rounded to
# it as they are stored, and widened back to float32 as attention reads them.
KV_DTYPES = {"float32": np.float32, "float16": np.float16}

# HF rotate-half RoPE: the first and second halves of each head form the rotary pairs.


def rope_tables(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position × frequency, (max_context, head_dim // 2) float32."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float64)
    angles = np.outer(np.arange(config.max_context, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * (x.square().mean(axis=-1, keepdim=True) + eps).rsqrt() * weight


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)


def _kv_store(cache: UOp, rows: UOp, index: UOp) -> UOp:
    """cache[index[b], :] = rows[b, :] for every row b: a scatter, one kernel whatever B."""
    b, j = UOp.range(rows.shape[0], 0), UOp.range(rows.shape[1], 1)
    store = cache.index(index[b].cast(dtypes.weakint), j).store(rows[b, j])
    return store.end(b, j).sink(arg=KernelInfo(name="kv_store", opts_to_apply=()))


class Block:
    """One transformer block and the KV cache of every slot: (slots × max_context, 2 × kv_heads × head_dim)."""

    def __init__(self, config: ModelConfig, w: dict[str, Tensor], slots: int, zeros: Callable[..., Tensor],
                 threads: cpu_threads.CpuThreads | None, kv_dtype=np.float32):
        self.config, self.w, self.slots, self.threads = config, w, slots, threads
        c = config
        # on the CPU, worker/compute/cpu_attention.py's kernel; elsewhere (or without pp's library) tinygrad's own
        self.hand_written = threads is not None and c.head_dim % 8 == 0
        self.cache = zeros((slots * c.max_context, 2 * c.n_kv_heads * c.head_dim), kv_dtype, lazy=True)

    def __call__(self, x: Tensor, rows: _Rows, kv_len: UOp, searched: bool) -> Tensor:
        c, w = self.config, self.w

        def mm(x: Tensor, name: str) -> Tensor:
            return linear(x, w[name], searched=searched, threads=self.threads)
        h = x + self._attention(_rms_norm(x, w["attn_norm"], c.norm_eps), rows, kv_len, mm)
        # Each matmul is its own kernel (contiguous): fused with its neighbours, tinygrad's CPU kernels
        # for several rows re-read the weights or recompute the norm and silu per output (one `small`
        # block: 46 → 35 ms at 16 rows, 24 → 16 ms at 8; a few more kernels cost tiny ~10 %).
        ffn_in = _rms_norm(h, w["ffn_norm"], c.norm_eps).contiguous()
        ffn = (mm(ffn_in, "ffn_gate").contiguous().silu() * mm(ffn_in, "ffn_up").contiguous()).contiguous()
        # contiguous: the block output is a buffer in every slicing, so kernels never fuse across blocks
        return (h + mm(ffn, "ffn_down")).contiguous()

    def _attention(self, x: Tensor, rows: _Rows, kv_len: UOp, mm) -> Tensor:
        c = self.config
        b, kvh, hd = x.shape[0], c.n_kv_heads, c.head_dim
        x = x.contiguous()
        q = mm(x, "attn_q").contiguous().reshape(b, c.n_heads, 1, hd)
        k = mm(x, "attn_k").contiguous().reshape(b, kvh, 1, hd)
        v = mm(x, "attn_v").contiguous().reshape(b, kvh, 1, hd)
        q, k = _rotate(q, rows.cos, rows.sin), _rotate(k, rows.cos, rows.sin)
        new = k.reshape(b, kvh * hd).cat(v.reshape(b, kvh * hd), dim=1).cast(self.cache.dtype).contiguous()
        cache = self.cache.custom_kernel(new, rows.cache_row, fxn=_kv_store)[0]
        if self.hand_written:
            out = cpu_attention.attention(q.reshape(b, c.n_heads * hd), cache, rows.ints, heads=c.n_heads,
                                          kv_heads=kvh, head_dim=hd, max_context=c.max_context, threads=self.threads)
            return mm(out, "attn_output")
        seen = cache.reshape(self.slots, c.max_context, 2, kvh, hd)[rows.slot, 0:kv_len]  # (b, kv_len, 2, kvh, hd)
        seen = seen.cast(dtypes.float32)  # a float16 cache is widened as it is read
        keys, values = seen[:, :, 0].permute(0, 2, 1, 3), seen[:, :, 1].permute(0, 2, 1, 3)
        out = q.scaled_dot_product_attention(keys, values, attn_mask=rows.mask, enable_gqa=True)
        return mm(out.reshape(b, c.dim), "attn_output")


@attrs.frozen
class _Rows:
    """Per-row inputs of a step, as tensors inside the graph."""

    cos: Tensor  # (b, 1, 1, head_dim // 2)
    sin: Tensor
    slot: Tensor  # (b,) int
    cache_row: Tensor  # (b,) int: slot * max_context + position, where the row's key/value go
    mask: Tensor  # (b, 1, 1, kv_len) bool: key l is visible to the row when l <= its position
    ints: Tensor  # (3, b) int32: position | slot | cache row, as written by the host


class StageModel:
    """Blocks `layers` of a model; with `head`, also final norm + output head (returns logits)."""

    def __init__(self, config: ModelConfig, layers: range, tensors, *, head_weight: str | None,
                 max_seqs: int = DEFAULT_MAX_SEQS, max_batch: int | None = None, threads: int = 1,
                 kv_dtype: str = "float32", cpu_target: str = cpu_kernels.NATIVE):
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be at least 1, got {max_seqs}")
        # pp's C kernels' cores (None: tinygrad's kernels compute, off the CPU or where the C cannot be built)
        self.kernels, self.threads = cpu_kernels.open_kernels(threads, cpu_target)
        self.config, self.layers, self.max_seqs = config, layers, max_seqs
        self.searched = False  # kernels are searched (BEAM) as graphs are captured: linear() picks its form by it
        self.scratch_slot = max_seqs  # padding rows write here; no sequence ever reads it
        self.buckets = bucket_sizes(max_batch or default_max_batch(max_seqs))
        # Each array goes to the device and out of `tensors` in turn (the caller hands them over, and may read
        # them only now: slice.py's _OnDemand), so a weight's host copy is freed as soon as the device holds it.
        # The embedding table is left to the caller, which looks rows up on the host.
        self._backing: list[np.ndarray] = []  # host arrays the CPU device uses in place (see _put)
        self._backing_of: dict[int, np.ndarray] = {}  # id(KV cache tensor) -> its lazy host array (trim)
        self._files: list[tuple[np.ndarray, int]] = []  # the KV caches' shared host arrays and memory files
        dev = {name: self._on_device(tensors.pop(name)) for name in [n for n in tensors if n != EMBEDDING]}
        self.blocks = [Block(config, {k.split(".")[2]: v for k, v in dev.items() if k.startswith(f"blk.{i}.")},
                             max_seqs + 1, self._zeros, self.threads, KV_DTYPES[kv_dtype]) for i in layers]
        row_bytes = [b.cache.nbytes() // ((max_seqs + 1) * config.max_context) for b in self.blocks]
        self.pages = KvPages(self._files, max_seqs + 1, config.max_context, row_bytes) \
            if self._files and len(self._files) == len(self.blocks) else None  # the CPU: rows shared by pages
        self.head, self._head_host = None, None
        if head_weight is not None:
            host = tensors[head_weight] if head_weight not in dev else None  # a tied head: the embedding
            self.head = (dev[OUTPUT_NORM], dev[head_weight] if host is None else self._on_device(host))
            if Device.DEFAULT.startswith("CPU"):  # the device computes on these very arrays (_put)
                self._head_host = host
        self.cos, self.sin = rope_tables(config)
        for module in (kernel_cache, whole_graphs, replay):  # whole_graphs before the first capture
            module.install()
        device_wait.install(self.threads.lib if self.threads else None)
        self._graphs, self._head_graphs = self._new_graphs(), self._new_head_graphs()
        self._inputs = {b: StepInputs(b, config.dim, config.head_dim, self._zeros) for b in self.buckets}
        self._head_inputs = {b: self._zeros((b, config.dim)) for b in self._head_graphs}
        # the buckets steps may use (all of them before warm_up) and one call's seconds in each
        self.bucket_cost = unmeasured_cost(self.buckets)
        self._beam = 0  # the kernel search warm_up was asked for, which later captures keep
        self._demand = warm.Demand()  # what steps lacked since the last capture

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _new_graphs(self) -> dict[int, Replay]:
        kv_len = {"kv_len": (1, self.config.max_context)}
        return {b: Replay(_capture_on_first_call(TinyJit(self._step)), kv_len) for b in self.buckets}

    def _new_head_graphs(self) -> dict[int, Replay]:
        return {b: Replay(_capture_on_first_call(TinyJit(self._head_step))) for b in self.buckets} if self.head else {}

    def _on_device(self, weight: np.ndarray | Packed) -> Tensor | DeviceWeight:
        if isinstance(weight, Packed):
            return to_device(weight, self._put, hand_written=self.threads is not None)
        return self._put(weight)

    def _zeros(self, shape: tuple[int, ...], dtype=np.float32, *, lazy: bool = False) -> Tensor:
        """A buffer of zeros on the device, from host memory: a zeros kernel is scheduled and lowered per
        shape, and those made most of a slice's weights phase (bench.boot at N = 5: 12.4-16.9 s → 2.7-3.2 s).
        `lazy` (the KV caches): on the CPU, pages that take memory only once written: a memory file slots may
        share pages of (files.shared_zeros, worker/kv_pages.py) where a slot is whole pages, else files.lazy_zeros."""
        if lazy and Device.DEFAULT.startswith("CPU"):
            region = shape[0] // (self.max_seqs + 1) * int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
            if region % mmap.PAGESIZE == 0:  # slots may share pages (worker/kv_pages.py)
                host, fd = shared_zeros(shape, dtype, file_factor=SPARE)
                self._files.append((host, fd))
            else:
                host = lazy_zeros(shape, dtype)
            tensor = self._put(host)
            self._backing_of[id(tensor)] = host  # lazy_host: what tests and trim read
            return tensor
        return self._put(np.zeros(shape, dtype))

    def _put(self, array: np.ndarray) -> Tensor:
        """An array on the device. The CPU device computes on the host array itself (no copy, kept alive
        here for as long as the model); any other device gets a copy."""
        array = np.ascontiguousarray(array)
        if not Device.DEFAULT.startswith("CPU") or array.dtype.type not in FROM_BLOB:
            return Tensor(array).realize()
        if array.ctypes.data % ALIGN:  # kernels read whole cache lines; a misaligned weight is slower to stream
            array = aligned_copy(array)
        self._backing.append(array)
        return Tensor.from_blob(array.ctypes.data, array.shape, dtype=FROM_BLOB[array.dtype.type],
                                device=Device.DEFAULT)

    def lazy_host(self, cache: Tensor) -> np.ndarray | None:
        """The host array a KV cache lives in where its pages are backed only once written (the CPU), else None."""
        return self._backing_of.get(id(cache))

    def head_host_weight(self) -> Packed | None:
        """The head's weight as host arrays the device itself computes on, where the device is the CPU;
        else None. A slice with both ends of a tied model looks embedding rows up here rather than in a
        second copy of the table."""
        return self._head_host

    @property
    def kv_bytes(self) -> int:
        return sum(b.cache.nbytes() for b in self.blocks)

    def _step(self, floats: Tensor, ints: Tensor, kv_len: UOp) -> Tensor:
        c, b = self.config, floats.shape[0]
        half = c.head_dim // 2
        x = floats[:, :c.dim]
        position, slot, cache_row = ints[0], ints[1], ints[2]
        mask = (Tensor.arange(kv_len).reshape(1, kv_len) <= position.reshape(b, 1)).reshape(b, 1, 1, kv_len)
        rows = _Rows(floats[:, c.dim:c.dim + half].reshape(b, 1, 1, half),
                     floats[:, c.dim + half:].reshape(b, 1, 1, half), slot, cache_row, mask, ints)
        # Each block realized on its own: the blocks' schedules are the same function of their buffers, so
        # tinygrad schedules the first and finds the others in its schedule cache (SCACHE). One realize of
        # all blocks was one schedule of n times the size (docs/benchmarks.md, "Losing a stage").
        for block in self.blocks:
            x = block(x, rows, kv_len, self.searched).realize()
        return x

    def _head_step(self, x: Tensor) -> Tensor:
        """Final norm and head, a graph of its own: only the rows that are sampled need logits (a prompt's
        last row, not the other rows of its chunks), and the head is the largest matrix of a small model."""
        norm, out = self.head
        return linear(_rms_norm(x, norm, self.config.norm_eps), out, searched=self.searched, threads=self.threads).realize()

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        """The head over `hidden` (rows, dim), in calls of the largest captured bucket, each padded to its
        bucket."""
        ready = [b for b in self.buckets if b in self.bucket_cost]
        outs = []
        for i in range(0, len(hidden), ready[-1]):
            part = hidden[i:i + ready[-1]]
            outs.append(self.head_call(next(b for b in ready if b >= len(part)), part))
        return np.concatenate(outs)

    def head_call(self, bucket: int, part: np.ndarray) -> np.ndarray:
        padded = np.zeros((bucket, self.config.dim), dtype=np.float32)
        padded[:len(part)] = part
        write(self._head_inputs[bucket], padded)
        return read(self._head_graphs[bucket](self._head_inputs[bucket]))[:len(part)]

    def forward_batch(self, hidden: np.ndarray, segments: list[Segment], logit_rows=None) -> np.ndarray:
        """hidden (rows, dim) float32, the rows of `segments` in order → next hidden (rows, dim); with a
        head, the logits of each segment's last row (len(segments), vocab), or of the rows `logit_rows`
        names (indices into the step's rows: every row of a prompt whose logprobs were asked for). The rows
        run as one or more graph calls, in order (split_rows picks the cheapest cut), so a segment may be
        any length."""
        _check(hidden, segments, self.config, self.max_seqs)
        if self.pages is not None:  # no page a segment writes may be another slot's (copy on write)
            for s in segments:
                self.pages.writable(s.slot, s.position)
        slots = np.concatenate([np.full(s.length, s.slot) for s in segments])
        positions = np.concatenate([np.arange(s.position, s.position + s.length) for s in segments])
        data = np.ascontiguousarray(hidden, dtype=np.float32)
        if len(self.bucket_cost) < len(self.buckets):  # a lazy warm_up left buckets to capture
            self._demand.count(len(data), self.bucket_cost, self.buckets)
        outs, i = [], 0
        for n in split_rows(len(data), self.bucket_cost):
            outs.append(self.run_graph(data[i:i + n], slots[i:i + n], positions[i:i + n]))
            i += n
        out = np.concatenate(outs)
        if self.head is None:
            return out
        rows = np.cumsum([s.length for s in segments]) - 1 if logit_rows is None else np.asarray(logit_rows)
        if not len(rows):  # prompt chunks before the last: no logits wanted
            return np.zeros((0, self.config.vocab_size), dtype=np.float32)
        return self._logits(out[rows])

    def forward(self, hidden: np.ndarray, start_pos: int) -> np.ndarray:
        """One sequence in slot 0: hidden (seq_len, dim) → next hidden, or logits (vocab,) with a head."""
        out = self.forward_batch(hidden, [Segment(0, start_pos, hidden.shape[0])])
        return out[0] if self.head is not None else out

    def run_graph(self, hidden: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                  bucket: int | None = None) -> np.ndarray:
        """One graph call: pad the rows up to their bucket (the smallest captured one that holds them) with
        scratch-slot rows at position 0."""
        n = len(hidden)
        bucket = bucket or next(b for b in self.buckets if b >= n and b in self.bucket_cost)
        pad = bucket - n
        c = self.config
        positions = np.concatenate([positions, np.zeros(pad, dtype=positions.dtype)])
        slots = np.concatenate([slots, np.full(pad, self.scratch_slot)])
        floats = np.zeros((bucket, c.dim + c.head_dim), dtype=np.float32)
        floats[:n, :c.dim] = hidden
        floats[:, c.dim:] = np.concatenate([self.cos[positions], self.sin[positions]], axis=1)
        ints = np.stack([positions, slots, slots * c.max_context + positions]).astype(np.int32)
        inputs = self._inputs[bucket]
        inputs.write(floats, ints)
        return read(self._graphs[bucket](inputs.floats, inputs.ints, kv_len=int(positions.max()) + 1))[:n]

    def warm_up(self, beam: int = 0, buckets: tuple[int, ...] | None = None) -> dict[int, float]:
        """Capture the graphs of `buckets` (default: every one) now, so that no request pays their compile,
        and price each; until the others are captured (warm_more), steps use these alone. The calls write
        only the scratch slot (worker/compute/warm.py).

        `beam` > 0: tinygrad's kernel search (BEAM) picks each kernel's tiling by timing candidates while a
        graph is captured. It costs minutes at a first boot; tinygrad keeps what it found in its on-disk
        cache (table beam_search) and kernel_cache keeps the lowered programs, so the next boot of the same
        slice pays neither. Narrow weights then take the split matmul form (worker/compute/linear.py).

        Returns the seconds each bucket's capture took (its step graph and, on the last stage, its head's),
        for the boot's timeline (bench/boot.py)."""
        if beam and not self.searched:  # graphs captured before (by a call) are captured again in that form
            self.searched, self._graphs, self._head_graphs = True, self._new_graphs(), self._new_head_graphs()
        self._beam, self.bucket_cost, captured = beam, {}, {}
        for bucket in buckets or self.buckets:
            captured[bucket], self.bucket_cost[bucket] = warm.capture(self, bucket, beam)
        self._demand.capture_s = list(captured.values())
        return captured

    def warm_more(self) -> tuple[int, float] | None:
        """Capture a bucket not captured yet, and let steps use it: the one the steps since the last capture
        wanted most (warm.demanded), or at an idle moment the smallest. Its size and the capture's seconds,
        or None when every bucket is captured."""
        if len(self.bucket_cost) == len(self.buckets):
            return None
        bucket = warm.demanded(self._demand.most if self.wants_capture else 0, self.bucket_cost, self.buckets)
        took, cost = warm.capture(self, bucket, self._beam)
        self.bucket_cost = {**self.bucket_cost, bucket: cost}
        self._demand.captured(took)
        return bucket, took

    @property
    def wants_capture(self) -> bool:
        """Steps lacked a bucket enough to capture it now (warm.Demand.pressing)."""
        return self._demand.pressing


def _check(hidden: np.ndarray, segments: list[Segment], config: ModelConfig, max_seqs: int) -> None:
    """A step's rows and segments fit the slice: its width, its slots and its context."""
    rows = sum(s.length for s in segments)
    if not segments or hidden.shape != (rows, config.dim):
        raise ValueError(f"hidden {hidden.shape} does not match {rows} rows of {len(segments)} segments "
                         f"× dim {config.dim}")
    for s in segments:
        if not 0 <= s.slot < max_seqs or s.length < 1 or s.position < 0:
            raise ValueError(f"{s}: need slot in 0..{max_seqs - 1}, position >= 0, length >= 1")
        if s.position + s.length > config.max_context:
            raise ValueError(f"position {s.position + s.length} exceeds the context of {config.max_context}")


def _capture_on_first_call(jit: TinyJit) -> TinyJit:
    """TinyJit runs its first call eagerly and captures on the second; that first run only matters for
    state made lazily on first use, and every weight, cache and input here is realized before the first
    step. Capturing at once halves the work of a node's boot."""
    jit.cnt = 1
    return jit
