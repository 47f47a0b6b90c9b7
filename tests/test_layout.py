"""Process groups follow DeepSpeed's topology (pipe, data, model; model fastest)."""

import itertools

import pytest
from commgate.model.layout import Layout


def test_3d_groups_on_8_ranks() -> None:
    lay = Layout(dp=2, tp=2, pp=2)
    assert lay.tp_groups() == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert lay.dp_groups() == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert lay.dp_groups(1) == ((4, 6), (5, 7))
    assert lay.pp_groups() == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert lay.stage_pairs(0, 1) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert lay.stage_pairs(1, 0) == ((4, 0), (5, 1), (6, 2), (7, 3))


def test_moe_groups_match_deepspeeds_docstring_example() -> None:
    # deepspeed.utils.groups: world 16, expert_parallel_size 2
    lay = Layout(dp=16, ep=2)
    assert lay.ep_groups()[:3] == ((0, 1), (2, 3), (4, 5))
    assert lay.edp_groups() == (tuple(range(0, 16, 2)), tuple(range(1, 16, 2)))


def test_hpz_groups_are_consecutive_chunks() -> None:
    assert Layout(dp=8, hpz=4).hpz_groups() == ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.parametrize(("dp", "tp", "pp"), [(1, 1, 1), (4, 1, 1), (2, 2, 2), (3, 2, 4), (1, 8, 2)])
def test_every_rank_is_in_exactly_one_group_per_axis(dp: int, tp: int, pp: int) -> None:
    lay = Layout(dp=dp, tp=tp, pp=pp)
    for groups, size in ((lay.dp_groups(), dp), (lay.tp_groups(), tp), (lay.pp_groups(), pp)):
        ranks = list(itertools.chain.from_iterable(groups))
        assert sorted(ranks) == list(range(lay.world_size))
        assert all(len(g) == size for g in groups)
    for r in range(lay.world_size):
        pipe, data, model = lay.coords(r)
        assert lay.rank(pipe=pipe, data=data, model=model) == r


@pytest.mark.parametrize(
    ("pp", "rep", "dp", "cp", "tp"),
    [(1, 2, 2, 1, 2), (2, 2, 2, 1, 1), (2, 2, 4, 2, 2), (1, 3, 2, 2, 1), (1, 1, 4, 2, 2)],
)
def test_hsdp_groups_are_torchtitans_mesh_dimensions(pp: int, rep: int, dp: int, cp: int, tp: int) -> None:
    """torchtitan's mesh (pp, dp_replicate, dp_shard, cp, tp), rank = its row-major index: each group of the
    layout is the ranks along that mesh's dimensions (dp here counts dp_shard x cp), every other index fixed."""
    shape = {"pp": pp, "rep": rep, "shard": dp // cp, "cp": cp, "tp": tp}
    names = list(shape)

    def along(*dims: str) -> set[tuple[int, ...]]:
        out = set()
        fixed = [n for n in names if n not in dims]
        for f in itertools.product(*(range(shape[n]) for n in fixed)):
            where = dict(zip(fixed, f, strict=True))
            group = []
            for v in itertools.product(*(range(shape[n]) for n in dims)):
                idx = where | dict(zip(dims, v, strict=True))
                rank = 0
                for n in names:
                    rank = rank * shape[n] + idx[n]
                group.append(rank)
            out.add(tuple(group))
        return out

    lay = Layout(dp=dp, tp=tp, pp=pp, replicate=rep, cp=cp)
    assert set(lay.dp_groups()) == along("shard", "cp")
    assert set(lay.replicate_groups()) == along("rep")
    assert set(lay.tp_groups()) == along("tp")
    assert set(lay.pp_groups()) == along("pp")
    assert set(lay.data_groups()) == along("rep", "shard", "cp")
    assert set(lay.batch_groups()) == along("rep", "shard")
    assert set(lay.cp_groups()) == along("cp")
    for r in range(lay.world_size):
        pipe, data, model = lay.coords(r)
        assert any(r in g and g[data] == r for g in lay.dp_groups(pipe))
        assert any(r in g and g[model] == r for g in lay.tp_groups(pipe))
