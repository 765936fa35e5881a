"""The compiled mailbox all_reduce (rtxmpi/comm/_mailbox.c), in one process: k Mailbox views of
one mapping play k local ranks, posting one after another, so the late-peer path (all_reduce
returns the call number, then arrived() and finish()) and the direct path (the last rank to post
finds every flag raised) both run. Results must be bitwise numpy's left fold in local-rank order,
the reference the numpy mailbox of rtxmpi/comm/shm.py computes."""
import mmap

import numpy as np
import pytest
from mpi4py import MPI

from rtxmpi.comm import shm

OPS = {"sum": (MPI.SUM, np.add), "max": (MPI.MAX, np.maximum), "min": (MPI.MIN, np.minimum),
       "prod": (MPI.PROD, np.multiply)}
OP_OBJECTS = (MPI.SUM, MPI.MAX, MPI.MIN, MPI.PROD)
SLOT = 4096


def test_extension_is_built():
    # pip install builds it (pyproject.toml ext-modules); without it every all_reduce up to 1 MiB
    # falls back to MPI or the numpy mailbox, several times slower
    assert shm._mailbox is not None, "rtxmpi/comm/_mailbox.c was not compiled: pip install -e ."
    assert shm.DEFAULT_SMALL_BYTES == 1 << 20


def boxes(k, slot=SLOT):
    mapping = mmap.mmap(-1, k * (shm.FLAG_BYTES + 2 * slot))
    return mapping, [shm._mailbox.Mailbox(mapping, k, j, slot, OP_OBJECTS) for j in range(k)]


def run_call(views, xs, op):
    """Every view posts its array in turn (no spinning); the ones that found a peer missing
    finish afterwards. Returns the call numbers all_reduce returned."""
    returned = [view.all_reduce(x, op, 0) for view, x in zip(views, xs)]
    for view, x, call in zip(views, xs, returned):
        if call:
            assert view.arrived(call)
            view.finish(x, op, call)
    return returned


def values(rng, dtype, n):
    if np.dtype(dtype).kind == "f":
        x = rng.standard_normal(n).astype(dtype)
        x[::17] = np.nan  # max/min propagate NaN, as numpy does
        return x
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), n, endpoint=True).astype(dtype)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint8", "int16", "uint16",
                                   "int32", "uint32", "int64", "uint64"])
