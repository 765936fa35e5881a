"""Mismatched calls with checking off: every collective, every kind of mismatch, every path.

Ranks that disagree on a collective's element count, dtype or op (reduce op, src, counts) get
CollectiveMismatch on every rank, naming each rank's call, and the group works afterwards. The
groups here are made with checking off whatever RTXMPI_CHECK says (tests/run.sh sets it).
"""
import numpy as np
import pytest
from conftest import group_with

from rtxmpi import CollectiveMismatch

pytestmark = pytest.mark.mpi(min_size=2)

SMALL, LARGE = 4, 20000  # elements: 16 B (the mailbox, MPI's Iallreduce); 80 KB (float32)
# path -> (shared-memory settings of the group, element count that takes the path)
PATHS = {
    "mailbox": ({}, SMALL),
    "cross-memory": ({"bounce_bytes": 0}, LARGE),
    "bounce": ({"bounce_any_cpu": True}, LARGE),
    "arena": ({"cma": False, "min_bytes": 0, "small_bytes": 0}, LARGE),
    "mpi-small": ({"enabled": False}, SMALL),
    "mpi-large": ({"enabled": False}, LARGE),
}
TIMEOUT_S = 60.0


@pytest.fixture(scope="module", params=list(PATHS))
def path(request, world):
    """(name, group with checking off, element count) for each path."""
    config, count = PATHS[request.param]
    group = group_with(world, **config)
    group.timeout_s = TIMEOUT_S
    group.all_reduce(np.zeros(count, np.float32))  # builds the shared-memory engine
    return request.param, group, count


def expect_mismatch(group, call, async_op):
    """Run call(async_op) on every rank; assert every rank raised CollectiveMismatch naming each
    rank's call, and that the next collective gives the right answer."""
    error = None
    try:
        result = call(async_op)
        if async_op:
            result.wait()
    except CollectiveMismatch as exc:
        error = exc
    flags = group.all_gather(np.array([error is not None]))
    assert flags.all(), f"CollectiveMismatch raised only on ranks {np.flatnonzero(flags).tolist()}"
    for r in range(group.world_size):
        assert f"rank {r}: " in str(error), str(error)
    after = group.all_reduce(np.ones(3, np.float32))
    assert after.tolist() == [group.world_size] * 3
    return error


def per_rank(group, first, others):
    return first if group.rank == 0 else others


ALL_REDUCE_KINDS = {
    "count": lambda g, n: (np.ones(n + g.rank, np.float32), "sum"),
    "dtype": lambda g, n: (np.ones(n, per_rank(g, np.float32, np.float64)), "sum"),
    "op": lambda g, n: (np.ones(n, np.float32), per_rank(g, "sum", "max")),
    "avg-vs-sum": lambda g, n: (np.ones(n, np.float32), per_rank(g, "sum", "avg")),
    "float16-vs-float32": lambda g, n: (np.ones(n, per_rank(g, np.float32, np.float16)), "sum"),
}


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("kind", list(ALL_REDUCE_KINDS))
def test_all_reduce_mismatch_raises_on_every_rank(path, kind, async_op):
    _, group, n = path
    x, op = ALL_REDUCE_KINDS[kind](group, n)
    error = expect_mismatch(group, lambda a: group.all_reduce(x, op, async_op=a), async_op)
    assert "all_reduce" in str(error)


