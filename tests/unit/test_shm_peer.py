"""Cross-memory access to a local peer (rtxmpi/comm/shm.py) when that peer dies: RankFailure.

A child process stands in for a local peer rank: the reader copies from and into its memory
while it lives, and a transfer after it was killed (zombie or reaped) raises PeerAccessError,
which the engine turns into RankFailure naming the rank (not CollectiveError).
"""
import ctypes
import signal
import subprocess
import sys
import time

import pytest

from rtxmpi.comm import shm
from rtxmpi.errors import CollectiveError, RankFailure

PEER = """
import ctypes, os, sys
buf = ctypes.create_string_buffer(b"peer-bytes-0123", 16)
print(os.getpid(), ctypes.addressof(buf), flush=True)
sys.stdin.read()
"""

pytestmark = pytest.mark.skipif(shm._load_cma() is None, reason="no process_vm_readv here")


@pytest.fixture
def peer():
    child = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pid, addr = (int(v) for v in child.stdout.readline().split())
        assert pid == child.pid
        yield child, addr
    finally:
        child.kill()
        child.wait(timeout=10)


def transfer(reader, pid, addr):
    got = ctypes.create_string_buffer(16)
    reader.read(pid, ctypes.addressof(got), addr, 15)
    return got.value


@pytest.mark.parametrize("reaped", [False, True], ids=["zombie", "reaped"])
def test_transfer_from_a_dead_peer_is_a_rank_failure(peer, reaped):
    child, addr = peer
    reader = shm._PeerReader(shm._load_cma())
    assert transfer(reader, child.pid, addr) == b"peer-bytes-0123"
    back = ctypes.create_string_buffer(b"written-by-test", 16)
    reader.write(child.pid, addr, ctypes.addressof(back), 15)
    assert transfer(reader, child.pid, addr) == b"written-by-test"
    assert not shm.process_gone(child.pid)
    child.send_signal(signal.SIGKILL)
    if reaped:
        child.wait(timeout=10)
    else:
        deadline = time.monotonic() + 10
        while not shm.process_gone(child.pid) and time.monotonic() < deadline:
            time.sleep(0.001)
    with pytest.raises(shm.PeerAccessError) as info:
        transfer(reader, child.pid, addr)
    assert info.value.pid == child.pid
    error = shm.peer_failure("all_reduce", info.value, [123, child.pid], [0, 5], 0)
    assert isinstance(error, RankFailure) and error.ranks == [5]
    assert "all_reduce: rank 5" in str(error)


def test_transfer_error_from_a_live_peer_is_a_collective_error(peer):
    child, addr = peer
    reader = shm._PeerReader(shm._load_cma())
    with pytest.raises(shm.PeerAccessError) as info:  # an address the peer has not mapped
        transfer(reader, child.pid, 8)
    error = shm.peer_failure("reduce_scatter", info.value, [child.pid], [1], 0)
    assert type(error) is CollectiveError and "RTXMPI_SHM_CMA=0" in str(error)


def test_flag_wait_on_a_dead_peer_is_a_rank_failure(peer):
    child, _ = peer
    watched = shm.watch_peers(lambda: False, [child.pid, 1], [3, 0], 0, every=10)
    for _ in range(30):
        assert watched() is False  # alive: keeps waiting
    child.kill()
    child.wait(timeout=10)
    with pytest.raises(RankFailure) as info:
        for _ in range(10):
            watched()
    assert info.value.ranks == [3] and "rank 3" in str(info.value)
    assert shm.watch_peers(lambda: True, [child.pid], [3], 0, every=1)() is True