@pytest.mark.parametrize("name", list(OPS))
def test_bitwise_numpy_left_fold_in_rank_order(k, dtype, name):
    op, ufunc = OPS[name]
    rng = np.random.default_rng(k)
    mapping, views = boxes(k)
    for call in (1, 2, 3):  # both slot parities, and a parity reused
        n = (SLOT // np.dtype(dtype).itemsize) - call  # up to the slot size
        xs = [values(rng, dtype, n) for _ in range(k)]
        expected = ufunc(xs[0], xs[1])
        for x in xs[2:]:
            expected = ufunc(expected, x)
        returned = run_call(views, xs, op)
        assert returned == [call] * (k - 1) + [0]
        for x in xs:
            np.testing.assert_array_equal(x.view(np.uint8), expected.view(np.uint8))
    for view in views:
        view.close()
    mapping.close()  # nothing holds the mapping any more


def test_float_sum_depends_on_rank_order_and_matches_it():
    # 1e8 + 1 - 1e8 in float32: (t0 + t1) + t2 differs from t0 + (t1 + t2); the fold is rank order
    mapping, views = boxes(3)
    xs = [np.array([1e8], np.float32), np.array([1.0], np.float32), np.array([-1e8], np.float32)]
    run_call(views, xs, MPI.SUM)
    assert [float(x[0]) for x in xs] == [0.0] * 3


def test_errors_are_typed_and_leave_the_array_untouched():
    mapping, (a, b) = boxes(2, slot=64)
    x = np.arange(8, dtype=np.float64)
    with pytest.raises(ValueError, match="does not fit"):
        a.all_reduce(np.zeros(9, np.float64), MPI.SUM, 0)  # 72 bytes > 64
    with pytest.raises(ValueError, match="does not fit"):
        a.all_reduce(np.zeros(2, np.complex64), MPI.SUM, 0)
    with pytest.raises(ValueError, match="none of sum"):
        a.all_reduce(x, MPI.BAND, 0)
    with pytest.raises(ValueError, match="contiguous"):
        a.all_reduce(np.zeros(4)[::2], MPI.SUM, 0)  # not contiguous
    call = a.all_reduce(x, MPI.SUM, 0)
    assert call == 1 and not a.arrived(call)
    with pytest.raises(RuntimeError, match="before every peer arrived"):
        a.finish(x, MPI.SUM, call)
    np.testing.assert_array_equal(x, np.arange(8))  # nothing reduced yet
    assert b.all_reduce(np.ones(8), MPI.SUM, 1000) == 0
    a.finish(x, MPI.SUM, call)
    np.testing.assert_array_equal(x, np.arange(8) + 1)
    a.close()
    with pytest.raises(ValueError, match="closed"):
        a.all_reduce(x, MPI.SUM, 0)
    with pytest.raises(ValueError, match="bad layout"):
        shm._mailbox.Mailbox(mapping, 2, 2, 64, OP_OBJECTS)
    with pytest.raises(ValueError, match="smaller than"):
        shm._mailbox.Mailbox(mapping, 2, 0, 128, OP_OBJECTS)
    with pytest.raises(ValueError, match="bad layout"):  # 2 x (64 + 2 x 2**62) wraps to 128
        shm._mailbox.Mailbox(mapping, 2, 0, 1 << 62, OP_OBJECTS)
    b.close()
    mapping.close()


def test_spin_gives_up_after_its_time():
    import time

    mapping, (a, _) = boxes(2)
    t0 = time.perf_counter()
    assert a.all_reduce(np.ones(4, np.float32), MPI.SUM, 2_000_000) == 1  # 2 ms, no peer
    assert 0.002 <= time.perf_counter() - t0 < 1.0
    a.close()


def test_a_full_dev_shm_gives_no_mapping_and_leaves_no_file(monkeypatch, tmp_path):
    # tmpfs allocates pages at first touch: without the reservation, a /dev/shm too small for the
    # mailbox would kill the rank with SIGBUS inside the first all_reduce
    import errno
    import os

    monkeypatch.setattr(shm, "_arena_dir", lambda: str(tmp_path))
    mapping = shm._map_arena(MPI.COMM_SELF, MPI.COMM_SELF, 1 << 16)
    assert len(mapping) == 1 << 16 and os.listdir(tmp_path) == []  # unlinked once mapped
    mapping.close()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    assert shm._map_arena(MPI.COMM_SELF, MPI.COMM_SELF, 1 << 16) is None
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", ["max", "min"])
def test_max_min_ties_of_signed_zeros_match_numpy(dtype, name):
    # max(0.0, -0.0) compares equal: numpy returns its second operand, bit for bit
    op, ufunc = OPS[name]
    mapping, views = boxes(2)
    zeros = np.array([0.0, -0.0], dtype)
    xs = [np.resize(zeros, 33), np.resize(zeros[::-1], 33)]
    expected = ufunc(xs[0], xs[1])
    run_call(views, xs, op)
    for x in xs:
        np.testing.assert_array_equal(np.signbit(x), np.signbit(expected))


@pytest.mark.parametrize("dtype", ["int16", "uint16", "int32", "uint32", "int64", "uint64"])
@pytest.mark.parametrize("name", ["sum", "prod"])
def test_integer_overflow_wraps_as_numpy(dtype, name):
    # C's signed (and promoted unsigned short) overflow is undefined; the fold wraps like numpy
    op, ufunc = OPS[name]
    info = np.iinfo(dtype)
    mapping, views = boxes(2)
    edge = np.array([info.max, info.max - 1, info.min, info.min + 1, -1 % (info.max + 1), 3],
                    np.int64 if info.min < 0 else np.uint64)
    xs = [edge.astype(dtype), edge[::-1].astype(dtype)]
    with np.errstate(over="ignore"):
        expected = ufunc(xs[0], xs[1])
    run_call(views, xs, op)
    for x in xs:
        np.testing.assert_array_equal(x, expected)


def test_init_again_keeps_the_op_references_balanced():
    import sys

    mapping, (a, b) = boxes(2)
    a.close()
    before = sys.getrefcount(MPI.SUM)
    for _ in range(10):
        a.__init__(mapping, 2, 0, SLOT, OP_OBJECTS)
        a.close()
    after = sys.getrefcount(MPI.SUM)  # (not inside the assert: pytest's rewrite holds a reference)
    assert after == before
    b.close()
    mapping.close()


# -- Mailbox.cross: the whole one-node cross-memory all_reduce in one call ----------------------
def cross_boxes(k, pids=None, bounce=0, **options):
    """k views of one flag mapping (no mailbox slots; a bounce slot of `bounce` bytes each),
    every "local rank" this process, so each view's process_vm_readv / writev reach the others'
    arrays here. They share a CPU: options (bounce_max, bounce_any_cpu) default to bouncing
    every array anyway."""
    import os

    mapping = mmap.mmap(-1, k * (shm.FLAG_BYTES + bounce))
    pids = pids or [os.getpid()] * k
    options.setdefault("bounce_any_cpu", True)
    return mapping, [shm._mailbox.Mailbox(mapping, k, j, 0, OP_OBJECTS, pids, bounce, **options)
                     for j in range(k)]


def close_boxes(mapping, views):
    """Close every view of cross_boxes, then the mapping they share."""
    for view in views:
        view.close()
    mapping.close()


def assert_same_bits(arrays, expected):
    """Every array holds `expected` bit for bit."""
    for x in arrays:
        np.testing.assert_array_equal(x.view(np.uint8), expected.view(np.uint8))


def cross_expected(xs, ufunc):
    """Segment i (elements [n * i // k, n * (i + 1) // k)) is folded by local rank i: its own
    value first, then the others in local-rank order."""
    k, n = len(xs), xs[0].size
    out = np.empty_like(xs[0])
    for i in range(k):
        lo, hi = n * i // k, n * (i + 1) // k
        acc = xs[i][lo:hi].copy()
        for j in range(k):
            if j != i:
                acc = ufunc(acc, xs[j][lo:hi])
        out[lo:hi] = acc
    return out


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int16", "uint64"])
@pytest.mark.parametrize("name", list(OPS))
def test_cross_reduces_every_segment_and_pushes_it_to_every_peer(k, dtype, name):
    """Views post one after another, so every status runs: 1 (a peer has not arrived: resume
    later), 2 (folded and pushed, a peer not done) and 0; pieces (tmp of 7 elements) smaller than
    the segments; sizes that do not divide by k."""
    op, ufunc = OPS[name]
    rng = np.random.default_rng(k)
    mapping, views = cross_boxes(k)
    tmp = np.zeros(7 * np.dtype(dtype).itemsize, np.uint8)
    for call, n in ((1, 1000), (2, 37), (3, 2)):
        xs = [values(rng, dtype, n) for _ in range(k)]
        expected = cross_expected(xs, ufunc)
        run_cross(views, xs, op, call, tmp, expected)
    close_boxes(mapping, views)


def run_cross(views, xs, op, call, tmp, expected):
    """Every view posts call `call` in turn (no spin), then all but the last resume: the first
    k - 1 find a peer missing (1), the last folds and finds one not done (2), and the resumed
    ones fold in turn, the last of them finding every peer done (0). Then every array holds
    `expected`, bit for bit."""
    k = len(views)
    first = [view.cross(x, op, call, tmp, 0, False, True) for view, x in zip(views, xs)]
    resumed = [view.cross(x, op, call, tmp, 0, True, True) for view, x in zip(views[:-1], xs)]
    assert first == [1] * (k - 1) + [2] and resumed == [2] * (k - 2) + [0]
    assert all(view.cross_reached(3, call) and view.cross_reached(1, call) for view in views)
    assert_same_bits(xs, expected)


def drive_cross(views, xs, op, call, tmp, wishes=None):
    """Run call `call` on every view round-robin, each resuming at the stage its last status
    waits for (shm._CROSS_WAITS), until every view returned 0 (wishes: each view's bounce
    argument, default True). Returns the statuses seen."""
    seen, stage, pending = [], [0] * len(views), list(range(len(views)))
    wishes = wishes or [True] * len(views)
    for _ in range(10 * len(views) * (xs[0].size + 1)):  # a round per piece: at most size rounds
        for j in list(pending):
            status = views[j].cross(xs[j], op, call, tmp, 0, stage[j], wishes[j])
            seen.append(status)
            if status == 0:
                pending.remove(j)
            else:
                stage[j] = shm._CROSS_WAITS[status]
        if not pending:
            return seen
    raise AssertionError(f"cross() did not complete: statuses {seen}")


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int16", "uint64"])
@pytest.mark.parametrize("name", list(OPS))
def test_cross_bounce_pipelines_any_size_in_rounds_with_the_same_bits(k, dtype, name):
    """Bounce slots of one 128-byte piece per rank and round parity: arrays of bounce_max (2000
    bytes) or less bounce in rounds of one piece per segment (status 4 shows: a view waits for
    a peer's round; many rounds for the larger arrays), larger ones take the system calls;
    either way every array holds the same bits as cross_expected (own segment first, then the
    peers in order): the two algorithms are interchangeable call by call."""
    op, ufunc = OPS[name]
    rng = np.random.default_rng(k + 10)
    mapping, views = cross_boxes(k, bounce=2 * k * 128, bounce_max=2000)
    tmp = np.zeros(7 * np.dtype(dtype).itemsize, np.uint8)
    itemsize = np.dtype(dtype).itemsize
    bounced = 0
    for call, n in enumerate((1000, 37, 2000 // itemsize, 2000 // itemsize + 1, 2, 1, 250),
                             start=1):
        xs = [values(rng, dtype, n) for _ in range(k)]
        expected = cross_expected(xs, ufunc)
        seen = drive_cross(views, xs, op, call, tmp)
        assert (4 in seen) == (n * itemsize <= 2000), (n, seen)
        bounced += n * itemsize <= 2000
        assert all(view.bounce_calls() == bounced for view in views)
        assert all(view.last_call()[0] == (n * itemsize <= 2000) for view in views)
        assert_same_bits(xs, expected)
    close_boxes(mapping, views)


@pytest.mark.parametrize("k", [2, 3])
def test_cross_bounces_only_when_every_view_may_and_their_cpus_differ(k):
    """The views share this process's CPU: without bounce_any_cpu no call bounces (the system
    calls let a rank fold while its peer is descheduled), and with it a call bounces only when
    every view passed bounce=True (a nonblocking call passes False on its rank)."""
    rng = np.random.default_rng(k)
    tmp = np.zeros(64, np.uint8)
    for any_cpu, wishes, bounce in ((False, [True] * k, False), (True, [True] * k, True),
                                    (True, [True] * (k - 1) + [False], False)):
        mapping, views = cross_boxes(k, bounce=2 * k * 128, bounce_any_cpu=any_cpu)
        xs = [values(rng, "float32", 300) for _ in range(k)]
        expected = cross_expected(xs, np.add)
        drive_cross(views, xs, MPI.SUM, 1, tmp, wishes)
        assert [view.bounce_calls() for view in views] == [int(bounce)] * k
        assert_same_bits(xs, expected)
        close_boxes(mapping, views)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [2, 3])
def test_cross_views_a_call_apart_leave_every_slot_until_its_peers_read_it(k, seed):
    """Each view runs its own calls (bounced or through the system calls, sizes that do not
    divide by k) and starts the next as soon as one returned 0, the views stepped in a random
    order: a view posts call c + 1 while a peer still has to copy call c's segments out of the
    slots. No view rewrites its slot before its peers have read it, so every call's arrays hold
    cross_expected's bits (a copy-in ahead of the arrival check fails most seeds)."""
    rng = np.random.default_rng(seed)
    mapping, views = cross_boxes(k, bounce=2 * k * 128, bounce_max=2000)
    tmp = np.zeros(28, np.uint8)
    sizes = [500, 250, 501, 37, 500, 1, 499, 500]  # float32: up to 500 elements bounce
    calls = [[values(rng, "float32", n) for _ in range(k)] for n in sizes]
    expected = [cross_expected(xs, np.add) for xs in calls]
    index, stage, ahead = [0] * k, [0] * k, 0
    while min(index) < len(calls):
        j = int(rng.choice([j for j in range(k) if index[j] < len(calls)]))
        c = index[j]
        ahead += stage[j] == 0 and any(index[i] < c for i in range(k))
        status = views[j].cross(calls[c][j], MPI.SUM, c + 1, tmp, 0, stage[j], True)
        index[j] += status == 0
        stage[j] = 0 if status == 0 else shm._CROSS_WAITS[status]
    assert ahead  # the interleaving this test is about happened
    for xs, want in zip(calls, expected):
        assert_same_bits(xs, want)
    close_boxes(mapping, views)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [2, 3, 4])