def rows(group, n):
    """A row count near n divisible by the group size."""
    return max(1, n // group.world_size) * group.world_size


REDUCE_SCATTER_KINDS = {
    "count": lambda g, n: (np.ones(rows(g, n) + g.world_size * g.rank, np.float32), "sum", None),
    "dtype": lambda g, n: (np.ones(rows(g, n), per_rank(g, np.float32, np.float64)), "sum", None),
    "op": lambda g, n: (np.ones(rows(g, n), np.float32), per_rank(g, "sum", "min"), None),
    "counts": lambda g, n: (np.ones(rows(g, n), np.float32), "sum",
                            per_rank(g, None, [rows(g, n)] + [0] * (g.world_size - 1))),
}


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("kind", list(REDUCE_SCATTER_KINDS))
def test_reduce_scatter_mismatch_raises_on_every_rank(path, kind, async_op):
    _, group, n = path
    x, op, counts = REDUCE_SCATTER_KINDS[kind](group, n)
    expect_mismatch(group, lambda a: group.reduce_scatter(x, op, counts=counts, async_op=a),
                    async_op)


DATA_KINDS = {
    "count": lambda g, n: np.ones(rows(g, n) + g.world_size * g.rank, np.float32),
    "dtype": lambda g, n: np.ones(rows(g, n), per_rank(g, np.float32, np.float64)),
}


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("kind", list(DATA_KINDS))
@pytest.mark.parametrize("collective", ["all_gather", "all_to_all", "broadcast"])
def test_data_movement_mismatch_raises_on_every_rank(path, collective, kind, async_op):
    _, group, n = path
    x = DATA_KINDS[kind](group, n)
    expect_mismatch(group, lambda a: getattr(group, collective)(x, async_op=a), async_op)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_broadcast_src_mismatch_raises_on_every_rank(path, async_op):
    _, group, n = path
    x = np.ones(n, np.float32)
    error = expect_mismatch(group, lambda a: group.broadcast(x, per_rank(group, 0, 1), async_op=a),
                            async_op)
    assert "src=0" in str(error) and "src=1" in str(error)


def test_all_reduce_against_another_collective_raises_on_every_rank(path):
    _, group, n = path
    x = np.ones(rows(group, n), np.float32)
    expect_mismatch(group, lambda a: group.all_reduce(x) if group.rank == 0 else group.broadcast(x),
                    False)


@pytest.mark.parametrize("sizes", [(SMALL, LARGE), (LARGE, SMALL), (8000, 8000 * 2)],
                         ids=["mailbox-vs-cross", "cross-vs-mailbox", "float32-vs-float64"])
def test_all_reduce_mismatch_across_the_mailbox_boundary_raises_on_every_rank(world, sizes):
    """One rank's array fits the mailbox, a peer's takes the cross-memory path: each waits on
    its path's flags; the rank that sees its peer on the other path posts a mismatched call
    there, so both raise (before: both waited until the deadline)."""
    group = world.split(0)
    group.check, group.timeout_s = False, TIMEOUT_S
    group.all_reduce(np.zeros(SMALL, np.float32))
    count = per_rank(group, *sizes)
    expect_mismatch(group, lambda a: group.all_reduce(np.ones(count, np.float32), async_op=a),
                    False)
    expect_mismatch(group, lambda a: group.all_reduce(np.ones(count, np.float32), async_op=a),
                    True)
    for n in (SMALL, LARGE):  # both paths are in step afterwards
        assert (group.all_reduce(np.ones(n, np.float32)) == group.world_size).all()


P2P_KINDS = {
    "count": (np.ones(5, np.float32), np.empty(6, np.float32)),
    "dtype": (np.ones(5, np.float32), np.empty(5, np.float64)),
    "fewer": (np.ones(6, np.float32), np.empty(5, np.float32)),
}


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("kind", list(P2P_KINDS))
def test_send_recv_mismatch_raises_on_both_ranks(path, kind, async_op):
    _, group, n = path
    sent, into = P2P_KINDS[kind]
    error = None
    try:
        if group.rank == 0:
            work = group.send(sent, 1, tag=7, async_op=async_op)
        elif group.rank == 1:
            work = group.recv(into, 0, tag=7, async_op=async_op)
        if async_op and group.rank < 2:
            work.wait()
    except CollectiveMismatch as exc:
        error = exc
    flags = group.all_gather(np.array([error is not None]))
    assert flags[1] and not flags[2:].any(), flags.tolist()
    if group.rank == 0 and error is None:  # the answer came after the send completed (eager):
        with pytest.raises(CollectiveMismatch) as raised:  # the next send raises it, not posted
            group.send(np.arange(4, dtype=np.float32), 1, tag=7)
        error = raised.value
    if group.rank < 2:
        assert "rank 0: send(" in str(error) and "rank 1: recv(" in str(error), str(error)
    if group.rank == 0:  # the pair works afterwards
        group.send(np.arange(4, dtype=np.float32), 1, tag=7)
    elif group.rank == 1:
        assert group.recv(np.empty(4, np.float32), 0, tag=7).tolist() == [0, 1, 2, 3]
    left = group.all_gather(np.array([group.backend.comm.Iprobe()]))  # before the next test sends
    assert not left.any(), f"a message was left behind on ranks {np.flatnonzero(left).tolist()}"
