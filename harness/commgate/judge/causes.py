"""What a difference in call counts means, in words: the patterns that can be proved from the numbers.

``recognise(obtained, expected)`` takes the calls of one comparison (the run against the model, the run
against its baseline, after against before) per call key (window, op, group, dtype, bytes per call, phase)
and names each pattern its differing keys prove, one ``Cause`` each:

* a **bucket split**: one key's calls gone, two or more new keys of the same window, op, group, dtype and
  phase, each with as many calls, whose sizes sum to it (DDP's bucket cut in two); a **bucket merge** is
  the reverse;
* a **bucket re-cut**: of a window, op, group, dtype and phase, every gone key and every new key that no
  split or merge claimed, their calls carrying the same bytes in all: the same gradients cut into other
  buckets (DDP's 2 buckets become 6 at a smaller ``bucket_cap_mb``, two of them of one size);
* a **dtype change**: the same window, op, group, phase and count, the dtype differs and the bytes per call
  scale by the dtype sizes' ratio (the same number of elements);
* a **phase move**: the same window, op, group, dtype and size, the calls moved from one phase to another;
* a **group change**: the same window, op, dtype, size and phase, on another process group;
* a **size change**: the only gone and the only new key of a window, op, group, dtype and phase, with the
  same count: one call of another size (DDP's broadcast of its bucket sizes, 4 B per bucket), tried after
  the buckets so that a part of a split is never taken for it;
* a collective **added** or **removed**: a key only on one side, that no rule above explains.

Each rule claims only the keys it proves, and a key once claimed is not claimed again; what no rule explains
(a count that changed on a key present on both sides, sizes that do not sum) is named by no cause and stays
in the finding's numbers. Pure and torch-free.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from commgate.model.layout import group_text

CallKey = tuple[str, str, tuple[int, ...], str, int, str]
"""(window, op, group, dtype, bytes per call, phase), as the baseline and the reconciliation key calls."""

Pattern = Literal[
    "bucket split",
    "bucket merge",
    "bucket re-cut",
    "dtype change",
    "phase move",
    "group change",
    "size change",
    "added",
    "removed",
]

ITEMSIZE: dict[str, int] = {
    "fp64": 8,
    "fp32": 4,
    "fp16": 2,
    "bf16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Bytes per element of the dtypes a capture names (a dtype not here is never called a dtype change)."""

MAX_PARTS = 16
"""The most new keys a split (or merge) is searched among (their subsets: 2^16 at most)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cause:
    """One pattern proved from the numbers: which, the line that says it, and the call keys it explains."""

    pattern: Pattern
    text: str
    keys: tuple[CallKey, ...]

    def to_json(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "text": self.text}


def call_text(key: CallKey) -> str:
    """A call key for people: ``all_reduce fp32 1,061,888 B (backward, group [0, 1])``."""
    window, op, group, dtype, nbytes, phase = key
    where = f"{phase}, group {group_text(group)}" + (", at initialisation" if window == "init" else "")
    return f"{op} {dtype} {nbytes:,} B ({where})"


def _calls(n: int, window: str, steps: int | None) -> str:
    """A count of calls over all ranks: per measured step where the steps are known."""
    if window == "steps" and steps:
        per = Fraction(n, steps)
        return f"{per.numerator if per.denominator == 1 else float(per):g} call(s) per step (all ranks)"
    return f"{n} call(s) (all ranks)"


def _same_but(a: CallKey, b: CallKey, *fields: int) -> bool:
    """Whether ``a`` and ``b`` agree on every field but ``fields`` (indices of ``CallKey``)."""
    return all(a[i] == b[i] for i in range(6) if i not in fields)


Rule = Callable[[CallKey, CallKey], str | None]
"""A one-to-one rule: a gone key and a new one with the same count -> what it says, or None."""


def _phase(gone: CallKey, new: CallKey) -> str | None:
    if not (_same_but(gone, new, 5) and gone[5] != new[5]):
        return None
    return f"{call_text(gone)} moved from the {gone[5]} phase to the {new[5]} phase"


def _group(gone: CallKey, new: CallKey) -> str | None:
    if not (_same_but(gone, new, 2) and gone[2] != new[2]):
        return None
    return f"{call_text(gone)} now runs on group {group_text(new[2])}"


def _dtype(gone: CallKey, new: CallKey) -> str | None:
    a, b = ITEMSIZE.get(gone[3]), ITEMSIZE.get(new[3])
    if not (_same_but(gone, new, 3, 4) and gone[3] != new[3] and a and b):
        return None
    if gone[4] * b != new[4] * a:  # not the same number of elements
        return None
    return f"{call_text(gone)} became {new[3]} {new[4]:,} B ({gone[4] // a:,} elements either way)"


ONE_TO_ONE: tuple[tuple[Pattern, Rule, str], ...] = (
    ("phase move", _phase, "a call moved between phases"),
    ("group change", _group, "a group changed"),
    ("dtype change", _dtype, "a dtype change"),
)
"""Each one-to-one rule tried before the buckets: its pattern, its test, and the words that end its line."""


def _resized(gone: dict[CallKey, int], new: dict[CallKey, int]) -> Iterator[Cause]:
    """A gone key and a new one alone in their window, op, group, dtype and phase, with the same count: one
    call of another size (with more keys there, which became which is not proved); claimed keys removed."""
    for g in sorted(gone):
        mates = [k for k in new if _same_but(g, k, 4)]
        if len(mates) != 1 or sum(_same_but(g, k, 4) for k in gone) != 1 or new[mates[0]] != gone[g]:
            continue
        (k,) = mates
        del gone[g], new[k]
        yield Cause(
            pattern="size change", text=f"{call_text(g)} became {k[4]:,} B per call: a size change", keys=(g, k)
        )


def _partition(whole: CallKey, n: int, parts: dict[CallKey, int]) -> tuple[CallKey, ...] | None:
    """Two or more of ``parts`` (keys of ``whole``'s window, op, group, dtype and phase with ``n`` calls
    each) whose sizes sum to ``whole``'s, the fewest first; None when no such subset exists."""
    candidates = sorted(k for k, m in parts.items() if m == n and _same_but(whole, k, 4))[:MAX_PARTS]
    for size in range(2, len(candidates) + 1):
        for subset in itertools.combinations(candidates, size):
            if sum(k[4] for k in subset) == whole[4]:
                return subset
    return None