def test_cross_random_interleavings_of_bounced_system_call_and_mismatched_calls(k, seed):
    """Many calls, each view stepped one cross() at a time in a random order (a view starts its
    next call as soon as one ended): sizes from none to many bounce rounds (float32 and float64,
    pieces of 128 bytes), some above bounce_max (the system calls), some with one view passing
    bounce=False (a nonblocking call, or local rank 0's tuner saying no: the system calls on
    every view) and some whose sizes differ on one view (3 on every view, nothing moved). Every
    view must make the same choice for every call (bounce_calls agree), every reduced call hold
    cross_expected's bits and every mismatched call its inputs: a slot rewritten before its
    peers read it, a flag read after a peer moved on to its next call, or a round counter out of
    step after a call that did not bounce fails most seeds."""
    rng = np.random.default_rng(1000 * k + seed)
    mapping, views = cross_boxes(k, bounce=2 * k * 128, bounce_max=4000)
    tmp = np.zeros(40, np.uint8)
    calls = []  # (arrays by view, wishes by view, expected (None: a mismatch), bounces, inputs)
    for _ in range(40):
        dtype = rng.choice(["float32", "float64"])
        n = int(rng.choice([0, 1, k - 1, 7, 31, 32, 33, 100, 257, 400, 500, 501, 1000, 1100]))
        sizes = [n] * k
        mismatch = rng.random() < 0.15
        if mismatch:
            sizes[int(rng.integers(k))] = n + 1 + int(rng.integers(3))
        wishes = [bool(rng.random() < 0.9) for _ in range(k)]
        xs = [values(rng, dtype, size) for size in sizes]
        expected = None if mismatch else cross_expected(xs, np.add)
        bounces = (not mismatch and all(wishes) and n > 0
                   and n * np.dtype(dtype).itemsize <= 4000)
        calls.append((xs, wishes, expected, bounces, [x.copy() for x in xs]))
    index, stage, seen = [0] * k, [0] * k, []
    while min(index) < len(calls):
        assert len(seen) < 100 * k * len(calls), f"stalled at calls {index}: {seen[-20:]}"
        j = int(rng.choice([j for j in range(k) if index[j] < len(calls)]))
        c = index[j]
        xs, wishes = calls[c][:2]
        status = views[j].cross(xs[j], MPI.SUM, c + 1, tmp, 0, stage[j], wishes[j])
        seen.append(status)
        assert status in (0, 1, 2, 3, 4), (c, j, status)
        done = status in (0, 3)
        assert (status == 3) == (done and calls[c][2] is None), (c, j, status)
        index[j] += done
        stage[j] = 0 if done else shm._CROSS_WAITS[status]
    assert 4 in seen and 3 in seen
    for c, (xs, _, expected, _, inputs) in enumerate(calls):
        for x, before in zip(xs, inputs):
            want = before if expected is None else expected
            np.testing.assert_array_equal(x.view(np.uint8), want.view(np.uint8), err_msg=str(c))
    bounced = sum(call[3] for call in calls)
    assert [view.bounce_calls() for view in views] == [bounced] * k
    close_boxes(mapping, views)


