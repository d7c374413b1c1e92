"""The prefix cache's matching (roles/prefix.py): hash-chained blocks, the longest shared prefix short of
the prompt's last token, recency among equals, and eviction that never takes an entry in use."""
import pytest

from roles.prefix import NO_MATCH, Match, PrefixIndex, Start, block_keys, plan_start

B = 4  # tokens a block


def ids(*blocks: str) -> list[int]:
    """Token ids spelled block by block: "a" is four tokens of 97."""
    return [ord(c) for block in blocks for c in block * B]


def test_a_block_key_names_the_whole_prefix_not_only_its_own_tokens():
    one, two = block_keys(ids("a", "b"), B), block_keys(ids("c", "b"), B)
    assert len(one) == len(two) == 2 and one[1] != two[1]  # the same second block after another first
    assert block_keys(ids("a", "b"), B)[:1] == block_keys(ids("a"), B)
    assert block_keys(ids("a")[:B - 1], B) == []  # a partial block has no key


@pytest.mark.parametrize("cached, prompt, want", [
    ([("x", ids("a", "b", "c"))], ids("a", "b", "c", "d"), Match("x", 3 * B)),
    ([("x", ids("a", "b", "c"))], ids("a", "b", "e"), Match("x", 2 * B)),
    ([("x", ids("a", "b", "c"))], ids("b", "c"), NO_MATCH),  # a block later in the prompt does not count
    ([("x", ids("a", "b"))], ids("a", "b"), Match("x", B)),  # never the whole prompt: its last token is computed
    ([("x", ids("a", "b"))], ids("a", "b") + [1], Match("x", 2 * B)),
    ([("x", ids("a")), ("y", ids("a", "b"))], ids("a", "b", "c"), Match("y", 2 * B)),  # the longest
    ([("x", ids("a", "b")), ("y", ids("a", "c"))], ids("a", "d"), Match("y", B)),  # among equals, the latest
    ([], ids("a"), NO_MATCH),
])
def test_a_prompt_starts_from_the_entry_sharing_the_most_whole_blocks(cached, prompt, want):
    index = PrefixIndex(B)
    for name, tokens in cached:
        index.add(name, tokens)
    assert index.match(prompt) == want


def test_a_match_makes_its_entry_the_most_recent_and_eviction_takes_the_least_recent_unheld():
    index = PrefixIndex(B)
    for name, block in (("x", "a"), ("y", "b"), ("z", "c")):
        index.add(name, ids(block, "q"))
    assert index.evictable() == "x"
    index.match(ids("a", "q", "r"))
    assert index.evictable() == "y"
    index.hold("y")
    assert index.evictable() == "z"
    index.hold("z")
    index.hold("x")
    assert index.evictable() is None
    index.release("y")
    assert index.evictable() == "y"


def test_a_removed_entry_matches_nothing_and_re_adding_replaces_its_blocks():
    index = PrefixIndex(B)
    index.add("x", ids("a", "b"))
    index.remove("x")
    assert index.match(ids("a", "b", "c")) == NO_MATCH and len(index) == 0
    index.add("x", ids("a", "b"))
    index.add("x", ids("c", "d"))
    assert index.match(ids("a", "b", "c")) == NO_MATCH and index.match(ids("c", "d", "e")) == Match("x", 2 * B)
    index.remove("nobody")  # a no-op


def test_a_block_size_below_one_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2], 0)


def test_a_salted_prompt_matches_only_entries_of_the_same_salt():
    index = PrefixIndex(B)
    index.add("plain", ids("a", "b"))
    index.add("salted", ids("a", "b"), salt="tenant-1")
    assert index.match(ids("a", "b", "c")) == Match("plain", 2 * B)
    assert index.match(ids("a", "b", "c"), salt="tenant-1") == Match("salted", 2 * B)
    assert index.match(ids("a", "b", "c"), salt="tenant-2") == NO_MATCH


def index_of(entries, held=()):
    index = PrefixIndex(B)
    for name, tokens in entries:
        index.add(name, tokens)
    for name in held:
        index.hold(name)
    return index


@pytest.mark.parametrize("entries, held, prompt, free, want", [
    # the next turn of a chat covers its entry whole: it takes the slot, no copy
    ([("x", ids("a", "b"))], (), ids("a", "b", "c"), 2, Start(Match("x", 2 * B), take=True)),
    # a shared prefix only: copied into a free slot, so the entry stays for the next request
    ([("x", ids("a", "b", "c"))], (), ids("a", "b", "d"), 1, Start(Match("x", 2 * B))),
    # ... unless no slot is free: then it is taken
    ([("x", ids("a", "b", "c"))], (), ids("a", "b", "d"), 0, Start(Match("x", 2 * B), take=True)),
    # an entry others copy from is never taken: with a slot free it is copied
    ([("x", ids("a", "b"))], ("x",), ids("a", "b", "c"), 1, Start(Match("x", 2 * B))),
    # ... and with none free, the least recently used other entry makes room
    ([("y", ids("e")), ("z", ids("f")), ("x", ids("a", "b"))], ("x",), ids("a", "b", "c"), 0,
     Start(Match("x", 2 * B), drop=("y",))),
    # ... or, where every other entry is held too, the request waits
    ([("y", ids("e")), ("x", ids("a", "b"))], ("x", "y"), ids("a", "b", "c"), 0, None),
    # no match: a free slot, else the least recently used entry no request holds is evicted
    ([("y", ids("e"))], (), ids("a", "b"), 1, Start()),
    ([("y", ids("e")), ("z", ids("f"))], ("y",), ids("a", "b"), 0, Start(drop=("z",))),
    ([], (), ids("a", "b"), 0, None),
])
def test_plan_start_takes_copies_evicts_or_waits(entries, held, prompt, free, want):
    assert plan_start(index_of(entries, held), prompt, free_slots=free) == want


def test_with_the_cache_off_for_a_request_nothing_matches_but_entries_still_make_room():
    index = index_of([("x", ids("a", "b"))])
    assert plan_start(index, ids("a", "b", "c"), free_slots=1, use_cache=False) == Start()
    assert plan_start(index, ids("a", "b", "c"), free_slots=0, use_cache=False) == Start(drop=("x",))
