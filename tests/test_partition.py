import pytest

from worker.partition import Role, Shard, layer_range, parse_partition, role_of


@pytest.mark.parametrize("num_stages", range(2, 9))
@pytest.mark.parametrize("total", range(1, 41))
def test_every_block_is_owned_exactly_once_and_sizes_differ_by_at_most_one(total, num_stages):
    if total < num_stages:
        with pytest.raises(ValueError, match="cannot be split"):
            layer_range(total, 0, num_stages)
        return
    ranges = [layer_range(total, s, num_stages) for s in range(num_stages)]
    assert [b for r in ranges for b in r] == list(range(total))  # contiguous, in stage order
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) == total // num_stages


@pytest.mark.parametrize("total,num_stages,expected", [
    (16, 5, [(0, 4), (4, 7), (7, 10), (10, 13), (13, 16)]),  # llama3.2:1b: the last stage, which runs the head, gets fewer
    (16, 2, [(0, 8), (8, 16)]),
    (8, 8, [(i, i + 1) for i in range(8)]),
    (10, 3, [(0, 4), (4, 7), (7, 10)]),
])
def test_blocks_split_as_evenly_as_they_can_the_first_stages_taking_what_is_left_over(total, num_stages, expected):
    assert [(r.start, r.stop) for r in (layer_range(total, s, num_stages) for s in range(num_stages))] == expected


@pytest.mark.parametrize("stage,num_stages,role", [
    (0, 2, Role.FIRST), (1, 2, Role.LAST),
    (0, 5, Role.FIRST), (1, 5, Role.MIDDLE), (3, 5, Role.MIDDLE), (4, 5, Role.LAST),
])
def test_role_of_each_stage(stage, num_stages, role):
    assert role_of(stage, num_stages) is role


def test_one_stage_is_refused_with_a_pointer_to_single_process_generation():
    with pytest.raises(ValueError, match="at least 2 stages.*generate_full"):
        role_of(0, 1)


@pytest.mark.parametrize("stage", [-1, 5])
def test_stage_outside_the_pipeline_is_refused(stage):
    with pytest.raises(ValueError, match="outside 0..4"):
        layer_range(16, stage, 5)


@pytest.mark.parametrize("index,count,role,first,last", [
    (0, 2, Role.FIRST, True, False), (1, 2, Role.LAST, False, True),
    (0, 5, Role.FIRST, True, False), (2, 5, Role.MIDDLE, False, False), (4, 5, Role.LAST, False, True),
])
def test_a_shard_knows_its_role_from_its_place(index, count, role, first, last):
    shard = Shard.of(index, count)
    assert (shard.role, shard.first, shard.last, shard.embeds, shard.has_head) == (role, first, last, first, last)
    assert shard.blocks is None


def test_a_shard_sized_for_a_model_takes_the_even_split():
    shards = [Shard.of(i, 5).sized(30) for i in range(5)]
    assert [s.blocks for s in shards] == [layer_range(30, i, 5) for i in range(5)]
    assert all(s.total_blocks == 30 for s in shards)


@pytest.mark.parametrize("index,count", [(0, 1), (3, 3), (-1, 2)])
def test_a_shard_outside_the_chain_is_refused(index, count):
    with pytest.raises(ValueError):
        Shard.of(index, count)


# --- an explicit layer partition (--layer-partition, PP_LAYER_PARTITION) -----------------------------------

@pytest.mark.parametrize("text, n, counts", [
    ("equal", 3, None), (" EQUAL ", 2, None), ("auto", 2, "auto"), (" Auto", 3, "auto"), ("4,20,6", 3, (4, 20, 6)),
    ("1, 29", 2, (1, 29)),
])
def test_a_layer_partition_is_auto_equal_or_each_stage_s_block_count(text, n, counts):
    assert parse_partition(text, n) == counts


@pytest.mark.parametrize("text, n, says", [
    ("4,20", 3, "names 2 stages; the pipeline has 3"), ("0,30", 2, "every stage needs at least one block"),
    ("4,x,6", 3, "give auto, equal, or each stage's block count"), ("", 2, "give auto, equal"), ("-1,31", 2, "give auto, equal"),
])
def test_a_bad_layer_partition_is_refused_naming_what_is_wrong(text, n, says):
    with pytest.raises(ValueError, match=says):
        parse_partition(text, n)


def test_a_shard_takes_its_part_of_an_explicit_partition_and_every_stage_s_range_is_known():
    shards = [Shard.of(i, 3, (4, 20, 6)).sized(30) for i in range(3)]
    assert [s.blocks for s in shards] == [range(0, 4), range(4, 24), range(24, 30)]
    assert [shards[0].range_of(i, 30) for i in range(3)] == [s.blocks for s in shards]
    with pytest.raises(ValueError, match="gives 30 blocks; the model has 16"):
        Shard.of(0, 3, (4, 20, 6)).sized(16)