@pytest.mark.parametrize("bounce", [0, 4096])
@pytest.mark.parametrize("k", [2, 3])
def test_cross_mismatch_returns_once_every_view_has_seen_it(k, bounce):
    """The last view to arrive has 40 elements, the others 100: the views that see the keys
    differ return 2 (wait for the done flags) until every view has compared them, then 3, and
    nothing moves. Before, the first to see it returned 3 at once, could publish its next call
    (here a call of the others' size) while a slower view still compared this call's keys, and
    that view took it for a match and moved its call-1 data into the next call's array."""
    mapping, views = cross_boxes(k, bounce=bounce)
    tmp = np.zeros(64, np.uint8)
    xs = [np.full(40 if j == k - 1 else 100, j + 1.0, np.float32) for j in range(k)]
    first = [view.cross(x, MPI.SUM, 1, tmp, 0, 0, True) for view, x in zip(views, xs)]
    assert first == [1] * (k - 1) + [2]
    assert [view.cross(x, MPI.SUM, 1, tmp, 0, 1, True) for view, x in zip(views[:-1], xs)] == \
        [2] * (k - 2) + [3]
    assert views[-1].cross(xs[-1], MPI.SUM, 1, tmp, 0, 3, True) == 3
    assert [view.cross(x, MPI.SUM, 1, tmp, 0, 3, True) for view, x in zip(views[:-2], xs)] == \
        [3] * (k - 2)
    assert [key[0] for key in views[0].keys()] == [400] * (k - 1) + [160]
    for j, x in enumerate(xs):
        assert (x == j + 1.0).all()
    ys = [values(np.random.default_rng(k), "float32", 100) for _ in range(k)]
    expected = cross_expected(ys, np.add)
    drive_cross(views, ys, MPI.SUM, 2, tmp)
    assert_same_bits(ys, expected)
    close_boxes(mapping, views)


