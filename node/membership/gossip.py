"""What members gossip: member records, the messages that carry them, and the protocol's knobs.

Plain attrs values only, so one cattrs converter can (un)structure them at the HTTP edge; what a view makes of
them is node.membership.rules. A message's size is bounded here, by its type: see "Bounds" in rules.
"""
from __future__ import annotations

import enum
import re

import attrs

from node.config.cores import MACHINE_ID
from worker.plan import Calibration


class State(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


TERMINAL = frozenset({State.DEAD, State.LEFT})


class Heard(enum.Enum):
    """Where an update was heard, which decides what it may do (see the top of node.membership.rules)."""
    OWN = "own"  # this view's own failure detector: a probe failed, a suspicion ran out
    ANSWER = "answer"  # an ack, nack or sync reply from an address we chose: a member's, as we hold it, or a seed
    REQUEST = "request"  # a ping, ping-req or sync push to this member: anyone holding the token can send one


def _plan_counts(counts: tuple[int, ...]) -> None:
    """A gossiped split: at most MAX_MEMBERS stages of at least one block each."""
    if len(counts) > MAX_MEMBERS or any(type(k) is not int or k < 1 for k in counts):
        raise ValueError(f"Meta.plan={counts!r}: expected at most {MAX_MEMBERS} block counts, each >= 1")


def _machine(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    """A gossiped machine id (node.config.cores.machine_id, or --machine-id): 1-64 letters, digits, . _ -."""
    if value is not None and (type(value) is not str or not MACHINE_ID.fullmatch(value)):
        raise ValueError(f"Meta.machine={value!r}: expected 1-64 letters, digits, '.', '_' or '-'")


def _positions(instance, attribute, value) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"Meta.kv_positions={value!r}: expected a whole number of positions, at least 1")


_KERNELS = re.compile(r"[A-Za-z0-9./_+() -]{1,80}")  # c/ and a 64-character CPU name at most


def _kernels(instance, attribute, value) -> None:
    """What a ready stage computes with (worker.contract.Kernels.label): short printable text."""
    if value is not None and (type(value) is not str or not _KERNELS.fullmatch(value)):
        raise ValueError(f"Meta.kernels={value!r}: expected 1-80 letters, digits, spaces or . / _ + ( ) -")


@attrs.frozen
class Meta:
    stage: int | None = None
    names: tuple[str, ...] = ()  # registry names, e.g. "pp-stage-0", "pp-entry"
    ready: bool = False
    # Nobody can open a connection to an observer (a runner behind NAT): it is never probed or suspected by
    # others and is left out of alive counts, but it probes others and learns the view from their answers.
    observer: bool = False
    progress: float | None = None  # weight download progress, 0..1
    max_seqs: int | None = None  # sequence slots of a ready stage: stage 0 admits no more than the chain's least
    settled: tuple[str, ...] = ()  # stage 0: its chain's member ids once no request waits for a replay (FirstActor)
    cost: Calibration | None = None  # what this node measured of itself before it was given blocks (issue 37)
    plan: tuple[int, ...] = attrs.field(default=(), validator=lambda i, a, v: _plan_counts(v))  # each stage's blocks
    machine: str | None = attrs.field(default=None, validator=_machine)  # whose cores it computes on (planning)
    # KV positions a ready stage may hold (--kv-cache-memory): stage 0 admits by the chain's least (roles/kv_budget.py)
    kv_positions: int | None = attrs.field(default=None, validator=_positions)
    kernels: str | None = attrs.field(default=None, validator=_kernels)  # a ready stage's, e.g. c/native (issue 53)


@attrs.frozen
class Member:
    id: str  # key members by id: vast.ai reuses IPs and hands out random host ports
    addr: str  # advertised base URL
    incarnation: int  # start at boot epoch-ms so it grows across restarts
    state: State = State.ALIVE
    meta: Meta = attrs.field(factory=Meta)


# Caps. A real view holds N stages, the runner and the replacements seen so far: a few dozen at most. The caps
# sit far above that and bound what a token holder can make a member hold or do per message (see "Bounds").
MAX_MEMBERS = 256  # records in one view
MAX_ENTRIES = MAX_MEMBERS  # records in one message: a sync carries a whole view


def _at_most_max_entries(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    """Refuse an oversized message whole, before any of its records is looked at."""
    if len(value) > MAX_ENTRIES:
        raise ValueError(f"{type(instance).__name__}.{attribute.name}: {len(value)} members, over the limit of "
                         f"{MAX_ENTRIES} that one gossip message may carry")


def _entries():  # a message's records: none by default, at most MAX_ENTRIES
    return attrs.field(default=(), validator=_at_most_max_entries)


# Wire messages. Plain fields only, so one cattrs converter can (un)structure them at the HTTP edge.

@attrs.frozen
class Ping:
    sender: Member  # the sender's own record: a ping doubles as its alive announcement
    target_id: str
    seq: int
    updates: tuple[Member, ...] = _entries()


@attrs.frozen
class Ack:
    sender_id: str
    seq: int
    updates: tuple[Member, ...] = _entries()


@attrs.frozen
class PingReq:
    sender: Member
    target_id: str
    target_addr: str  # where the prober holds the target: a relay dials the address its own view holds, never this
    seq: int
    updates: tuple[Member, ...] = _entries()


@attrs.frozen
class Nack:
    """A relay's answer to a PingReq when the target did not ack within the relay's probe timeout."""
    sender_id: str
    seq: int
    updates: tuple[Member, ...] = _entries()


@attrs.frozen
class Sync:
    members: tuple[Member, ...] = attrs.field(validator=_at_most_max_entries)  # push/pull: the full view, both ways


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"SwimConfig.{attribute.name}={value!r} must be > 0")


@attrs.frozen
class SwimConfig:
    """Timing and fan-out knobs.

    Defaults are memberlist's LAN profile, not its WAN one (5 s period, 3 s timeout, mult 6), although the
    boxes talk over the internet: a runner must notice a dead stage within seconds, and with n <= 10 the
    worst case here is about (n-1)+1+4+3 = 17 s against a minute on WAN settings. A 0.5 s probe timeout
    covers an intercontinental round trip on a kept-alive HTTP connection (the transport must reuse
    connections: a cold TLS handshake alone can take that long). A slow box is not declared dead by one
    missed probe: the direct ping keeps running until the period ends while k relays try too, and then it
    has suspicion_mult periods to refute.
    """
    protocol_period_s: float = attrs.field(default=1.0, validator=_positive)
    probe_timeout_s: float = attrs.field(default=0.5, validator=_positive)
    indirect_checks: int = 3
    suspicion_mult: int = attrs.field(default=4, validator=_positive)
    # Lifeguard's dogpile stretches a lone accusation to this multiple and shrinks it with confirmations.
    # Off (1) by default: updates carry no accuser, so the driver cannot count distinct confirmations.
    suspicion_max_timeout_mult: int = attrs.field(default=1, validator=_positive)
    retransmit_mult: int = attrs.field(default=4, validator=_positive)
    sync_interval_s: float = attrs.field(default=30.0, validator=_positive)
    sync_timeout_s: float = attrs.field(default=2.0, validator=_positive)
    max_piggyback: int = attrs.field(default=16, validator=_positive)  # HTTP bodies have no UDP size limit
    join_backoff_s: float = attrs.field(default=0.5, validator=_positive)
    join_backoff_max_s: float = attrs.field(default=8.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.probe_timeout_s >= self.protocol_period_s:
            raise ValueError(f"SwimConfig: probe_timeout_s={self.probe_timeout_s} must be shorter than "
                             f"protocol_period_s={self.protocol_period_s}, or indirect probes get no time")
        if self.indirect_checks < 0:
            raise ValueError(f"SwimConfig.indirect_checks={self.indirect_checks} must be >= 0")
        if self.max_piggyback >= MAX_ENTRIES:  # plus the buddy record (swim_state.updates_for)
            raise ValueError(f"SwimConfig.max_piggyback={self.max_piggyback} must be below MAX_ENTRIES={MAX_ENTRIES}")
