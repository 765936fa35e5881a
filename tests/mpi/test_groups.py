"""Sub-groups: split(color, key), new_group(ranks), their attributes and collectives inside them.

Expected memberships are computed from the world size, so every test holds at -n 1, 2 and 4.
"""
import zlib

import numpy as np
import pytest
from mpi4py import MPI

import rtxmpi


def name_digest(group):
    return np.array([zlib.crc32(group.name.encode())], np.int64)


def assert_group(group, members, world):
    """`group` holds world ranks `members` (in group-rank order) and this rank sits at its index."""
    assert isinstance(group, rtxmpi.ProcessGroup)
    assert group.members == members
    assert group.world_size == len(members)
    assert group.rank == members.index(world.rank)
    assert group.local_rank == world.local_rank and group.device == world.device
    assert group.timeout_s == world.timeout_s and group.check == world.check


def assert_exact_int(actual, expected):
    assert actual.tolist() == list(expected), (actual.tolist(), expected)


# -- the world group ------------------------------------------------------------------------------
def test_world_attributes_match_mpi(world):
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank = node.Get_rank()
    node.Free()
    assert world.name == "world"
    assert (world.rank, world.world_size) == (comm.Get_rank(), comm.Get_size())
    assert world.members == list(range(comm.Get_size()))
    assert world.local_rank == local_rank
    assert world.device == "cpu"
    assert world.check is True and world.timeout_s > 0
    assert world.backend.name == "mpi"


def test_init_again_returns_the_same_world(world):
    assert rtxmpi.init() is world
    assert rtxmpi.world() is world and rtxmpi.is_initialized()


# -- split ----------------------------------------------------------------------------------------
def test_split_even_odd_groups_members_and_ranks(world):
    color = world.rank % 2
    group = world.split(color)
    assert_group(group, [r for r in range(world.world_size) if r % 2 == color], world)


def test_split_key_reversing_order_reverses_group_ranks(world):
    color = world.rank % 2
    group = world.split(color, key=world.world_size - world.rank)
    members = [r for r in range(world.world_size) if r % 2 == color][::-1]
    assert_group(group, members, world)


def test_split_same_color_everywhere_gives_a_copy_of_the_world(world):
    group = world.split(0)
    assert_group(group, list(range(world.world_size)), world)


def test_split_one_group_per_rank(world):
    group = world.split(world.rank)
    assert_group(group, [world.rank], world)
    x = np.full(3, world.rank + 1.0)
    group.all_reduce(x)
    assert (x == world.rank + 1.0).all()


def test_split_none_color_returns_none_on_that_rank(world):
    last = world.world_size - 1
    group = world.split(None if world.rank == last else 0)
    if world.rank == last:
        assert group is None
    else:
        assert_group(group, list(range(last)), world)


@pytest.mark.parametrize("color", [-1, 1.5, "red"])
def test_split_bad_color_raises_value_error_on_every_rank(world, assert_raised_on_every_rank, color):
    assert_raised_on_every_rank(world, lambda: world.split(color), ValueError, match=["color"])


def test_nested_split_maps_to_world_ranks(world):
    half = world.split(world.rank % 2)
    quarter = half.split(half.rank % 2)  # every other member of `half`
    members = [r for r in half.members if half.members.index(r) % 2 == half.rank % 2]
    assert_group(quarter, members, world)
    x = np.array([world.rank], np.int64)
    assert_exact_int(quarter.all_gather(x), members)


# -- new_group ------------------------------------------------------------------------------------
def test_new_group_members_get_a_group_others_get_none(world):
    evens = list(range(0, world.world_size, 2))
    group = world.new_group(evens)
    if world.rank in evens:
        assert_group(group, evens, world)
    else:
        assert group is None


def test_new_group_orders_members_by_rank_whatever_the_argument_order(world):
    ranks = list(range(world.world_size))[::-1]
    group = world.new_group(np.array(ranks))
    assert_group(group, sorted(ranks), world)


@pytest.mark.parametrize("ranks_of", [lambda n: [], lambda n: [0, 0], lambda n: [n], lambda n: [-1]],
                         ids=["empty", "duplicate", "too_large", "negative"])
def test_new_group_bad_ranks_raise_value_error_on_every_rank(
        world, assert_raised_on_every_rank, ranks_of):
    assert_raised_on_every_rank(world, lambda: world.new_group(ranks_of(world.world_size)),
                                ValueError)