def test_cross_errors_are_typed():
    import os

    mapping, (a, b) = cross_boxes(2)
    x, tmp = np.arange(8, dtype=np.float64), np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="none of sum"):
        a.cross(x, MPI.BAND, 1, tmp, 0, False, True)
    with pytest.raises(ValueError, match="numeric dtypes only"):
        a.cross(np.zeros(2, np.complex64), MPI.SUM, 1, tmp, 0, False, True)
    with pytest.raises(ValueError, match="holds no element"):
        a.cross(x, MPI.SUM, 1, np.zeros(4, np.uint8), 0, False, True)
    with pytest.raises(ValueError, match="column is 1 or 3"):
        a.cross_reached(2, 1)
    with pytest.raises(ValueError, match="stage 2, but call 1 does not bounce"):
        a.cross(x, MPI.SUM, 1, tmp, 0, 2, True)
    with pytest.raises(TypeError, match="stage, bounce"):
        a.cross(x, MPI.SUM, 1, tmp, 0, 0)
    assert a.last_call() is None and a.cross_ready()  # nothing finished, nothing waited for
    with pytest.raises(ValueError, match="2 pids expected"):
        shm._mailbox.Mailbox(mapping, 2, 0, 0, OP_OBJECTS, [os.getpid()])
    no_pids = shm._mailbox.Mailbox(mapping, 2, 0, 0, OP_OBJECTS)
    with pytest.raises(ValueError, match="needs the local ranks' pids"):
        no_pids.cross(x, MPI.SUM, 1, tmp, 0, False, True)
    assert not a.cross_reached(1, 1)  # no error above raised a flag
    np.testing.assert_array_equal(x, np.arange(8))
    a.close()
    with pytest.raises(ValueError, match="closed"):
        a.cross(x, MPI.SUM, 1, tmp, 0, False, True)
    for view in (b, no_pids):
        view.close()
    mapping.close()