ARRAY_PEER = """
import numpy as np, sys
a = np.arange(1000, dtype=np.float32) * 0.5
print(a.ctypes.data, flush=True)
sys.stdin.readline()
sys.stdout.write(" ".join(repr(float(v)) for v in a[::97]) + "\\n")
sys.stdout.flush()
sys.stdin.read()
"""


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_cross_memory_fold_reads_folds_and_pushes_in_pieces(compiled, monkeypatch):
    """The cma all_reduce's piece loop (_mailbox.fold_peers, or its numpy fallback) against a
    live peer process: x becomes x + peer on [lo, hi), the peer's array gets the sum there, and
    pieces smaller than the range are stitched without a gap."""
    import numpy as np

    if compiled and shm._mailbox is None:
        pytest.fail("the compiled mailbox was not built (pip install -e .)")
    child = subprocess.Popen([sys.executable, "-c", ARRAY_PEER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        addr = int(child.stdout.readline())
        engine = object.__new__(shm.NodeAllReduce)  # only what _all_reduce_cma's loop reads
        engine.local_size, engine.local_rank, engine.cross = 2, 1, None
        engine.mailbox = None  # the piece loop of fold_peers, not Mailbox.cross (test_mailbox)
        engine._tmp = np.zeros(64 * 4, np.uint8)  # 64 float32 per piece: 8 pieces of the half
        engine._reader = shm._PeerReader(shm._load_cma())
        engine._exchange = lambda x, wait, code=0: [(child.pid, addr)]
        engine._done = lambda wait: None
        if not compiled:
            monkeypatch.setattr(shm, "_mailbox", None)
        x = np.ones(1000, np.float32)
        engine._all_reduce_cma(x, np.add, None, None, None)
        peer = np.arange(1000, dtype=np.float32) * 0.5
        np.testing.assert_array_equal(x[:500], np.ones(500, np.float32))  # the peer's half
        np.testing.assert_array_equal(x[500:], 1 + peer[500:])
        child.stdin.write("\n")
        child.stdin.flush()
        seen = [float(v) for v in child.stdout.readline().split()]
        want = [float(1 + peer[i]) if i >= 500 else float(peer[i]) for i in range(0, 1000, 97)]
        assert seen == want
    finally:
        child.kill()
        child.wait(timeout=10)


def test_compiled_fold_from_a_dead_peer_reports_it(peer):
    import errno

    import numpy as np

    if shm._mailbox is None:
        pytest.fail("the compiled mailbox was not built (pip install -e .)")
    child, addr = peer
    child.kill()
    child.wait(timeout=10)
    x, tmp = np.ones(4, np.uint8), np.zeros(16, np.uint8)
    err, pid, what = shm._mailbox.fold_peers(x, 0, 4, [(child.pid, addr)], tmp, 0, True)
    assert (err, pid, what) == (errno.ESRCH, child.pid, "process_vm_readv from")
    error = shm.peer_failure("all_reduce", shm.PeerAccessError(err, pid, what), [child.pid], [2], 0)
    assert isinstance(error, RankFailure) and error.ranks == [2]
    np.testing.assert_array_equal(x, 1)  # nothing folded


@pytest.mark.parametrize("dtype", ["float16", ">f4", "complex64", "float32"])
def test_cross_memory_fold_of_any_dtype_the_engine_supports(dtype):
    """NodeAllReduce.supports() takes any numeric 1-D array: dtypes the compiled fold has no
    loop for (float16, non-native byte order, complex) take the numpy loop, bit for bit the
    same result. This process stands in for its own peer (process_vm_readv of its own pid)."""
    import os

    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.standard_normal(300).astype(dtype)
    peer = rng.standard_normal(300).astype(dtype)
    engine = object.__new__(shm.NodeAllReduce)
    engine.local_size, engine.local_rank, engine.cross, engine.mailbox = 2, 0, None, None
    engine._tmp = np.zeros(40 * 8, np.uint8)
    engine._reader = shm._PeerReader(shm._load_cma())
    engine._exchange = lambda x, wait, code=0: [(os.getpid(), peer.ctypes.data)]
    engine._done = lambda wait: None
    want = x.copy()
    want[:150] += peer[:150]
    engine._all_reduce_cma(x, np.add, None, None, None)
    assert x.tobytes() == want.tobytes()
    assert peer[:150].tobytes() == want[:150].tobytes()  # pushed


class _Cross:
    """Stand-in for the compiled Mailbox: cross() returns the scripted statuses, then 1 (a peer
    has not arrived) for ever; all_reduce() posts a mailbox call (numbered 1, 2, ...; done at
    once, 0, when `done_at_post`), arrived(call) is True for the calls in `arrived_calls`, and
    finish() records the calls it reduced."""

    def __init__(self):
        self.statuses = []
        self.posted, self.finished, self.arrived_calls, self.done_at_post = [], [], set(), False

    def cross(self, x, op, call, tmp, spin_ns, resume, bounce, code=0):
        return self.statuses.pop(0) if self.statuses else 1

    def cross_ready(self):
        return False

    def all_reduce(self, x, op, spin_ns, code=0, count=0):
        self.posted.append(len(self.posted) + 1)
        return 0 if self.done_at_post else self.posted[-1]

    def arrived(self, call):
        return call in self.arrived_calls

    def finish(self, x, op, call):
        self.finished.append(call)
        return True


@pytest.fixture
def queue_engine():
    """A NodeAllReduce with only what the nonblocking queue reads: local rank 0 (this process,
    world rank 0) and one peer (world rank 5) whose pid the test sets; monitor.PROGRESS is
    restored after the test."""
    import collections

    import numpy as np

    saved = list(shm.monitor.PROGRESS)
    engine = object.__new__(shm.NodeAllReduce)
    engine.mailbox, engine._queue, engine._cma_calls = _Cross(), collections.deque(), 0
    engine._tmp = np.zeros(64, np.uint8)
    engine.small_bytes = -1  # no mailbox sizes: every call is a cross-memory one
    engine._local_ranks, engine._rank = [0, 5], 0
    engine.peer = lambda pid: setattr(engine, "_pids", [0, pid]) or setattr(
        engine, "_node_pids", [0, pid])
    yield engine
    shm.monitor.PROGRESS[:] = saved


def test_a_failed_queued_transfer_fails_every_queued_all_reduce(queue_engine):
    """Two nonblocking all_reduces queued; the head's transfer fails inside another wait's
    progress call (monitor.PROGRESS): that wait raises, and so does every queued call's poll
    (before: they returned False until their deadline, a CollectiveTimeout hiding the error)."""
    import errno
    import os

    import numpy as np

    engine = queue_engine
    engine.peer(os.getppid())  # alive: the failure is a CollectiveError
    first = engine.start_all_reduce(np.ones(8, np.float32), None)
    second = engine.start_all_reduce(np.ones(8, np.float32), None)
    assert first() is False and second() is False
    assert engine.progress in shm.monitor.PROGRESS
    engine.mailbox.statuses = [(errno.EPERM, os.getppid(), "process_vm_readv from")]
    with pytest.raises(CollectiveError):
        for progress in tuple(shm.monitor.PROGRESS):  # what monitor.wait runs between polls
            progress()
    assert engine.progress not in shm.monitor.PROGRESS and not engine._queue
    for poll in (first, second):
        with pytest.raises(CollectiveError, match="cross-memory transfer"):
            poll()


def test_a_peer_found_dead_by_a_poll_ends_the_queue(queue_engine, peer):
    """The peer dies with two calls queued; the first's poll finds it (watch_peers) and raises
    RankFailure naming it: the queue ends there (before: the engine stayed in monitor.PROGRESS,
    so every later wait of the process, of any group, ran a queue that could never finish), and
    the second call's poll raises the same RankFailure at once."""
    import numpy as np

    child, _ = peer
    engine = queue_engine
    engine.peer(child.pid)
    first = engine.start_all_reduce(np.ones(8, np.float32), None)
    second = engine.start_all_reduce(np.ones(8, np.float32), None)
    child.kill()
    child.wait(timeout=10)
    with pytest.raises(RankFailure) as info:
        for _ in range(2 * shm.LIVENESS_POLLS):
            first()
    assert info.value.ranks == [5]
    assert engine.progress not in shm.monitor.PROGRESS and not engine._queue
    with pytest.raises(RankFailure) as again:
        second()
    assert again.value is info.value


def test_replacing_the_world_fails_the_queued_all_reduces(queue_engine):
    """shm.fail_queued (rtxmpi.comm.replace_world, elastic shrink): every engine's queued calls
    fail with the error given, and the waits of the new world no longer run the old queues."""
    import os

    import numpy as np

    engine = queue_engine
    engine.peer(os.getppid())
    poll = engine.start_all_reduce(np.ones(8, np.float32), None)
    assert poll() is False and engine.progress in shm.monitor.PROGRESS
    shm.fail_queued(RankFailure("replaced", ranks=[]))
    assert engine.progress not in shm.monitor.PROGRESS and not engine._queue
    with pytest.raises(RankFailure, match="replaced"):
        poll()


def test_closing_the_engine_fails_its_queued_all_reduces(queue_engine):
    """close() with a call queued: its poll raises CollectiveError (it can never complete), and
    the engine leaves monitor.PROGRESS."""
    import os

    import numpy as np

    engine = queue_engine
    engine.peer(os.getppid())
    engine._views, engine._box_mm, engine._mm, engine.node, engine.cross = {}, None, None, None, None
    poll = engine.start_all_reduce(np.ones(8, np.float32), None)
    engine.mailbox.close = lambda: None
    engine.close()
    assert engine.progress not in shm.monitor.PROGRESS and not engine._queue
    with pytest.raises(CollectiveError, match="closed with 1 nonblocking"):
        poll()


def test_a_mailbox_call_queued_behind_a_cross_memory_call_posts_when_that_completes(queue_engine):
    """Nonblocking all_reduces of the mailbox's sizes share the queue: one launched behind a
    pending cross-memory call is not posted (its mailbox call number would then differ between
    ranks that had and had not completed the head); it posts once the head completes and
    finishes once every peer has posted. With nothing queued, a call whose peers had all posted
    completes as it starts, and leaves nothing in the queue."""
    import os

    import numpy as np

    engine = queue_engine
    engine.peer(os.getppid())
    engine.small_bytes = 64  # up to 16 float32: the mailbox
    box = engine.mailbox
    big = engine.start_all_reduce(np.ones(100, np.float32), None)
    small = engine.start_all_reduce(np.ones(8, np.float32), None)
    assert big() is False and small() is False and box.posted == []
    box.statuses = [0]  # the cross-memory call completes at the next progress()
    assert big() is True and small() is False and box.posted == [1] and box.finished == []
    box.arrived_calls.add(1)
    assert small() is True and box.finished == [1]
    assert not engine._queue and engine.progress not in shm.monitor.PROGRESS
    box.done_at_post = True
    done = engine.start_all_reduce(np.ones(8, np.float32), None)
    assert done() is True and box.posted == [1, 2] and not engine._queue
