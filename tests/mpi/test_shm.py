"""The shared-memory and hierarchical all_reduce (rtxmpi/comm/shm.py) against numpy references.

Groups here are made with the path forced for every size (min_bytes 0) and a 4 KiB chunk, so
small arrays already cross chunk and triple-buffer boundaries; both modes run (cross-memory reads
"cma" and the shared arena "copy"), and the hierarchical path is exercised on one machine by
pretending nodes of 2 ranks (node_size=2; hierarchical at -n 4, one "node" per rank pair). Every
test holds at -n 1, 2, 4 (at -n 1 the MPI path is used). Inputs are integer-valued, so every
reduction is exact whatever the order of the terms.
"""
import os
import platform
import sys
import time

import numpy as np
import pytest
from conftest import group_with
from mpi4py import MPI
from test_collectives import REDUCE_CASES, assert_exact, rank_values, reduce_reference

from rtxmpi import CollectiveMismatch
from rtxmpi.comm import shm

CHUNK = shm.MIN_CHUNK_BYTES  # 4 KiB: 1024 float32 per chunk
# element counts around chunk (1024 float32) and triple-buffer (3 chunks) boundaries
LENGTHS = [1, 1023, 1025, 3 * 1024 + 1, 10007]
# every op and dtype, half of them through the checking-mode (general) path, half unchecked (the
# fast path; float16/bfloat16/bool always take the general path)
CASES = [(op, dtype, i % 2 == 0) for i, (op, dtype) in enumerate(REDUCE_CASES)]


def forced_group(world, check, compiled=True, **config):
    """A copy of `world` whose all_reduce takes the cross-memory (or arena) path at every size
    (and the mailbox never, unless `small_bytes` is given; compiled=False: the numpy mailbox)."""
    saved, saved_module = shm.CONFIG, shm._mailbox
    config = {"min_bytes": 0, "small_bytes": 0, "chunk_bytes": CHUNK, **config}
    shm.CONFIG = shm.ShmConfig(**config)
    if not compiled:
        shm._mailbox = None
    try:
        group = world.split(0)
        group.all_reduce(np.zeros(1, np.float32))  # builds the engine, with these settings
    finally:
        shm.CONFIG, shm._mailbox = saved, saved_module
    group.check = check
    return group


BOUNCE = {"bounce_any_cpu": True}  # every cross-memory all_reduce bounces (tests)
NO_BOUNCE = {"bounce_bytes": 0}  # none does: the system calls


@pytest.fixture(scope="module", params=["node-cma", "node-bounce", "node-copy",
                                        "hierarchical-cma", "hierarchical-copy", "node-mailbox",
                                        "node-mailbox-numpy"])
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def groups(world, layout):
    """{check: group}; layout 'hierarchical-*' pretends nodes of 2 ranks; '*-copy' turns
    cross-memory access off (the shared arena); 'node-cma' moves every all_reduce through the
    system calls, 'node-bounce' through the shared bounce slots (every call, whatever the CPUs);
    'node-mailbox' sends every all_reduce up to 1 MiB through the one-synchronization mailbox
    (compiled), 'node-mailbox-numpy' up to its 32 KiB through the numpy one (the fallback
    without the extension)."""
    if layout.startswith("node-mailbox"):
        compiled = layout == "node-mailbox"
        return {check: forced_group(world, check, compiled, min_bytes=shm.NEVER,
                                    small_bytes=1 << 20) for check in (True, False)}
    node_size = 2 if layout.startswith("hierarchical") else None
    cma = not layout.endswith("copy")
    bounce = BOUNCE if layout == "node-bounce" else NO_BOUNCE
    return {check: forced_group(world, check, node_size=node_size, cma=cma, **bounce)
            for check in (True, False)}


def mailbox_possible(local_size, compiled=shm._mailbox is not None):
    """Whether a node of `local_size` ranks gets the mailbox: the compiled one, or x86 for the
    numpy mailbox (also when the ranks outnumber the cores: its polls yield)."""
    return ((compiled or platform.machine().lower() in shm.TSO_MACHINES)
            and sys.platform.startswith("linux"))