def test_cross_from_a_dead_peer_reports_it_and_raises_no_done_flag():
    import errno
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)  # reaped: its pid no longer names a process
    mapping = mmap.mmap(-1, 2 * shm.FLAG_BYTES)
    a = shm._mailbox.Mailbox(mapping, 2, 0, 0, OP_OBJECTS, [os.getpid(), child.pid])
    b = shm._mailbox.Mailbox(mapping, 2, 1, 0, OP_OBJECTS, [os.getpid(), os.getpid()])
    x, y, tmp = np.ones(8, np.float32), np.ones(8, np.float32), np.zeros(64, np.uint8)
    assert b.cross(y, MPI.SUM, 1, tmp, 0, False, True) == 1
    assert a.cross(x, MPI.SUM, 1, tmp, 0, False, True) == (errno.ESRCH, child.pid,
                                                     "process_vm_readv from")
    np.testing.assert_array_equal(x, 1)  # nothing folded
    assert not b.cross_reached(3, 1)
    a.close()
    b.close()
    mapping.close()


# -- shared regions (shm.shared_zeros): cross() folds straight from the peers' memory ------------
def test_shared_zeros_is_a_registered_zero_array_freed_with_its_views():
    import gc

    before = shm._mailbox.regions_registered()
    a = shm.shared_zeros((3, 5), "float64")
    assert a.shape == (3, 5) and a.dtype == np.float64 and a.flags.c_contiguous
    assert a.flags.writeable and not a.any()
    assert shm._mailbox.regions_registered() == before + 1
    view = a[1]
    del a
    gc.collect()
    assert shm._mailbox.regions_registered() == before + 1  # the view keeps the memory
    view[:] = 7
    del view
    gc.collect()
    assert shm._mailbox.regions_registered() == before
    empty = shm.shared_zeros(0, "int32")  # nothing to share: plain numpy
    assert empty.shape == (0,) and shm._mailbox.regions_registered() == before


