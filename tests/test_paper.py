"""The paper's equations against values worked out by hand (Section III of seed 000)."""

from fractions import Fraction

import pytest
from commgate.model import paper


def test_eq1_13b_literal() -> None:
    # 2*50304*5120 + 2048*5120 + 40*(12*5120^2 + 8*5120) + 2*5120
    # = 515,112,960 + 10,485,760 + 12,584,550,400 + 10,240
    assert paper.eq1_param_count(V=50304, h=5120, s=2048, L=40) == 13_110_159_360


def test_eq1_19m_literal() -> None:
    # 51,511,296 + 1,048,576 + 6*(3,145,728 + 4,096) + 1,024
    assert paper.eq1_param_count(V=50304, h=512, s=2048, L=6) == 71_459_840


def test_eq1_switches() -> None:
    full = paper.eq1_param_count(V=10, h=4, s=3, L=1)  # 80 + 12 + (192 + 32) + 8
    assert full == 324
    assert paper.eq1_param_count(V=10, h=4, s=3, L=1, tied_embeddings=True) == 324 - 40
    assert paper.eq1_param_count(V=10, h=4, s=3, L=1, position="rotary") == 324 - 12
    assert paper.eq1_param_count(V=10, h=4, s=3, L=1, position="none") == 324 - 12
    # x = 8: MLP 2*8*h^2 = 256 instead of 128
    assert paper.eq1_param_count(V=10, h=4, s=3, L=1, x=8) == 324 + 128


def test_collective_volume_definitions() -> None:
    assert paper.allreduce_volume(1000, 4) == 1500
    assert paper.allgather_volume(1000, 4) == 750
    assert paper.allreduce_volume(1000, 1) == 0


def test_eq2_and_eq3_13b_dp16() -> None:
    n = 13_110_159_360
    assert paper.eq2_data_parallel(n, 16) == 24_581_548_800  # 2n * 15/16
    assert paper.eq3_zero3(n, 16) == 36_872_323_200  # 3n * 15/16
    assert paper.eq3_zero3(n, 16) == Fraction(3, 2) * paper.eq2_data_parallel(n, 16)


def test_eq4_pipeline() -> None:
    assert paper.eq4_pipeline(b=1, s=2048, h=5120, p=4) == 62_914_560  # 2 * 10,485,760 * 3
    assert paper.eq4_pipeline(b=4, s=2048, h=5120, p=1) == 0


def test_eq5_tensor() -> None:
    # (12*40 + 2) * 10,485,760 * 7/8 = 482 * 9,175,040
    assert paper.eq5_tensor(L=40, b=1, s=2048, h=5120, t=8) == 4_422_369_280
    assert paper.eq5_tensor(L=40, b=1, s=2048, h=5120, t=8, recompute=False) == 322 * 9_175_040
    # 3D: L -> L/p
    assert paper.eq5_tensor(L=Fraction(40, 4), b=1, s=2048, h=5120, t=8) == 122 * 9_175_040


@pytest.mark.parametrize("L", [1, 6, 40])
def test_eq5_is_zero_without_tensor_parallelism(L: int) -> None:
    assert paper.eq5_tensor(L=L, b=2, s=512, h=1024, t=1) == 0


@pytest.mark.parametrize("eq", [paper.eq2_data_parallel, paper.eq3_zero3])
def test_data_parallel_volumes_grow_with_d(eq) -> None:  # type: ignore[no-untyped-def]
    values = [eq(1_000_000, d) for d in (1, 2, 4, 8, 16, 1024)]
    assert values[0] == 0
    assert values == sorted(values) and len(set(values)) == len(values)