def _sizes(keys: tuple[CallKey, ...]) -> str:
    sizes = [f"{k[4]:,} B" for k in sorted(keys, key=lambda k: k[4])]
    return ", ".join(sizes[:-1]) + f" and {sizes[-1]}"


def _buckets(gone: dict[CallKey, int], new: dict[CallKey, int]) -> Iterator[Cause]:
    """Splits (one gone key into new ones), then merges (gone keys into one new one); claimed keys removed."""
    ways: tuple[tuple[Pattern, dict[CallKey, int], dict[CallKey, int]], ...] = (
        ("bucket split", gone, new),
        ("bucket merge", new, gone),
    )
    for pattern, wholes, parts in ways:
        for whole in sorted(wholes):
            n = wholes[whole]
            found = _partition(whole, n, parts)
            if found is None:
                continue
            del wholes[whole]
            for k in found:
                del parts[k]
            if pattern == "bucket split":
                text = f"{call_text(whole)} became {len(found)} calls of {_sizes(found)}: a bucket split"
            else:
                head = f"{found[0][1]} {found[0][3]} {_sizes(found)}"
                text = f"{head} ({found[0][5]}, group {group_text(whole[2])}) became one call of {whole[4]:,} B"
                text += ": a bucket merge"
            yield Cause(pattern=pattern, text=text, keys=(whole, *found))


def _recut(gone: dict[CallKey, int], new: dict[CallKey, int]) -> Iterator[Cause]:
    """Every gone and every new key of a window, op, group, dtype and phase (after splits and merges), whose
    calls carry the same bytes in all: the buckets cut anew; claimed keys removed."""
    for g in sorted(gone):
        if g not in gone:
            continue
        was = {k: gone[k] for k in gone if _same_but(g, k, 4)}
        now = {k: new[k] for k in new if _same_but(g, k, 4)}
        if not now or sum(k[4] * n for k, n in was.items()) != sum(k[4] * n for k, n in now.items()):
            continue
        for k in was:
            del gone[k]
        for k in now:
            del new[k]
        unit = math.gcd(*was.values(), *now.values())  # the calls of one pass over the buckets
        head = f"{g[1]} {g[3]} ({g[5]}, group {group_text(g[2])}{', at initialisation' if g[0] == 'init' else ''})"
        text = (
            f"{head}: {_cut(was, unit)} became {_cut(now, unit)}, {sum(k[4] * n for k, n in now.items()) // unit:,} B "
            "either way: a bucket re-cut"
        )
        yield Cause(pattern="bucket re-cut", text=text, keys=(*sorted(was), *sorted(now)))


def _cut(keys: dict[CallKey, int], unit: int) -> str:
    """``keys``' calls per ``unit``: ``3 calls of 262,144 B, 266,240 B (x2)``."""
    sizes = [f"{k[4]:,} B" + (f" (x{n // unit})" if n != unit else "") for k, n in sorted(keys.items())]
    calls = sum(keys.values()) // unit
    return f"{calls} call{'s' if calls != 1 else ''} of {', '.join(sizes)}"


def _one_to_one(gone: dict[CallKey, int], new: dict[CallKey, int]) -> Iterator[Cause]:
    """Pairs of a gone key and a new one with the same count that a one-to-one rule explains; claimed keys
    removed."""
    for pattern, rule, words in ONE_TO_ONE:
        for g in sorted(gone):
            for k in sorted(new):
                if g in gone and k in new and gone[g] == new[k] and (text := rule(g, k)):
                    del gone[g], new[k]
                    yield Cause(pattern=pattern, text=f"{text}: {words}", keys=(g, k))


def recognise(
    obtained: Mapping[CallKey, int], expected: Mapping[CallKey, int], *, steps: int | None = None
) -> tuple[Cause, ...]:
    """The causes the differing keys of one comparison prove, in the order of the rules; ``steps`` (the
    measured steps, where known) says an added or removed collective's calls per step."""
    gone = {k: n for k in expected if (n := expected[k]) and not obtained.get(k)}
    new = {k: n for k in obtained if (n := obtained[k]) and not expected.get(k)}
    out = [*_one_to_one(gone, new), *_buckets(gone, new), *_recut(gone, new), *_resized(gone, new)]
    for k in sorted(gone):
        out.append(Cause(pattern="removed", text=f"{call_text(k)}: {_calls(gone[k], k[0], steps)} removed", keys=(k,)))
    for k in sorted(new):
        out.append(Cause(pattern="added", text=f"{call_text(k)}: {_calls(new[k], k[0], steps)} added", keys=(k,)))
    return tuple(out)