def test_regions_must_not_overlap():
    start = 1 << 40  # an address nothing maps here: the registry only records it
    shm._mailbox.register_region(start, 8192, 3, 1)
    try:
        for bad in ((start + 4096, 8192, 3, 1), (start - 4096, 8192, 3, 1), (start + 8192, 0, 3, 1),
                    (start + 8192, 4096, -1, 1)):
            with pytest.raises(ValueError, match="overlapping"):
                shm._mailbox.register_region(*bad)
    finally:
        shm._mailbox.unregister_region(start)
    with pytest.raises(KeyError):
        shm._mailbox.unregister_region(start)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", list(OPS))
def test_cross_on_shared_arrays_folds_directly_with_the_same_bits(k, name):
    """Every view's array from shared_zeros (this process maps its own memfds again through
    /proc/self/fd, as a peer would): cross() takes the direct path (direct_calls) and computes
    exactly what the system-call path computes; a slice of a shared array (a bucket) too."""
    op, ufunc = OPS[name]
    rng = np.random.default_rng(k)
    mapping, views = cross_boxes(k)
    tmp = np.zeros(7 * 4, np.uint8)
    for call, (n, cut) in enumerate(((1000, None), (601, slice(100, 400))), start=1):
        bases = [shm.shared_zeros(n, "float32") for _ in range(k)]
        for base in bases:
            base[:] = values(rng, "float32", n)
        xs = [base[cut] if cut else base for base in bases]
        plain = [x.copy() for x in xs]
        expected = cross_expected(plain, ufunc)
        before = [view.direct_calls() for view in views]
        run_cross(views, xs, op, call, tmp, expected)
        assert [view.direct_calls() - b for view, b in zip(views, before)] == [1] * k
    close_boxes(mapping, views)


def test_cross_with_one_plain_array_takes_the_system_calls_on_every_view():
    mapping, (a, b) = cross_boxes(2)
    tmp = np.zeros(64, np.uint8)
    x, y = shm.shared_zeros(100, "float32"), np.zeros(100, np.float32)
    x[:], y[:] = 1, 2
    assert a.cross(x, MPI.SUM, 1, tmp, 0, False, True) == 1
    assert b.cross(y, MPI.SUM, 1, tmp, 0, False, True) == 2
    assert a.cross(x, MPI.SUM, 1, tmp, 0, True, True) == 0
    assert a.direct_calls() == b.direct_calls() == 0
    np.testing.assert_array_equal(x, 3)
    np.testing.assert_array_equal(y, 3)
    a.close()
    b.close()
    mapping.close()


def test_cross_folds_through_the_system_calls_when_it_cannot_map_a_peer_region():
    """A peer's published region that this view cannot map (here its inode no longer matches,
    as if the descriptor had been reused; likewise no descriptor left or no address space): it
    folds its segment through process_vm_readv / writev instead, the same bits, and raises its
    done flag, so the peer, which took the direct path, completes too (before: a failure tuple
    here and no done flag, the peer waiting until its deadline)."""
    mapping, (a, b) = cross_boxes(2)
    tmp = np.zeros(64, np.uint8)
    x, y = shm.shared_zeros(100, "float32"), shm.shared_zeros(100, "float32")
    x[:], y[:] = 1, 2
    assert b.cross(y, MPI.SUM, 1, tmp, 0, False, True) == 1
    line = np.frombuffer(mapping, np.int64, 8, offset=shm.FLAG_BYTES)  # view b's flag line
    line[6] += 1  # its region's inode, as if the descriptor had been reused
    assert a.cross(x, MPI.SUM, 1, tmp, 0, False, True) == 2
    assert b.cross(y, MPI.SUM, 1, tmp, 0, True, True) == 0 and a.cross_reached(3, 1)
    assert (a.direct_calls(), b.direct_calls()) == (0, 1)
    np.testing.assert_array_equal(x, 3)
    np.testing.assert_array_equal(y, 3)
    del line
    a.close()
    b.close()
    mapping.close()


