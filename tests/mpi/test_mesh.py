"""DeviceMesh: validation, the rank layout (pp outermost ... tp innermost) and the named groups."""
import numpy as np
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.mesh import AXES, DeviceMesh


def layouts(n):
    """Every (dp, tp, pp, sp) whose product is n."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [(n // (tp * pp * sp), tp, pp, sp) for tp in divisors for pp in divisors
            for sp in divisors if n % (tp * pp * sp) == 0]


def test_product_not_world_size_raises_naming_every_factor(world, assert_raised_on_every_rank):
    n = world.world_size
    error = assert_raised_on_every_rank(world, lambda: DeviceMesh(dp=n, tp=2, pp=1, sp=1),
                                        ConfigError)
    assert f"dp({n}) * tp(2) * pp(1) * sp(1) = {2 * n} != world_size({n})" in str(error)


@pytest.mark.parametrize("bad", [{"tp": 0}, {"sp": -1}, {"pp": 1.5}, {"dp": True}])
def test_non_positive_or_non_integer_degree_raises(world, assert_raised_on_every_rank, bad):
    assert_raised_on_every_rank(world, lambda: DeviceMesh(**bad), ConfigError)


def test_default_dp_fills_the_world_and_indivisible_world_raises(world, assert_raised_on_every_rank):
    mesh = DeviceMesh(tp=1)
    assert (mesh.dp, mesh.tp, mesh.pp, mesh.sp) == (world.world_size, 1, 1, 1)
    error = assert_raised_on_every_rank(world, lambda: DeviceMesh(tp=world.world_size + 1),
                                        ConfigError)
    assert "not divisible" in str(error)


def test_rank_layout_is_pp_dp_sp_tp_with_tp_innermost(world):
    for dp, tp, pp, sp in layouts(world.world_size):
        mesh = DeviceMesh(dp=dp, tp=tp, pp=pp, sp=sp, group=world)
        c = mesh.coord
        assert world.rank == ((c.pp * dp + c.dp) * sp + c.sp) * tp + c.tp
        assert mesh.rank_of() == world.rank
        assert [mesh.coord_of(r) for r in range(world.world_size)] == sorted(
            mesh.coord_of(r) for r in range(world.world_size))


def test_every_axis_group_holds_the_ranks_that_differ_only_on_that_axis(world):
    for dp, tp, pp, sp in layouts(world.world_size):
        mesh = DeviceMesh(dp=dp, tp=tp, pp=pp, sp=sp, group=world)
        for axis in AXES:
            g = mesh.group(axis)
            assert g.world_size == mesh.shape[axis]
            assert g.rank == getattr(mesh.coord, axis)
            expected = [mesh.rank_of(**{axis: i}) for i in range(mesh.shape[axis])]
            assert g.members == expected
            got = g.all_gather(np.array([world.rank], np.int64))  # the group really talks
            assert got.tolist() == expected
        both = mesh.group("sp", "dp")
        assert both is mesh.loss_group and both.world_size == dp * sp
        assert sorted(both.members) == sorted(mesh.rank_of(dp=d, sp=s)
                                              for d in range(dp) for s in range(sp))


def test_batch_and_sequence_slices_partition_the_global_batch(world, assert_raised_on_every_rank):
    n = world.world_size
    mesh = DeviceMesh(dp=n, group=world)
    rows = mesh.loss_group.all_gather(np.arange(2 * n)[mesh.batch_slice(2 * n)])
    assert rows.tolist() == list(range(2 * n))
    assert mesh.seq_slice(16) == slice(0, 16)
    mesh = DeviceMesh(dp=1, sp=n, group=world)
    cols = mesh.loss_group.all_gather(np.arange(4 * n)[mesh.seq_slice(4 * n)])
    assert cols.tolist() == list(range(4 * n)) and mesh.batch_slice(8) == slice(0, 8)
    if n > 1:
        assert_raised_on_every_rank(world, lambda: mesh.seq_slice(4 * n + 1), ConfigError,
                                    match=[f"sp({n})"])


def test_unknown_axis_raises(world):
    mesh = DeviceMesh(group=world)
    with pytest.raises(ConfigError, match="axes must be distinct"):
        mesh.group("ep")


def test_engine_builders_refuse_every_layout_problem_on_every_rank(world, assert_raised_on_every_rank):
    """build_hybrid and build_pipeline ask the layout object before building anything: every
    problem in one ConfigError, on every rank, with no collective started."""
    from rtxmpi.nn import GPTConfig
    from rtxmpi.parallel.hybrid import build_hybrid
    from rtxmpi.parallel.pipeline import build_pipeline

    n, cfg = world.world_size, GPTConfig.named("tiny", seq_len=16)  # n_layer 2
    assert_raised_on_every_rank(
        world, lambda: build_hybrid(cfg, world, dp=n, tp=2, offload="cpu"), ConfigError,
        match=["2 problems", f"dp({n}) * tp(2) * pp(1) * sp(1) = {2 * n}", "--offload cpu needs"])
    assert_raised_on_every_rank(
        world, lambda: build_pipeline(cfg, world, pp=4 * n, sp=2, micro_batches=1, zero_stage=3),
        ConfigError, match=[f"--pp {4 * n} > n_layer 2", "1F1B needs", "--zero-stage 3 with"])