def mailbox_bytes(local_size):
    """The default mailbox size of a node of `local_size` ranks (on Linux the cross-memory path
    is available, and with the compiled one the mailbox stops at CROSS_SMALL_BYTES)."""
    size = min(shm.DEFAULT_SMALL_BYTES,
               shm.MAILBOX_READ_BYTES // local_size // shm.FLAG_BYTES * shm.FLAG_BYTES)
    fast = shm._mailbox is not None and sys.platform.startswith("linux")
    return min(size, shm.CROSS_SMALL_BYTES) if fast else size


def expected_engine(group, layout):
    """(local_size, nodes, mode, mailbox bytes) the engine must have, or None where MPI's path
    is used."""
    n = group.world_size
    linux = sys.platform.startswith("linux")
    mode = "copy" if layout.endswith("copy") or not linux else "cma"
    compiled = layout == "node-mailbox" and shm._mailbox is not None
    mailbox = layout.startswith("node-mailbox") and mailbox_possible(n, compiled)
    if layout.startswith("node"):
        size = (1 << 20) if compiled else shm.NUMPY_SMALL_BYTES  # set: not scaled
        return None if n == 1 else (n, 1, mode, size if mailbox else -1)
    return None if n == 1 or n % 2 else (2, n // 2, mode, -1)


def assert_path(group, layout):
    want = expected_engine(group, layout)
    engine = group.backend._shm
    if want is None:
        assert engine is None or engine is False
    else:
        assert isinstance(engine, shm.NodeAllReduce), engine
        assert (engine.local_size, engine.nodes, engine.mode, engine.small_bytes) == want
        if layout in ("node-cma", "node-bounce"):  # the bounce needs the compiled mailbox
            bounce = layout == "node-bounce" and engine.mailbox is not None
            assert engine.bounce_bytes == (shm.NEVER if bounce else 0), engine
            assert engine._tuner is None


def inputs(group, length, dtype, op, salt=0):
    mine = rank_values(group.rank, (length,), dtype, op, salt)
    every = [rank_values(r, (length,), dtype, op, salt) for r in range(group.world_size)]
    return mine, reduce_reference(every, op)


@pytest.mark.parametrize("op,dtype,check", CASES)
def test_all_reduce_matches_numpy_for_every_op_and_dtype(groups, layout, check, op, dtype,
                                                         assert_same_on_every_rank):
    group = groups[check]
    x, expected = inputs(group, 3 * 1024 + 1, dtype, op)
    out = group.all_reduce(x, op)
    assert out is x
    assert_exact(out, expected)
    assert_path(group, layout)
    assert_same_on_every_rank(group, out)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("op,dtype", [("sum", "float32"), ("max", "int8"), ("min", "float64"),
                                      ("avg", "bfloat16"), ("prod", "int64"), ("sum", "bool")])
def test_all_reduce_lengths_across_chunk_boundaries(groups, length, op, dtype):
    group = groups[False]
    x, expected = inputs(group, length, dtype, op, salt=length)
    assert_exact(group.all_reduce(x, op), expected)


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("shape", [(0,), (4, 0), ()])
def test_all_reduce_empty_and_zero_dim(groups, check, shape):
    group = groups[check]
    x = np.array(rank_values(group.rank, shape, "float32"))
    expected = reduce_reference(
        [np.array(rank_values(r, shape, "float32")) for r in range(group.world_size)], "sum")
    out = group.all_reduce(x)
    assert out is x
    assert_exact(out, expected)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32"])
def test_all_reduce_strided_view_writes_back_and_leaves_base_untouched(groups, dtype):
    group = groups[False]
    base = rank_values(group.rank, (2100, 3), dtype)
    before = base.copy()
    view = base[::2, 1]
    expected = reduce_reference(
        [rank_values(r, (2100, 3), dtype)[::2, 1] for r in range(group.world_size)], "sum")
    out = group.all_reduce(view)
    assert out is view
    assert_exact(view, expected)
    untouched = np.ones(base.shape, bool)
    untouched[::2, 1] = False
    assert_exact(base[untouched], before[untouched])


def test_all_reduce_multi_dim_in_place(groups):
    group = groups[False]
    x, expected = inputs(group, 6 * 1031, "float64", "sum")
    x2 = x.reshape(6, 1031)
    out = group.all_reduce(x2)
    assert out is x2
    assert_exact(out.reshape(-1), expected)


def test_repeated_calls_with_varying_sizes_and_dtypes_reuse_one_engine(groups, layout):
    group = groups[False]
    for i, (length, dtype) in enumerate([(50_000, "float32"), (5, "float64"), (20_011, "int8"),
                                         (0, "float32"), (70_001, "float64"), (1030, "uint8"),
                                         (50_000, "float32")]):
        x, expected = inputs(group, length, dtype, "sum", salt=100 + i)
        assert_exact(group.all_reduce(x), expected)
        if i == 0:
            arena = group.backend._shm
    assert group.backend._shm is arena  # built once, reused (its size does not depend on calls)
    if arena:
        assert arena.chunk_bytes == CHUNK
    assert_path(group, layout)


# -- reduce_scatter (cross-memory reads on one node; MPI in the other layouts) -----------------
def expected_rows(group, rows, dtype, op, counts=None, salt=0):
    every = [rank_values(r, (rows, 3), dtype, op, salt) for r in range(group.world_size)]
    full = reduce_reference(every, op)
    if counts is None:
        counts = [rows // group.world_size] * group.world_size
    start = sum(counts[:group.rank])
    return every[group.rank], full[start:start + counts[group.rank]]


@pytest.mark.parametrize("op,dtype,check", CASES[::3])
def test_reduce_scatter_matches_numpy(groups, op, dtype, check):
    group = groups[check]
    x, expected = expected_rows(group, 1365 * group.world_size, dtype, op)
    before = x.copy()
    assert_exact(group.reduce_scatter(x, op), expected)
    assert_exact(x, before)  # the input is read only


@pytest.mark.parametrize("pattern", ["first", "last_empty", "ramp"])
@pytest.mark.parametrize("op,dtype", [("sum", "float32"), ("max", "int64"), ("avg", "float16")])
def test_reduce_scatter_uneven_counts(groups, pattern, op, dtype):
    group = groups[False]
    n = group.world_size
    counts = {"first": [4097] + [0] * (n - 1), "last_empty": [1500] * (n - 1) + [0] if n > 1 else [7],
              "ramp": [1000 * (r + 1) + r for r in range(n)]}[pattern]
    x, expected = expected_rows(group, sum(counts), dtype, op, counts, salt=len(pattern))
    assert_exact(group.reduce_scatter(x, op, counts=counts), expected)


def test_reduce_scatter_strided_and_empty(groups):
    group = groups[False]
    n = group.world_size
    base = rank_values(group.rank, (2 * 1031 * n, 3), "int32")
    view = base[::2]
    every = [rank_values(r, (2 * 1031 * n, 3), "int32")[::2] for r in range(n)]
    expected = reduce_reference(every, "sum")[group.rank * 1031:(group.rank + 1) * 1031]
    assert_exact(group.reduce_scatter(view), expected)
    empty = group.reduce_scatter(np.zeros((0, 5), np.float32))
    assert empty.shape == (0, 5)


# -- all_gather (cross-memory reads on one node; MPI in the other layouts) ---------------------
@pytest.mark.parametrize("dtype", ["float32", "int8", "bool", "bfloat16", "float64"])
@pytest.mark.parametrize("length", [1, 1023, 4097])
def test_all_gather_matches_numpy(groups, dtype, length):
    group = groups[length % 2 == 0]
    every = [rank_values(r, (length, 2), dtype, salt=length) for r in range(group.world_size)]
    got = group.all_gather(every[group.rank])
    assert_exact(got, np.concatenate(every))


def test_all_gather_strided_zero_dim_and_empty(groups):
    group = groups[False]
    n = group.world_size
    base = rank_values(group.rank, (2 * 3001, 3), "int32")
    every = [rank_values(r, (2 * 3001, 3), "int32")[::2] for r in range(n)]
    assert_exact(group.all_gather(base[::2]), np.concatenate(every))
    assert_exact(group.all_gather(np.array(group.rank + 0.5)), np.arange(n) + 0.5)
    assert group.all_gather(np.zeros((0, 4), np.float32)).shape == (0, 4)


def test_all_gather_takes_the_cross_memory_path_on_one_node(groups, layout):
    group = groups[False]
    x = np.full(3000, group.rank, np.int32)
    group.all_gather(x)  # builds the engine if no call has yet
    engine = group.backend._shm
    if not (engine and engine.mode == "cma" and engine.nodes == 1
            and group.backend.shm_min_bytes == 0):
        pytest.skip(f"{layout} at world size {group.world_size}: MPI's Allgather")
    taken, real = [], engine.all_gather
    engine.all_gather = lambda *args, **kwargs: taken.append(real(*args, **kwargs)) or taken[-1]
    try:
        got = group.all_gather(x)
    finally:
        del engine.all_gather
    assert taken == [True]
    assert_exact(got, np.repeat(np.arange(group.world_size, dtype=np.int32), 3000))


def test_async_all_reduce_matches_blocking(groups):
    group = groups[False]
    x, expected = inputs(group, 5000, "float32", "sum")
    assert_exact(group.all_reduce(x, async_op=True).wait(), expected)


def queued(group):
    """Whether the group's nonblocking all_reduce takes the shared-memory queue (one node, the
    compiled cross-memory call): the engine's start_all_reduce, spied on. Returns the list of
    calls seen (append-only), or None when the path is not there."""
    engine = group.backend._shm
    if not engine or engine.mailbox is None or engine.mode != "cma":
        return None
    seen, real = [], engine.start_all_reduce
    engine.start_all_reduce = lambda x, op, *args: seen.append(x.size) or real(x, op, *args)
    return seen


@pytest.mark.parametrize("paths", ["cross-memory", "default"])
def test_async_all_reduces_in_flight_complete_in_any_wait_order(world, paths):
    """Several nonblocking all_reduces in flight (sizes on both sides of the mailbox, dtypes the
    compiled fold has and float16, which it has not), waited for in reverse order or polled
    with test(), with blocking all_reduces (mailbox and cross-memory sizes), reduce_scatter
    and all_gather between launches and waits (each drains the queue first): every result
    exact, the queue empty at the end. paths: every size through the cross-memory call, or the
    defaults (the mailbox up to 32 KiB, so 17 int32 and 3000 float16 queue as mailbox calls
    between cross-memory ones)."""
    if paths == "default":
        group = group_with(world)
        group.all_reduce(np.zeros(1, np.float32))  # builds the engine
    else:
        group = forced_group(world, False)
    seen = queued(group)
    try:
        for trial in range(3):
            specs = [(100_000, "float32", "sum"), (17, "int32", "max"), (3000, "float16", "sum"),
                     (70_001, "float64", "min"), (5000, "int64", "prod"), (33, "float64", "avg")]
            pending = []
            for k, (n, dtype, op) in enumerate(specs):
                x, expected = inputs(group, n, dtype, op, salt=10 * trial + k)
                pending.append((x, expected, group.all_reduce(x, op=op, async_op=True)))
            if trial == 1:
                if group.rank == 0:  # the others reach the blocking call with calls queued
                    time.sleep(0.02)
                y, want = inputs(group, 10, "int64", "max", salt=97)
                assert_exact(group.all_reduce(y, op="max"), want)
                y, want = inputs(group, 40_000, "float32", "sum", salt=99)
                assert_exact(group.all_reduce(y), want)
                z, want = inputs(group, 4096 * group.world_size, "int32", "sum", salt=98)
                assert_exact(group.reduce_scatter(z), np.split(want, group.world_size)[group.rank])
                assert_exact(group.all_gather(np.full(4096, group.rank, np.int32)),
                             np.repeat(np.arange(group.world_size, dtype=np.int32), 4096))
            for x, expected, work in reversed(pending):
                if trial == 2:
                    while not work.test():
                        pass
                    assert_exact(work.result, expected)
                else:
                    assert_exact(work.wait(), expected)
                assert_exact(x, expected)
        if seen is not None:  # float16 widens to float32 (the general path): queued too
            assert len(seen) == 18 and 17 in seen
            if paths == "default":  # 17 int32, 3000 float16 (as float32), 33 float64: the mailbox
                assert group.backend._shm.small_bytes >= 3000 * 4
            assert not group.backend._shm._queue
            assert group.backend._shm.progress not in shm.monitor.PROGRESS
    finally:
        if seen is not None:
            del group.backend._shm.start_all_reduce


def test_a_rank_waiting_elsewhere_keeps_the_peers_transfer_moving(world):
    """Rank 0 waits for its nonblocking all_reduce; the other ranks first run blocking
    collectives on another group, which need rank 0 after its wait. The transfer completes only
    if their waits run the queue's progress (monitor.PROGRESS), as MPI's progress engine runs
    MPI requests: without it, this is a deadlock until the deadline."""
    group = forced_group(world, False)
    other = world.split(0)
    other.check = False
    old = group.timeout_s
    group.timeout_s = other.timeout_s = 20.0
    try:
        for rep in range(5):
            x, expected = inputs(group, 60_000, "float32", "sum", salt=rep)
            if group.rank == 0:  # launch last: the others' launches find rank 0 missing, so
                time.sleep(0.05)  # their part of the transfer runs only after they moved on
            work = group.all_reduce(x, async_op=True)
            if group.rank == 0:
                work.wait()
                other.all_reduce(np.ones(4))
                other.barrier()
            else:
                other.all_reduce(np.ones(4))
                other.barrier()
                work.wait()
            assert_exact(x, expected)
    finally:
        group.timeout_s = other.timeout_s = old


def test_mismatched_shapes_raise_on_every_rank_and_group_stays_usable(
        groups, assert_raised_on_every_rank):
    group = groups[True]
    if group.world_size == 1:
        pytest.skip("needs two ranks to disagree")
    x = np.ones(2048 + 1024 * group.rank, np.float32)
    error = assert_raised_on_every_rank(group, lambda: group.all_reduce(x), CollectiveMismatch)
    assert "all_reduce" in str(error) and "shape=(2048,)" in str(error)
    y, expected = inputs(group, 4097, "float32", "sum")
    assert_exact(group.all_reduce(y), expected)


@pytest.mark.parametrize("paths", ["compiled", "bounce", "python"])
@pytest.mark.parametrize("async_op", [False, True])
def test_unchecked_size_mismatch_on_the_cross_memory_path_raises_and_moves_nothing(
        world, assert_raised_on_every_rank, paths, async_op):
    """Checking off, rank r passes 20000 + 8000 r float32 (all above the mailbox): before, the
    ranks with the larger arrays wrote past the end of the smaller ones (a peer's memory
    silently overwritten, no error). Each rank publishes its array's size with its address, so
    every rank raises CollectiveMismatch naming the sizes, no byte past any array changes, and
    the group stays usable. paths: the compiled one-call path (Mailbox.cross, blocking or
    queued; through the system calls, or bounced through the shared slots) or the Python one
    (flag lines, or an all_gather of addresses where the mailbox is off)."""
    group = forced_group(world, False, compiled=paths != "python",
                         **(BOUNCE if paths == "bounce" else NO_BOUNCE))
    if group.world_size == 1:
        pytest.skip("needs two ranks to disagree")
    engine = group.backend._shm
    if async_op and not (engine and engine.queues(80_000)):
        pytest.skip("no queued nonblocking path here")
    n = 20_000 + 8_000 * group.rank
    backing = np.full(n + 40_000, 7.0, np.float32)  # the guard: what follows x in memory
    x = backing[:n]
    x[:] = 1.0

    def call():
        if async_op:
            group.all_reduce(x, async_op=True).wait()
        else:
            group.all_reduce(x)

    error = assert_raised_on_every_rank(group, call, CollectiveMismatch)
    text = str(error)  # the fingerprints (the compiled call), or the sizes (the Python one)
    assert "rank 0: all_reduce(count=20000," in text or "80000 bytes" in text, text
    assert (backing[n:] == 7.0).all() and (x == 1.0).all()
    y, expected = inputs(group, 30_001, "float32", "sum")
    assert_exact(group.all_reduce(y), expected)


@pytest.mark.parametrize("paths", ["compiled", "bounce", "python"])
def test_a_size_mismatch_holds_every_rank_until_the_slowest_has_seen_it(world, paths):
    """Checking off, rank 0 arrives last with 28000 float32, the others with 20000, and rank 1
    is slow to look (its wait sleeps 0.5 s once every rank has arrived); rank 0 then calls an
    all_reduce of the others' size. Before, the ranks that saw the mismatch raised at once and
    rank 0's next call published the others' size while rank 1 still compared this call's:
    rank 1 took it for a match and moved this call's data into rank 0's next array (here it
    then hung until the timeout). Now every rank raises CollectiveMismatch, and the next call
    is exact."""
    group = forced_group(world, False, compiled=paths != "python",
                         **(BOUNCE if paths == "bounce" else NO_BOUNCE))
    if group.world_size == 1:
        pytest.skip("needs two ranks to disagree")
    group.timeout_s = 20.0  # before: a CollectiveTimeout on every rank, not a hang of minutes
    engine = group.backend._shm
    x = np.ones(28_000 if group.rank == 0 else 20_000, np.float32)
    y, expected = inputs(group, 20_000, "float32", "sum")
    if group.rank == 0:
        time.sleep(0.2)  # the others wait for it in the deadline-aware wait
    elif group.rank == 1:
        watched = engine._watched

        def slow(poll):
            inner = watched(poll)
            return lambda: inner() and (time.sleep(0.5) or True)

        engine._watched = slow
    try:
        group.all_reduce(x)
        mismatch = None
    except CollectiveMismatch as exc:
        mismatch = exc
    finally:
        engine.__dict__.pop("_watched", None)
    out = group.all_reduce(y)
    flags = group.all_gather(np.array([mismatch is not None]))
    assert flags.all(), f"CollectiveMismatch only on ranks {np.flatnonzero(flags).tolist()}"
    assert (x == 1.0).all()
    assert_exact(out, expected)


@pytest.mark.parametrize("paths", ["default", "mpi"])
@pytest.mark.parametrize("dtype,op,base", [("int8", "sum", 100), ("uint8", "sum", 200),
                                           ("int8", "prod", 3), ("uint8", "prod", 7)])
def test_8_bit_sum_and_prod_wrap_like_numpy_on_every_path(world, paths, dtype, op, base):
    """int8 / uint8 sums and products that overflow: every size (mailbox, bounce, system calls;
    MPI's Iallreduce and Allreduce with the shared-memory paths off), blocking and async, and
    reduce_scatter, give numpy's wrapped result. Before, Open MPI's AVX op component saturated
    8-bit sums on the MPI paths (100 + 101 = 127 as int8) where the shared-memory ones wrapped."""
    group = group_with(world, enabled=paths == "default")
    group.all_reduce(np.zeros(1, np.float32))  # builds the engine, as a training step does
    n = group.world_size
    ufunc = np.add if op == "sum" else np.multiply
    for count in (100, 50_000, 400_000):
        terms = [np.full(count, base + r, dtype) for r in range(n)]
        want = terms[0].copy()
        for t in terms[1:]:
            want = ufunc(want, t)  # numpy: wraps
        for async_op in (False, True):
            x = terms[group.rank].copy()
            got = group.all_reduce(x, op=op, async_op=async_op)
            got = got.wait() if async_op else got
            assert_exact(got, want)
        shard = group.reduce_scatter(np.tile(terms[group.rank], n), op=op)
        assert_exact(shard, want)


def test_groups_with_one_rank_per_node_use_mpi(world):
    group = forced_group(world, False, node_size=1)
    x, expected = inputs(group, 3000, "float32", "sum")
    assert_exact(group.all_reduce(x), expected)
    assert group.backend._shm in (None, False)
    if group.world_size > 1:
        assert group.backend.shm_min_bytes == shm.NEVER


def test_disabled_path_is_never_selected(world):
    saved = shm.CONFIG
    shm.CONFIG = shm.ShmConfig(enabled=False, min_bytes=0, chunk_bytes=CHUNK)
    try:
        group = world.split(0)
    finally:
        shm.CONFIG = saved
    x, expected = inputs(group, 3000, "float32", "sum")
    assert_exact(group.all_reduce(x), expected)
    assert group.backend._shm is None


def test_messages_below_the_threshold_use_mpi(world):
    saved = shm.CONFIG
    shm.CONFIG = shm.ShmConfig(min_bytes=1 << 20, chunk_bytes=CHUNK, small_bytes=0)
    try:
        group = world.split(0)
    finally:
        shm.CONFIG = saved
    x, expected = inputs(group, 1000, "float32", "sum")
    assert_exact(group.all_reduce(x), expected)
    assert group.backend._shm is None  # never built: no call reached the threshold


def test_default_sizes_choose_mailbox_mpi_and_cross_memory_paths(world):
    """Default settings: up to small_bytes the mailbox, from all_reduce_from the cross-memory
    path, MPI in between. With the compiled cross-memory path the mailbox stops at
    CROSS_SMALL_BYTES and the cross-memory path takes every larger message (no MPI band); else
    the mailbox's size and DEFAULT_MIN_BYTES. Each path spied on; the results exact on every
    path."""
    group = group_with(world)
    x, expected = inputs(group, 16, "float32", "sum")
    assert_exact(group.all_reduce(x), expected)
    engine = group.backend._shm
    if group.world_size == 1:
        assert engine is None
        return
    mailbox = mailbox_possible(group.world_size)
    fast = mailbox and shm._mailbox is not None  # the compiled cross-memory path
    box = mailbox_bytes(group.world_size)
    start = box + 1 if fast else shm.DEFAULT_MIN_BYTES
    assert (engine.small_bytes, engine.mode, engine.all_reduce_from) == (
        box if mailbox else -1, "cma", start)
    taken = []

    def spy(real, name):
        return lambda *a, **k: taken.append(name) or real(*a, **k)

    class Mailbox:  # the compiled mailbox (a C type: spied on through this stand-in)
        def __init__(self, real):
            self.real, self.all_reduce = real, spy(real.all_reduce, "small_all_reduce")
            self.arrived, self.finish = real.arrived, real.finish
            self.cross, self.cross_ready, self.last_call = real.cross, real.cross_ready, real.last_call

        def __getattr__(self, name):  # what a wait that lasts may call too (calls, box_keys...)
            return getattr(self.real, name)

    compiled = engine.mailbox
    engine.small_all_reduce = spy(engine.small_all_reduce, "small_all_reduce")
    engine.all_reduce = spy(engine.all_reduce, "all_reduce")
    if compiled is not None:
        engine.mailbox = Mailbox(compiled)
    small, large = max(engine.small_bytes, 16) // 4, shm.DEFAULT_MIN_BYTES // 4
    try:
        for length, salt in ((small, 1), (small + 1, 2), (large - 1, 3), (large, 4)):
            x, expected = inputs(group, length, "float32", "sum", salt=salt)
            assert_exact(group.all_reduce(x), expected)
    finally:
        del engine.small_all_reduce, engine.all_reduce
        engine.mailbox = compiled
    if fast:  # no MPI band: cross-memory from small + 1
        assert taken == ["small_all_reduce", "all_reduce", "all_reduce", "all_reduce"]
    else:
        assert taken == ["small_all_reduce", "all_reduce"] if mailbox else ["all_reduce"]


def test_a_first_all_reduce_of_any_size_builds_the_engine_by_default(world):
    """With RTXMPI_SHM_MIN_BYTES unset, a group whose first (and only) all_reduces lie between
    the 1 MiB mailbox default and 2 MiB still gets its engine, and with the compiled call the
    cross-memory path for them."""
    group = group_with(world)
    x, expected = inputs(group, (3 << 20) // 8, "float32", "sum")  # 1.5 MiB
    assert_exact(group.all_reduce(x), expected)
    engine = group.backend._shm
    if group.world_size == 1:
        assert engine is None
        return
    assert isinstance(engine, shm.NodeAllReduce)
    if engine.mailbox is not None:
        assert engine.all_reduce_from <= x.nbytes


def test_mailbox_off_leaves_small_messages_to_mpi(world):
    """RTXMPI_SHM_SMALL_BYTES=0 with the start left automatic: MPI up to CROSS_SMALL_BYTES (not
    the cross-memory path down to one byte, where its two synchronizations cost more)."""
    group = group_with(world, small_bytes=0)
    x, expected = inputs(group, 100_000, "float32", "sum")
    assert_exact(group.all_reduce(x), expected)
    engine = group.backend._shm
    if group.world_size > 1:
        assert engine.small_bytes == -1
        want = shm.CROSS_SMALL_BYTES + 1 if engine.mailbox is not None else shm.DEFAULT_MIN_BYTES
        assert engine.all_reduce_from == want


def test_a_set_cross_memory_start_keeps_the_mailbox_up_to_its_default(world):
    """RTXMPI_SHM_MIN_BYTES set (1 MiB here): the cross-memory path starts there, and the mailbox
    keeps its 1 MiB default below it (not the 32 KiB it stops at when the start is automatic)."""
    group = group_with(world, min_bytes=1 << 20)
    x, expected = inputs(group, 100, "float32", "sum")
    assert_exact(group.all_reduce(x), expected)
    engine = group.backend._shm
    if group.world_size > 1:
        box = min(shm.DEFAULT_SMALL_BYTES,
                  shm.MAILBOX_READ_BYTES // group.world_size // shm.FLAG_BYTES * shm.FLAG_BYTES)
        assert engine.small_bytes == (box if mailbox_possible(group.world_size) else -1)
        assert engine.all_reduce_from == 1 << 20


def test_shared_arrays_fold_straight_from_the_peers_memory(world):
    """Arrays from rtxmpi.shared_zeros on every rank: blocking and nonblocking all_reduce of the
    whole array and of slices (buckets) fold straight from the peers' memory (direct_calls), with
    exact results; when one rank passes a plain array, every rank takes the system-call path,
    still exact."""
    group = group_with(world)
    x, expected = inputs(group, 100, "float32", "sum")
    assert_exact(group.all_reduce(x), expected)  # builds the engine
    engine = group.backend._shm
    direct = engine.mailbox.direct_calls if engine and engine.mailbox is not None else None
    for salt, (n, dtype, op) in enumerate([(300_001, "float32", "sum"), (70_000, "int64", "max"),
                                           (50_000, "float64", "prod")]):
        x, expected = inputs(group, n, dtype, op, salt=salt)
        shared = shm.shared_zeros(n, dtype)
        shared[:] = x
        before = direct() if direct else 0
        assert_exact(group.all_reduce(shared, op=op), expected)
        y, want = inputs(group, 20_000, dtype, op, salt=salt + 10)
        bucket = shared[n // 4: n // 4 + 20_000]
        bucket[:] = y
        assert_exact(group.all_reduce(bucket, op=op, async_op=True).wait(), want)
        if direct:
            assert direct() == before + 2
    plain = group.rank == group.world_size - 1
    x, expected = inputs(group, 60_000, "float32", "sum", salt=99)
    mixed = x if plain else shm.shared_zeros(60_000, "float32")
    mixed[:] = x
    before = direct() if direct else 0
    assert_exact(group.all_reduce(mixed), expected)
    if direct:
        assert direct() == before  # the same choice on every rank


@pytest.mark.parametrize("env,message", [
    ({"RTXMPI_SHM": "maybe"}, "RTXMPI_SHM='maybe'"),
    ({"RTXMPI_SHM_CMA": "2"}, "RTXMPI_SHM_CMA='2'"),
    ({"RTXMPI_SHM_MIN_BYTES": "1M"}, "RTXMPI_SHM_MIN_BYTES='1M' is not an integer"),
    ({"RTXMPI_SHM_CHUNK_BYTES": "100"}, "RTXMPI_SHM_CHUNK_BYTES='100' must be >= 4096"),
    ({"RTXMPI_SHM_NODE_SIZE": "0"}, "RTXMPI_SHM_NODE_SIZE='0' must be >= 1"),
    ({"RTXMPI_SHM_SMALL_BYTES": "999999999999999999999"}, "must be >= 0 and <= 268435456"),
    ({"RTXMPI_SHM_CHUNK_BYTES": "1e6"}, "RTXMPI_SHM_CHUNK_BYTES='1e6' is not an integer"),
    ({"RTXMPI_SHM_BOUNCE_BYTES": "-1"}, "RTXMPI_SHM_BOUNCE_BYTES='-1' must be >= 0"),
])
def test_bad_settings_raise_config_error(env, message):
    from rtxmpi.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        shm.ShmConfig.from_env(env)
    assert message in str(info.value)


def test_settings_from_environment():
    config = shm.ShmConfig.from_env({"RTXMPI_SHM": "0", "RTXMPI_SHM_MIN_BYTES": "4096",
                                     "RTXMPI_SHM_CHUNK_BYTES": "65539", "RTXMPI_SHM_NODE_SIZE": "2",
                                     "RTXMPI_SHM_CMA": "off", "RTXMPI_SHM_SMALL_BYTES": "0",
                                     "RTXMPI_SHM_BOUNCE_BYTES": "1001"})
    assert (config.enabled, config.min_bytes, config.chunk_bytes, config.node_size, config.cma,
            config.small_bytes, config.bounce_bytes) == (False, 4096, 65536, 2, False, 0, 1001)
    assert config.threshold == shm.NEVER
    default = shm.ShmConfig.from_env({})
    assert default.enabled and default.cma and default.threshold == shm.DEFAULT_MIN_BYTES
    assert default.small_threshold == shm.DEFAULT_SMALL_BYTES
    assert default.bounce_bytes == shm.DEFAULT_BOUNCE_BYTES


class _Tagged(np.ndarray):
    """An ndarray subclass (as np.memmap): the general path, where a plain array goes fast."""


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [16, shm.DEFAULT_SMALL_BYTES // 4 + 1, shm.DEFAULT_MIN_BYTES // 4],
                         ids=["mailbox", "mpi", "cross-memory"])
@pytest.mark.parametrize("how", ["strided", "subclass"])
def test_ranks_passing_different_layouts_run_the_same_algorithm(world, n, how):
    # rank 1's array is strided or a subclass (the general path), the others' plain and contiguous
    # (the fast path): both paths must synchronize alike, call after call
    group = world.split(0)
    group.check = False
    for call in range(3):
        if group.rank != 1:
            x = np.full(n, group.rank + call, np.float32)
        elif how == "strided":
            x = np.zeros((n, 2), np.float32)[:, 0]
            x[...] = group.rank + call
        else:
            x = np.full(n, group.rank + call, np.float32).view(_Tagged)
        group.all_reduce(x)
        expected = sum(range(group.world_size)) + call * group.world_size
        assert np.all(np.asarray(x) == expected), call


@pytest.mark.mpi(min_size=2)
def test_close_unmaps_the_mailbox(world):
    group = world.split(0)
    group.check = False
    group.all_reduce(np.ones(8, np.float32))  # builds the engine (mailbox size)
    engine = group.backend._shm
    if not engine or engine.small_bytes <= 0:
        pytest.skip("no mailbox on this node (ULFM, or no compiled mailbox off x86)")
    box = engine._box_mm
    engine.close()
    assert box.closed


@pytest.mark.mpi(min_size=2)
def test_ranks_pinned_to_one_cpu_keep_the_mailbox_and_stay_exact(world):
    """Every local rank pinned to one CPU (as under `taskset -c 0`): the mailbox's spin yields
    the core to the peer it waits for, so the group keeps the shared-memory paths (before the
    yield, such ranks took MPI's: a pure spin ran at 0.25x raw at 8 B, F9)."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity here")
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})
    try:
        group = world.split(0)
        group.check = False
        for count in (16, 3000, 200_000):  # mailbox twice, then cross-memory (the system calls:
            # the ranks share a CPU, so no bounce)
            x, expected = inputs(group, count, "float32", "sum")
            for _ in range(3):
                y = x.copy()
                assert_exact(group.all_reduce(y), expected)
        engine = group.backend._shm
        if engine and mailbox_possible(group.world_size):
            assert engine.mailbox_off is None and engine.small_bytes > 0, engine
    finally:
        os.sched_setaffinity(0, saved)


@pytest.mark.mpi(min_size=2)
def test_a_dev_shm_too_small_for_the_mailbox_warns_and_uses_mpi(world, monkeypatch):
    import errno
    import warnings

    if not mailbox_possible(world.world_size):
        pytest.skip("no mailbox on this node (not Linux, or no compiled mailbox off x86)")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    group = world.split(0)
    group.check = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, expected = inputs(group, 16, "float32", "sum")
        assert_exact(group.all_reduce(x), expected)  # MPI's path, still right
    assert group.backend._shm.small_bytes == -1
    said = [str(w.message) for w in caught if "could not hold the all_reduce mailbox" in str(w.message)]
    assert len(said) == (1 if group.rank == 0 else 0), said


@pytest.mark.mpi(min_size=2)
def test_a_dev_shm_too_small_for_the_bounce_slots_keeps_the_mailbox(world, monkeypatch):
    """/dev/shm holds the mailbox but not the bounce slots too: the engine keeps the mailbox,
    drops the bounce (no warning), and an all_reduce of a bounce size takes the system calls."""
    import errno
    import warnings

    if not mailbox_possible(world.world_size, compiled=True) or shm._mailbox is None:
        pytest.skip("no compiled mailbox on this node")
    fallocate = shm.os.posix_fallocate

    def no_room_for_the_slots(fd, offset, length):
        if length >= 2 * 2 * 4096:  # the slots (chunk 4 KiB), not the mailbox (about 5 KiB)
            raise OSError(errno.ENOSPC, "No space left on device")
        return fallocate(fd, offset, length)

    monkeypatch.setattr(shm.os, "posix_fallocate", no_room_for_the_slots)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = forced_group(world, False, small_bytes=1024, chunk_bytes=4096, **BOUNCE)
    engine = group.backend._shm
    if engine.mode != "cma":
        pytest.skip("no cross-memory access here: no bounce slots to drop")
    assert engine.small_bytes == 1024 and engine.bounce_bytes == 0, engine
    assert not [w for w in caught if "mailbox" in str(w.message)]
    x, expected = inputs(group, 20_000, "float32", "sum")
    assert_exact(group.all_reduce(x), expected)


@pytest.mark.mpi(min_size=2)
def test_bounce_pieces_keep_every_flag_line_on_a_cache_line_and_the_limit_holds(world):
    """A chunk that is no multiple of the flag line (4104 bytes) gives bounce pieces of whole
    flag lines (4096), so every local rank's flag line starts a cache line of its own, as with
    the mailbox slots; RTXMPI_SHM_BOUNCE_BYTES=1000 bounces 250 float32 (in rounds of at most
    1024 elements per segment), not 251."""
    group = forced_group(world, False, chunk_bytes=4104, bounce_bytes=1000, bounce_any_cpu=True)
    engine = group.backend._shm
    if not engine or engine.mailbox is None or engine.mode != "cma":
        pytest.skip("no compiled mailbox or no cross-memory access on this node")
    n = engine.local_size
    assert engine.bounce_bytes == 1000, engine
    assert engine._lines.shape[1] * 8 == shm.FLAG_BYTES + 2 * n * 4096
    assert all(engine._lines[j].ctypes.data % 64 == 0 for j in range(n))
    for length, bounced in ((250, 1), (251, 0)):
        before = engine.mailbox.bounce_calls()
        x, expected = inputs(group, length, "float32", "sum")
        assert_exact(group.all_reduce(x), expected)
        assert engine.mailbox.bounce_calls() - before == bounced


@pytest.mark.mpi(min_size=2)
def test_ranks_follow_local_rank_0s_choice_call_by_call_with_the_same_bits(world):
    """Local rank 0 picks bounce or the system calls for every call (a stand-in for the tuner
    picking at random) and the other ranks follow its flag line: every rank counts the same
    bounced calls, each call is exact (the two algorithms fold each segment in the same order),
    and rank 0's records name what ran. Sizes from one round to many (chunk 4 KiB)."""
    group = forced_group(world, False, chunk_bytes=4096, bounce_any_cpu=True)
    engine = group.backend._shm
    if not engine or engine.mailbox is None or engine.mode != "cma":
        pytest.skip("no compiled mailbox or no cross-memory access on this node")
    rng = np.random.default_rng(7)
    picks = rng.integers(0, 2, 40)
    records = []

    class Picker:  # OnlineChoice's interface
        def __init__(self):
            self.calls = 0

        def pick(self, nbytes, choices):
            self.calls += 1
            return choices[picks[self.calls - 1]]

        def record(self, nbytes, choices, algorithm, seconds):
            records.append(algorithm)

    if engine.local_rank == 0:
        engine._tuner = Picker()
    before = engine.mailbox.bounce_calls()
    for call, length in enumerate(rng.integers(9000, 60000, len(picks))):
        x, expected = inputs(group, int(length), "float64", "sum", salt=call)
        assert_exact(group.all_reduce(x), expected)
    bounced = engine.mailbox.bounce_calls() - before
    assert group.backend.comm.allgather(bounced) == [int(picks.sum())] * group.world_size
    if engine.local_rank == 0:
        assert records == [int(p) for p in picks]
    engine._tuner = None


@pytest.mark.mpi(min_size=2)
def test_the_tuner_picks_only_up_to_bounce_bytes(world):
    """Above RTXMPI_SHM_BOUNCE_BYTES only the system calls may run: local rank 0's tuner is not
    asked (it would pick the bounce, see it never run, and never choose); up to it, it is."""
    group = forced_group(world, False, bounce_bytes=16384)
    engine = group.backend._shm
    if not engine or engine.mailbox is None or engine.mode != "cma":
        pytest.skip("no compiled mailbox or no cross-memory access on this node")
    before = engine.mailbox.bounce_calls()
    for call in range(12):
        x, expected = inputs(group, 8192, "float32", "sum", salt=call)  # 32 KiB
        assert_exact(group.all_reduce(x), expected)
    assert engine.mailbox.bounce_calls() == before
    if engine.local_rank == 0:
        seen = lambda: {bits for bits, _ in engine._tuner._classes}  # noqa: E731
        assert (32768).bit_length() not in seen()
        group.all_reduce(np.zeros(2048, np.float32))  # 8 KiB: asked
        assert (8192).bit_length() in seen()
    else:
        group.all_reduce(np.zeros(2048, np.float32))


def test_info_says_which_all_reduce_paths_the_group_runs(world):
    from rtxmpi.cli import _all_reduce_paths

    group = world.split(0)
    text = _all_reduce_paths(group)
    if group.world_size == 1:
        assert text == "one rank: no transfer"
    elif mailbox_possible(group.world_size):
        assert text.startswith(f"mailbox (compiled) up to {mailbox_bytes(group.world_size)} bytes")
        assert "async_op=True: queued on the same paths" in text, text
    else:
        assert text.startswith("no mailbox ("), text


class _NoPickling:
    """A communicator that refuses mpi4py's pickling (lowercase) calls and wraps the
    communicators its methods return."""

    PICKLING = {"bcast", "allgather", "allreduce", "gather", "scatter", "alltoall", "reduce",
                "send", "recv", "sendrecv", "isend", "irecv", "exscan", "scan"}

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        if name in self.PICKLING:
            raise AssertionError(f"the set-up pickled a Python object: comm.{name}()")
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            out = attr(*(a._comm if isinstance(a, _NoPickling) else a for a in args), **kwargs)
            return _NoPickling(out) if isinstance(out, MPI.Comm) and out != MPI.COMM_NULL else out

        return call

    def __eq__(self, other):
        return self._comm == getattr(other, "_comm", other)


def test_the_set_up_sends_typed_buffers_only(world):
    """configure() and NodeAllReduce.create() exchange typed buffers (Allgather, Allreduce, Bcast
    of int64 and bytes): before, they pickled Python objects (comm.allgather, bcast, allreduce)."""
    comm = world.backend.comm.Dup()
    saved = shm.CONFIG
    try:
        config = shm.configure(_NoPickling(comm))
        assert repr(config) == repr(shm.ShmConfig.from_env())
        engine = shm.NodeAllReduce.create(_NoPickling(comm), shm.ShmConfig(),
                                          list(range(world.world_size)))
        if engine:
            engine.close()
    finally:
        shm.CONFIG = saved
        comm.Free()