@pytest.mark.parametrize("shape,dtype,error", [
    ((-2, -3), "float32", ValueError),  # a positive element count from negative dimensions
    ((-1,), "float32", ValueError),
    (2.5, "float32", TypeError),
])
def test_shared_zeros_rejects_what_np_zeros_rejects_and_leaks_no_descriptor(shape, dtype, error):
    import os

    with pytest.raises(error) as plain:
        np.zeros(shape, dtype)
    fds, regions = len(os.listdir("/proc/self/fd")), shm._mailbox.regions_registered()
    with pytest.raises(error) as shared:
        shm.shared_zeros(shape, dtype)
    assert str(shared.value) == str(plain.value)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert shm._mailbox.regions_registered() == regions


def test_shared_zeros_of_objects_is_plain_numpy():
    a = shm.shared_zeros(3, object)  # nothing another process could map: np.zeros' array
    assert a.dtype == object and a.shape == (3,) and a[0] == 0


def test_a_freed_shared_array_leaves_the_registry_before_its_memory_is_unmapped(monkeypatch):
    """Between the unmapping and the registry's update, another thread could get that address
    for a new array and have cross() publish the old memfd (its peers would fold the freed
    memory, silently): the region is forgotten while still mapped, and only then unmapped."""
    import gc

    real = shm._mailbox
    seen = []

    class Registry:
        def __getattr__(self, name):
            return getattr(real, name)

        def unregister_region(self, start):
            address = "%x" % start
            with open("/proc/self/maps") as maps:
                seen.append((start, any(line.split("-")[0] == address for line in maps)))
            return real.unregister_region(start)

    gc.collect()  # earlier tests' arrays
    monkeypatch.setattr(shm, "_mailbox", Registry())
    a = shm.shared_zeros((64, 1024), "float64")
    start = a.ctypes.data
    bucket = a[3:5].reshape(-1)
    del a
    gc.collect()
    assert (start, True) not in seen and (start, False) not in seen  # the slice keeps it
    bucket[:] = 1
    del bucket
    gc.collect()
    assert [mapped for address, mapped in seen if address == start] == [True]


def test_shared_zeros_larger_than_memory_is_a_memory_error_like_np_zeros():
    before = shm._mailbox.regions_registered()
    with pytest.raises(MemoryError, match="Unable to allocate"):
        shm.shared_zeros(10**13, "float32")  # a memfd is sparse: it must not "succeed"
    assert shm._mailbox.regions_registered() == before


def test_cross_refuses_to_restart_a_call_that_is_bouncing():
    """A view in the middle of a bounce (a wait in it raised, say a CollectiveTimeout) cannot
    start over or start another call: its rounds would no longer match its peers', and a restart
    would rewrite pieces they still read. ValueError, nothing moved; resuming at stage 2 works."""
    mapping, (a, b) = cross_boxes(2, bounce=2 * 2 * 128)
    x, y = np.ones(100, np.float32), np.full(100, 2.0, np.float32)
    tmp = np.zeros(64, np.uint8)
    assert a.cross(x, MPI.SUM, 1, tmp, 0, 0, True) == 1
    assert b.cross(y, MPI.SUM, 1, tmp, 0, 0, True) == 4  # arrived, bouncing, waits for a's round
    for stage, call in ((0, 2), (1, 1), (3, 1)):
        with pytest.raises(ValueError, match="while call 1 is bouncing"):
            b.cross(y, MPI.SUM, call, tmp, 0, stage, True)
    views, arrays, stages = [a, b], [x, y], [1, 2]
    while stages != [None, None]:
        for j in (0, 1):
            if stages[j] is not None:
                status = views[j].cross(arrays[j], MPI.SUM, 1, tmp, 0, stages[j], True)
                stages[j] = None if status == 0 else shm._CROSS_WAITS[status]
    assert (x == 3.0).all() and (y == 3.0).all()
    assert a.bounce_calls() == b.bounce_calls() == 1
    a.close()
    b.close()
    mapping.close()