# -- names ----------------------------------------------------------------------------------------
def test_sub_group_names_identical_across_members(world, assert_same_on_every_rank):
    split = world.split(world.rank % 2)
    assert split.name.startswith("world/")
    assert_same_on_every_rank(split, name_digest(split))
    created = world.new_group(range(world.world_size))
    assert_same_on_every_rank(created, name_digest(created))
    assert len({split.name, created.name, world.name}) == 3


@pytest.mark.mpi(min_size=2)
def test_sub_groups_of_different_colors_have_different_names(world):
    split = world.split(world.rank % 2)
    names = world.all_gather(name_digest(split))
    assert names[0] != names[1]


# -- collectives inside sub-groups ----------------------------------------------------------------
def test_all_reduce_inside_split_group_sums_only_its_members(world):
    group = world.split(world.rank % 2)
    x = np.array([world.rank, 1], np.int64)
    group.all_reduce(x)
    assert x.tolist() == [sum(group.members), len(group.members)]


def test_collectives_inside_sub_group_use_group_ranks(world):
    group = world.split(world.rank % 2, key=-world.rank)  # group rank 0 = highest world rank
    n, members = group.world_size, group.members
    gathered = group.all_gather(np.array([world.rank], np.int64))
    assert_exact_int(gathered, members)
    for src in range(n):
        x = np.array([world.rank], np.int64)
        group.broadcast(x, src)
        assert x[0] == members[src]
    rows = np.repeat(np.array([world.rank], np.int64), 2 * n)
    shard = group.reduce_scatter(rows)
    assert shard.tolist() == [sum(members)] * 2
    chunks = np.array([100 * world.rank + j for j in range(n)], np.int64)
    received = group.all_to_all(chunks)
    assert received.tolist() == [100 * members[j] + group.rank for j in range(n)]
    group.barrier()


def test_send_recv_ring_inside_sub_group_uses_group_ranks(world):
    group = world.split(world.rank % 2)
    n, rank = group.world_size, group.rank
    sent = group.send(np.array([world.rank], np.int64), (rank + 1) % n, async_op=True)
    got = group.recv(np.empty(1, np.int64), (rank - 1) % n)
    sent.wait()
    assert got[0] == group.members[(rank - 1) % n]


def test_async_collective_inside_sub_group(world):
    group = world.new_group(range(world.world_size))
    work = group.all_reduce(np.ones(4) * world.rank, async_op=True)
    assert (work.wait() == sum(range(world.world_size))).all() and work.test()


def test_sub_group_and_world_collectives_interleave(world):
    group = world.split(world.rank % 2)
    for step in range(5):
        a = np.array([float(world.rank + step)])
        b = np.array([float(world.rank * step)])
        pending = group.all_reduce(a, async_op=True)
        world.all_reduce(b)
        pending.wait()
        assert a[0] == sum(r + step for r in group.members)
        assert b[0] == sum(r * step for r in range(world.world_size))


@pytest.mark.mpi(min_size=2)
def test_mismatch_inside_sub_group_raises_on_its_members(world, assert_raised_on_every_rank):
    group = world.split(0)
    x = np.ones((1 + group.rank % 2, 3), np.float32)
    error = assert_raised_on_every_rank(group, lambda: group.all_reduce(x), rtxmpi.CollectiveMismatch)
    assert f"on group '{group.name}'" in str(error)
    y = np.ones(2)
    group.all_reduce(y)
    assert (y == group.world_size).all()


def test_subgroup_comms_follow_live_groups_and_their_shm_engines(world):
    """What an elastic shrink revokes: every live sub-group's communicator, its shared-memory
    engine's node communicator once built, and nothing of a group the program dropped."""
    import gc

    import numpy as np

    from rtxmpi.comm.group import subgroup_comms

    monitor = world.backend.monitor
    group = world.split(0)
    inner = group.split(0)
    listed = subgroup_comms(monitor)
    assert any(c is group.backend.comm for c in listed)
    assert any(c is inner.backend.comm for c in listed)
    group.all_reduce(np.ones(4, np.float32))  # builds the shm engine where the node allows one
    engine = group.backend._shm
    if engine:
        assert all(any(c is mine for c in subgroup_comms(monitor)) for mine in engine.comms())
        assert engine.node in group.backend.comms()
    gc.collect()  # groups of earlier tests, dropped but not yet collected
    before = len(subgroup_comms(monitor))
    dropped = len(inner.backend.comms())
    del inner
    gc.collect()
    assert len(subgroup_comms(monitor)) == before - dropped
