"""Which blocks each stage owns, and which role it plays: a stage's `Shard`, and the pure functions that
make one."""
from __future__ import annotations

import enum

import attrs


class Role(enum.Enum):
    FIRST = "first"    # tokenizer, embedding, first block range; receives prompts and fed-back tokens
    MIDDLE = "middle"  # a block range only
    LAST = "last"      # last block range, final norm, head, sampler, detokenizer


def check_stage(stage: int, num_stages: int) -> None:
    if num_stages < 2:
        raise ValueError(
            f"NUM_STAGES={num_stages}: a pipeline needs at least 2 stages; "
            "for one process use single-process generation: "
            "python -m worker --model ... (worker.reference.generate_full)")
    if not 0 <= stage < num_stages:
        raise ValueError(f"STAGE={stage} is outside 0..{num_stages - 1}")


def check_partition(counts: tuple[int, ...], num_stages: int) -> None:
    """A layer partition names a block count, at least 1, for each of the stages."""
    if len(counts) != num_stages:
        raise ValueError(f"the layer partition {','.join(map(str, counts))} names {len(counts)} stages; "
                         f"the pipeline has {num_stages}")
    if min(counts) < 1:
        raise ValueError(f"the layer partition {','.join(map(str, counts))}: every stage needs at least one block")


AUTO = "auto"  # --layer-partition auto: planned from what each node measures (node/planning.py)


def parse_partition(text: str, num_stages: int) -> tuple[int, ...] | str | None:
    """`auto` (AUTO: planned at boot), `equal` (None: the even split) or each stage's block count, comma-separated
    (vLLM's VLLM_PP_LAYER_PARTITION); ValueError naming what is wrong. The sum is checked against the model later."""
    value = text.strip().lower()
    if value == "equal":
        return None
    if value == AUTO:
        return AUTO
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError("give auto, equal, or each stage's block count, comma-separated (e.g. 8,8,14)")
    counts = tuple(int(p) for p in parts)
    check_partition(counts, num_stages)
    return counts


def role_of(stage: int, num_stages: int) -> Role:
    check_stage(stage, num_stages)
    if stage == 0:
        return Role.FIRST
    return Role.LAST if stage == num_stages - 1 else Role.MIDDLE


def layer_range(total_blocks: int, stage: int, num_stages: int) -> range:
    """Blocks [lo, hi) of `stage`: total // N each, the first total % N stages take one more."""
    check_stage(stage, num_stages)
    if total_blocks < num_stages:
        raise ValueError(f"{total_blocks} blocks cannot be split over {num_stages} stages (each needs at least one)")
    base, extra = divmod(total_blocks, num_stages)
    lo = stage * base + min(stage, extra)
    return range(lo, lo + base + (1 if stage < extra else 0))


@attrs.frozen
class Shard:
    """A stage's place in the chain: stage `index` of `count`, and the model's blocks [lo, hi) it runs.
    Made once at boot from the config (`Shard.of`); `blocks` is None until the model's size is known
    (`sized`), since the weights load after the node listens. Everything else derives from it."""

    index: int
    count: int
    blocks: range | None = None
    total_blocks: int | None = None
    partition: tuple[int, ...] | None = None  # each stage's block count (--layer-partition); None: the even split

    def __attrs_post_init__(self) -> None:
        check_stage(self.index, self.count)
        if self.partition is not None:
            check_partition(self.partition, self.count)

    @classmethod
    def of(cls, index: int, count: int, partition: tuple[int, ...] | None = None) -> Shard:
        return cls(index, count, partition=partition)

    def sized(self, total_blocks: int) -> Shard:
        """This place with its blocks of a model of `total_blocks`: its part of the partition, or the even split
        (layer_range). ValueError where the partition does not sum to the model's blocks."""
        return attrs.evolve(self, blocks=self.range_of(self.index, total_blocks), total_blocks=total_blocks)

    def range_of(self, stage: int, total_blocks: int) -> range:
        """Any stage's blocks of a model of `total_blocks`, split as this shard's chain is."""
        if self.partition is None:
            return layer_range(total_blocks, stage, self.count)
        if sum(self.partition) != total_blocks:
            raise ValueError(f"the layer partition {','.join(map(str, self.partition))} gives "
                             f"{sum(self.partition)} blocks; the model has {total_blocks}")
        lo = sum(self.partition[:stage])
        return range(lo, lo + self.partition[stage])

    @property
    def role(self) -> Role:
        return role_of(self.index, self.count)

    @property
    def first(self) -> bool:
        """Tokenizes, embeds and takes prompts: the entry."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """Runs the final norm and head and samples: the exit."""
        return self.index == self.count - 1

    @property
    def embeds(self) -> bool:
        return self.first

    @property
    def has_head(self) -> bool:
        return self.last

    def __str__(self) -> str:
        blocks = "" if self.blocks is None else f", blocks {self.blocks.start}..{self.blocks.stop - 1}"
        return f"stage {self.index} of {self.count} ({self.role.value}{blocks})"
