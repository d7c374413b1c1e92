"""Fault injection for chaos tests: a node started with PP_FAULTS drops or delays some of the sends of its
links (activations to the next stage, fed-back tokens to stage 0), as a lossy, jittery network would.

    PP_FAULTS="drop=0.01,delay=0.05,delay_ms=50,seed=7"

A dropped send fails as a broken connection does (the link stream breaks mid-body, a POST fails before
it is sent), so what the transport does about it — reopen, ask what arrived, resend — is what is tested.
Off unless set; parsed once at the entrypoint (node/config/)."""
from __future__ import annotations

import random

import attrs
import trio


class FaultSpecError(ValueError):
    """PP_FAULTS could not be parsed; the message names the part."""


@attrs.frozen
class Faults:
    drop: float = 0.0  # probability that a send is dropped
    delay: float = 0.0  # probability that a send is delayed by delay_ms
    delay_ms: float = 50.0
    seed: int | None = None
    _rng: random.Random = attrs.field(init=False, eq=False, repr=False,
                                      default=attrs.Factory(lambda self: random.Random(self.seed), takes_self=True))

    @property
    def active(self) -> bool:
        return self.drop > 0 or self.delay > 0

    async def before_send(self) -> bool:
        """Wait out an injected delay, if one is drawn; True if this send is to be dropped. Callers on a
        hop's path check `active` first: with no faults this is not even awaited."""
        if self.delay and self._rng.random() < self.delay:
            await trio.sleep(self.delay_ms / 1000.0)
        return bool(self.drop) and self._rng.random() < self.drop


NONE = Faults()


def parse_faults(spec: str | None) -> Faults:
    """`drop=P,delay=P,delay_ms=MS,seed=N` (any subset, in any order); empty or None: no faults."""
    if not spec or not spec.strip():
        return NONE
    fields: dict[str, float | int] = {}
    for part in spec.split(","):
        key, sep, raw = part.strip().partition("=")
        if not sep or key not in ("drop", "delay", "delay_ms", "seed"):
            raise FaultSpecError(f"{part.strip()!r}: expected drop=P, delay=P, delay_ms=MS or seed=N")
        try:
            value = int(raw) if key == "seed" else float(raw)
        except ValueError:
            raise FaultSpecError(f"{part.strip()!r}: {raw!r} is not a number") from None
        if key in ("drop", "delay") and not 0.0 <= value <= 1.0:
            raise FaultSpecError(f"{part.strip()!r}: a probability is 0..1")
        if key == "delay_ms" and not 0.0 <= value <= 60_000:
            raise FaultSpecError(f"{part.strip()!r}: 0..60000 ms")
        fields[key] = value
    return Faults(**fields)
