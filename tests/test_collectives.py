"""One table entry per op: the paper's volume factor and nccl-tests' bus factor for a group of n."""

from fractions import Fraction

import pytest
from commgate.model.collectives import OPS, Op


@pytest.mark.parametrize(
    ("op", "n", "bus", "paper"),
    [
        (Op.ALL_REDUCE, 8, Fraction(14, 8), Fraction(14, 8)),
        (Op.ALL_GATHER, 8, Fraction(7, 8), Fraction(7, 8)),
        (Op.REDUCE_SCATTER, 4, Fraction(3, 4), Fraction(3, 4)),
        (Op.ALL_TO_ALL, 4, Fraction(3, 4), Fraction(3, 4)),
        (Op.BROADCAST, 4, Fraction(1), Fraction(3, 4)),
        (Op.REDUCE, 4, Fraction(1), Fraction(3, 4)),
        (Op.SEND, 2, Fraction(1), Fraction(1)),
        (Op.RECV, 2, Fraction(0), Fraction(0)),
    ],
)
def test_factors(op: Op, n: int, bus: Fraction, paper: Fraction) -> None:
    assert OPS[op].bus(n) == bus
    assert OPS[op].paper(n) == paper


@pytest.mark.parametrize("op", list(Op))
def test_a_size_one_group_sends_nothing(op: Op) -> None:
    assert OPS[op].bus(1) == 0 and OPS[op].paper(1) == 0


def test_every_op_has_an_entry() -> None:
    assert set(OPS) == set(Op)


def test_ring_traffic_sends_the_wire_bytes_to_the_next_rank() -> None:
    assert list(OPS[Op.ALL_REDUCE].traffic((0, 2, 4), Fraction(30))) == [(0, 2, 30), (2, 4, 30), (4, 0, 30)]


def test_all_to_all_traffic_is_pairwise() -> None:
    out = list(OPS[Op.ALL_TO_ALL].traffic((0, 1, 2), Fraction(20)))  # wire = m(n-1)/n per rank
    assert len(out) == 6 and all(b == 10 for _, _, b in out)
