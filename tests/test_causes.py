"""commgate.judge.causes: each pattern it names is proved by the numbers, and nothing else is named."""

from __future__ import annotations

import random

import pytest
from commgate.judge.causes import CallKey, Cause, recognise
from commgate.judge.finding import Difference, Finding

G = (0, 1)


def key(nbytes: int, *, op: str = "all_reduce", dtype: str = "fp32", phase: str = "backward", group=G) -> CallKey:
    return ("steps", op, group, dtype, nbytes, phase)


def patterns(causes: tuple[Cause, ...]) -> list[str]:
    return [c.pattern for c in causes]


def test_one_bucket_cut_in_two_is_a_bucket_split_with_its_sizes() -> None:
    expected = {key(1061888): 4, key(2000): 4}
    obtained = {key(528384): 4, key(533504): 4, key(2000): 4}
    (cause,) = recognise(obtained, expected, steps=2)
    assert cause.pattern == "bucket split"
    assert cause.text == (
        "all_reduce fp32 1,061,888 B (backward, group [0, 1]) became 2 calls of 528,384 B and 533,504 B: a bucket split"
    )
    assert set(cause.keys) == {key(1061888), key(528384), key(533504)}


def test_the_reverse_is_a_bucket_merge() -> None:
    (cause,) = recognise({key(1061888): 4}, {key(528384): 4, key(533504): 4})
    assert cause.pattern == "bucket merge"
    assert "528,384 B and 533,504 B" in cause.text and "became one call of 1,061,888 B" in cause.text


def test_buckets_cut_anew_are_a_bucket_re_cut() -> None:
    """DDP's 2 buckets became 6 at a smaller ``bucket_cap_mb``, two of them of one size (4 calls on that key):
    no one key's parts, so no split or merge, and it was named only as 2 keys removed and 5 added (found by
    an adversarial pass). The gone and new keys of one op, group, dtype and phase carry the same bytes: a re-cut."""
    expected = {key(695296): 2, key(1061888): 2, key(8, op="broadcast", dtype="int32", phase="forward"): 2}
    new = {key(262144): 2, key(266240): 4, key(266496): 2, key(267008): 2, key(429056): 2}
    obtained = new | {key(24, op="broadcast", dtype="int32", phase="forward"): 2}
    recut, resized = recognise(obtained, expected)
    assert (recut.pattern, resized.pattern) == ("bucket re-cut", "size change")
    assert recut.text == (
        "all_reduce fp32 (backward, group [0, 1]): 2 calls of 695,296 B, 1,061,888 B became 6 calls of 262,144 B, "
        "266,240 B (x2), 266,496 B, 267,008 B, 429,056 B, 1,757,184 B either way: a bucket re-cut"
    )
    assert set(recut.keys) == {key(695296), key(1061888), *new}
    lost = dict(obtained) | {key(429056): 1}  # a byte count that differs: no re-cut, the keys named one by one
    assert "bucket re-cut" not in patterns(recognise(lost, expected))


def test_sizes_that_do_not_sum_are_not_a_split() -> None:
    """1,000 B gone, 400 B and 500 B new: 100 B are missing, so it is no split; what is gone and what is new
    are named by the numbers' own rule (a key on one side), never 'bucket split'."""
    causes = recognise({key(400): 4, key(500): 4}, {key(1000): 4})
    assert "bucket split" not in patterns(causes) and "bucket merge" not in patterns(causes)
    assert sorted(patterns(causes)) == ["added", "added", "removed"]


def test_parts_called_a_different_number_of_times_are_not_a_split() -> None:
    causes = recognise({key(400): 4, key(600): 2}, {key(1000): 4})
    assert "bucket split" not in patterns(causes)


def test_parts_of_another_op_or_group_are_not_a_split() -> None:
    causes = recognise({key(400): 4, key(600, op="all_gather"): 4}, {key(1000): 4})
    assert "bucket split" not in patterns(causes)
    causes = recognise({key(400): 4, key(600, group=(0, 2)): 4}, {key(1000): 4})
    assert "bucket split" not in patterns(causes)


def test_a_dtype_change_keeps_the_elements() -> None:
    (cause,) = recognise({key(2000, dtype="bf16"): 4}, {key(4000): 4})
    assert cause.pattern == "dtype change"
    assert cause.text == (
        "all_reduce fp32 4,000 B (backward, group [0, 1]) became bf16 2,000 B (1,000 elements either way): "
        "a dtype change"
    )


def test_another_dtype_with_other_elements_is_not_a_dtype_change() -> None:
    causes = recognise({key(3000, dtype="bf16"): 4}, {key(4000): 4})
    assert "dtype change" not in patterns(causes)


