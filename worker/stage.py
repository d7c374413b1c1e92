"""The worker contract a node calls: one stage's ops, checked against its role and each request's position.

Hidden states cross stage boundaries as float32 bytes of shape (seq_len, hidden_dim): f16 would
flip near-ties between the pipeline and single-process generation.
One request holds the KV caches at a time; a new prefill supersedes any other request, whose
later steps are then refused as unknown.
"""
from __future__ import annotations

import attrs
import numpy as np

from .errors import WorkerError
from .partition import Role, layer_range, role_of
from .sampling import GREEDY, Sampling, sample
from .slice import Slice


@attrs.frozen
class WorkerInfo:
    """What a ready worker reports about itself."""

    stage: int
    num_stages: int
    role: Role
    layers: range
    total_blocks: int
    hidden_dim: int
    vocab_size: int
    max_context: int
    stop_ids: frozenset[int]
    weight_bytes: int


@attrs.frozen
class Sampled:
    token_id: int
    logits: np.ndarray  # (vocab,) float32, what token_id was drawn from


@attrs.define
class _Request:
    next_position: int
    sampling: Sampling
    rng: np.random.Generator


class StageWorker:
    def __init__(self, compute: Slice, tokenizer, *, stage: int, num_stages: int, total_blocks: int):
        self.role = role_of(stage, num_stages)
        self.compute, self.tokenizer = compute, tokenizer
        self.info = WorkerInfo(
            stage=stage, num_stages=num_stages, role=self.role,
            layers=layer_range(total_blocks, stage, num_stages), total_blocks=total_blocks,
            hidden_dim=compute.hidden_dim, vocab_size=compute.vocab_size, max_context=compute.max_context,
            stop_ids=frozenset(tokenizer.stop_ids), weight_bytes=compute.weight_bytes)
        self._requests: dict[str, _Request] = {}

    # -- first stage -------------------------------------------------------------------------
    def tokenize(self, prompt: str, *, chat: bool = True) -> list[int]:
        self._require(Role.FIRST, "tokenize")
        return self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt, bos=True)

    def embed_and_forward(self, request_id: str, tokens: list[int], position: int = 0) -> bytes:
        """Prefill: embed `tokens` at `position` and run this stage's blocks."""
        self._require(Role.FIRST, "embed_and_forward")
        if not tokens:
            raise WorkerError("embed_and_forward: no tokens")
        self._check_tokens(tokens)
        return self._step(request_id, position, len(tokens), GREEDY, lambda: self.compute.embed(tokens)).tobytes()

    def decode_step(self, request_id: str, token_id: int, position: int) -> bytes:
        """Decode: embed the token fed back by the last stage at `position` and run the blocks."""
        self._require(Role.FIRST, "decode_step")
        self._check_tokens([token_id])
        return self._step(request_id, position, 1, GREEDY, lambda: self.compute.embed([token_id])).tobytes()

    # -- middle stages -----------------------------------------------------------------------
    def forward_range(self, request_id: str, hidden: bytes, position: int, seq_len: int) -> bytes:
        self._require(Role.MIDDLE, "forward_range")
        x = self._hidden(hidden, seq_len)
        return self._step(request_id, position, seq_len, GREEDY, lambda: x).tobytes()

    # -- last stage --------------------------------------------------------------------------
    def forward_and_sample(self, request_id: str, hidden: bytes, position: int, seq_len: int,
                           sampling: Sampling | None = None) -> Sampled:
        """Run the blocks, final norm and head, then sample from the last position's logits.

        `sampling` is taken when the request starts (position 0) and kept for its later steps.
        """
        self._require(Role.LAST, "forward_and_sample")
        x = self._hidden(hidden, seq_len)
        logits = self._step(request_id, position, seq_len, sampling or GREEDY, lambda: x)
        req = self._requests[request_id]
        return Sampled(sample(logits, req.sampling, req.rng), logits)

    def detokenize(self, tokens: list[int]) -> str:
        self._require(Role.LAST, "detokenize")
        self._check_tokens(tokens)
        return self.tokenizer.decode(tokens)

    # -- any stage ---------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile before the first request (a node calls this before it reports ready)."""
        self.compute.warm_up()

    def release(self, request_id: str) -> None:
        """Forget a request; releasing an unknown one is a no-op so teardown can be repeated."""
        self._requests.pop(request_id, None)

    # -- checks ------------------------------------------------------------------------------
    def _require(self, role: Role, op: str) -> None:
        if self.role is not role:
            raise WorkerError(f"{op} is a {role.value}-stage op; this worker is stage {self.info.stage} "
                              f"of {self.info.num_stages} ({self.role.value})")

    def _check_tokens(self, tokens: list[int]) -> None:
        bad = [t for t in tokens if not (isinstance(t, int) and 0 <= t < self.info.vocab_size)]
        if bad:
            raise WorkerError(f"token ids out of range 0..{self.info.vocab_size - 1}: {bad[:5]}")

    def _hidden(self, data: bytes, seq_len: int) -> np.ndarray:
        dim = self.info.hidden_dim
        if seq_len < 1 or len(data) != seq_len * dim * 4:
            raise WorkerError(f"hidden state of {len(data)} bytes does not match seq_len {seq_len} × "
                              f"hidden_dim {dim} × 4 bytes (float32)")
        return np.frombuffer(data, dtype=np.float32).reshape(seq_len, dim)

    def _step(self, request_id: str, position: int, seq_len: int, sampling: Sampling, inputs) -> np.ndarray:
        """Run the slice for a request whose next position must be `position` (a new request starts at 0).

        `sampling` is kept only when the request starts. A step that fails forgets the request: its
        KV cache may be half-written, so continuing it would silently give wrong tokens.
        """
        if position + seq_len > self.compute.max_context:
            raise WorkerError(f"request {request_id!r}: position {position} + {seq_len} tokens exceeds the "
                              f"context of {self.compute.max_context}")
        if position == 0:
            self._requests = {request_id: _Request(0, sampling, np.random.default_rng(sampling.seed))}
        req = self._requests.get(request_id)
        if req is None:
            raise WorkerError(f"unknown request {request_id!r} (never started here, released, or superseded)")
        if position != req.next_position:
            raise WorkerError(f"request {request_id!r}: got position {position}, expected {req.next_position}")
        try:
            out = self.compute.forward(inputs(), position)
        except BaseException:
            self.release(request_id)
            raise
        req.next_position = position + seq_len
        return out