def test_a_call_moved_between_phases() -> None:
    (cause,) = recognise({key(64, phase="optimizer"): 2}, {key(64, phase="backward"): 2})
    assert cause.pattern == "phase move"
    assert "moved from the backward phase to the optimizer phase: a call moved between phases" in cause.text


def test_a_group_changed() -> None:
    (cause,) = recognise({key(64, group=(0, 2)): 2}, {key(64): 2})
    assert cause.pattern == "group change"
    assert cause.text.endswith("now runs on group [0, 2]: a group changed")


def test_a_collective_added_per_step_and_one_removed() -> None:
    added = recognise({key(4, phase="forward"): 4}, {}, steps=2)
    assert patterns(added) == ["added"]
    assert added[0].text == "all_reduce fp32 4 B (forward, group [0, 1]): 2 call(s) per step (all ranks) added"
    removed = recognise({}, {("init", "broadcast", G, "fp32", 64, "init"): 2})
    assert patterns(removed) == ["removed"]
    assert "at initialisation): 2 call(s) (all ranks) removed" in removed[0].text


def test_a_count_that_changed_on_a_key_both_sides_have_is_named_by_no_rule() -> None:
    assert recognise({key(64): 6}, {key(64): 4}) == ()


def test_a_size_change_is_tried_after_the_buckets() -> None:
    """DDP's broadcast of its bucket sizes grows by 4 B per bucket; the bucket all-reduce's parts are not
    taken for a size change of the whole."""
    expected = {key(1000): 4, key(8, op="broadcast", dtype="int32", phase="forward"): 2}
    obtained = {key(400): 4, key(600): 4, key(12, op="broadcast", dtype="int32", phase="forward"): 2}
    assert sorted(patterns(recognise(obtained, expected))) == ["bucket split", "size change"]


@pytest.mark.parametrize("seed", range(20))
def test_any_partition_of_buckets_is_recognised_as_splits(seed: int) -> None:
    """Seeded: 1-3 buckets, each cut into 2-4 parts of random (distinct) sizes; each bucket is one split."""
    rng = random.Random(seed)
    expected: dict[CallKey, int] = {}
    obtained: dict[CallKey, int] = {}
    used: set[int] = set()
    buckets = rng.randint(1, 3)
    for _ in range(buckets):
        parts = []
        while len(parts) < rng.randint(2, 4):
            size = rng.randrange(4, 400_000, 4)
            if size not in used:
                used.add(size)
                parts.append(size)
        whole = sum(parts)
        if whole in used:
            continue
        used.add(whole)
        n = rng.choice((2, 4, 6))
        expected[key(whole)] = n
        obtained |= {key(p): n for p in parts}
    causes = recognise(obtained, expected)
    assert patterns(causes).count("bucket split") >= 1
    claimed = {k for c in causes for k in c.keys}
    assert claimed == set(expected) | set(obtained)


def test_a_finding_says_its_causes_first_then_its_numbers() -> None:
    causes = recognise({key(528384): 4, key(533504): 4}, {key(1061888): 4})
    diffs = (Difference("calls 1061888 B", 0, 4), Difference("calls 528384 B", 4, 0))
    f = Finding(kind="baseline", fail=True, title="differs", causes=causes, differences=diffs, notes=("note",))
    lines = f.text().splitlines()
    assert lines[1].endswith("a bucket split") and lines[2].startswith("    calls 1061888 B: obtained 0")
    doc = f.to_json()
    assert doc["causes"] == [{"pattern": "bucket split", "text": causes[0].text}]
    assert doc["notes"] == ["note"] and len(doc["lines"]) == 4


def test_a_size_change_needs_one_key_gone_and_one_new() -> None:
    """With two new sizes where one went, which became which is not proved: no size change is named."""
    causes = recognise({key(400): 4, key(700): 4}, {key(1000): 4})
    assert "size change" not in patterns(causes)


def test_the_console_bounds_causes_and_numbers_apart() -> None:
    """Twelve lines of each at most: the causes never push the numbers out, nor the numbers the causes."""
    added = recognise({key(4 * i, phase="forward"): 2 for i in range(1, 15)}, {})
    diffs = tuple(Difference(f"calls {i}", 2, 0) for i in range(14))
    lines = Finding(kind="baseline", fail=True, title="t", causes=added, differences=diffs).text().splitlines()
    assert len(lines) == 1 + 13 + 13
    assert lines[12].endswith("added") and lines[13] == "    ... and 2 more (report.json has them all)"
    assert lines[14] == "    calls 0: obtained 2, expected 0 (+2)" and lines[-1].endswith(
        "2 more (report.json has them all)"
    )
