"""The MPI transport: mpi4py buffer (uppercase) calls on contiguous host buffers.

`ProcessGroup` hands this backend contiguous 1-D numpy buffers of a dtype MPI reduces natively
(float32/64, int8/32/64, uint8) or raw bytes for data movement. Blocking calls run the fast
blocking MPI algorithms after an arrival check with a deadline; asynchronous calls use the
nonblocking (I-prefixed) variants, completed by `Monitor.wait` with a deadline.
"""
import collections
import contextlib

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveMismatch
from . import fingerprint, shm
from .failure import is_process_failure, rank_failure

REDUCE_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
# bool buffers travel as uint8 0/1: logical or is MAX, logical and is MIN
BOOL_OPS = {"sum": MPI.MAX, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.MIN}
ARRIVE_SPIN_TESTS = 16  # Test() polls of the arrival barrier before Monitor.wait takes over
# blocking all_reduce up to this size runs as Iallreduce + deadline-aware wait (one
# synchronization); above it Open MPI's nonblocking algorithms fall behind its blocking ones
NONBLOCKING_MAX_BYTES = 64 << 10
# all_gather takes the cross-memory path only from this multiple of the shared-memory threshold:
# its output is a fresh array, and filling fresh pages through process_vm_readv loses to MPI's
# Allgather up to 16-32 MiB here (bench/collectives.py; reduce_scatter wins from 1 MiB)
ALL_GATHER_FACTOR = 16


def _nothing():
    pass


def as_bytes(buf):
    """A uint8 view of a contiguous array (any dtype), for data-movement calls."""
    return buf.reshape(-1).view(np.uint8)


class MPIBackend:
    """Collectives over one MPI communicator. Not used directly: see ProcessGroup."""

    name = "mpi"
    device_native = False  # cupy arrays are staged through host memory by ProcessGroup

    def __init__(self, comm, monitor, group_name, members):
        self.comm = comm
        self.monitor = monitor
        self.group_name = group_name
        self.members = members  # world ranks of this communicator, by group rank
        self.size = len(members)
        # shared-memory all_reduce (comm/shm.py): settings fixed at group creation; the engine
        # is built by the first blocking all_reduce that selects it (None: not built yet)
        self.shm_config = shm.CONFIG.copy()
        self.shm_min_bytes = self.shm_config.threshold if self.size > 1 else shm.NEVER
        self._shm = None
        # the arrival check's all_gather of every rank's fingerprint (count, code), reused
        # send/recv exchange fingerprints here, beside their data on `comm` (same tags)
        self.p2p = comm.Dup()
        self._sent = collections.deque()  # sends not yet compared with their recv's reply

    # -- waiting ---------------------------------------------------------------------------
    def test(self, requests):
        """True once `requests` (MPI requests, or a shared-memory poll()) completed; never
        blocks."""
        try:
            return requests() if callable(requests) else MPI.Request.Testall(requests)
        except MPI.Exception as exc:
            raise self._translate(exc, "test") from None

    def _translate(self, exc, op):
        """RankFailure for a ULFM process-failure error, else the MPI.Exception unchanged."""
        return rank_failure(exc, self.comm, op=op, group=self.group_name) if is_process_failure(exc, self.comm) else exc

    def wait(self, requests, *, op, seq, timeout_s):
        """Complete `requests` (MPI requests, or a shared-memory poll(): it yields the core
        between polls, as ranks may outnumber cores and the peer it waits for may need this
        one) within the deadline."""
        if callable(requests):
            requests = shm.yielding(requests)
        self.monitor.wait(requests, op=op, seq=seq, group=self.group_name,
                          members=self.members, timeout_s=timeout_s)

    def arrive(self, op, seq, timeout_s, fp=None):
        """Return once every rank of the group has reached this call (a few direct polls first:
        see _wait_fast). fp: the call's fingerprint (count, code), compared on every rank by the
        arrival check itself (CollectiveMismatch on every rank when they differ): an empty
        mailbox call on one node with the shared-memory engine's mailbox, else a nonblocking
        MAX all_reduce of (count, code, -count, -code), whose result shows max == min exactly
        when every rank agrees (O(1) bytes at any world size, one synchronization like the
        barrier it replaces; only a mismatch all_gathers the calls to name them); None: a plain
        barrier."""
        engine = self._shm
        if fp is not None and engine and engine.small_bytes >= 0:  # the mailbox (comm/shm.py)
            engine.arrive(op, fp, seq, lambda poll: self._wait_fast(poll, op, seq, timeout_s))
            return
        wait = lambda requests: self._wait_fast(requests, op, seq, timeout_s)  # noqa: E731
        try:
            if fp is not None:
                fingerprint.agree(self.comm, fp, wait, op, seq, self.group_name)
                return
            request = self.comm.Ibarrier()
        except MPI.Exception as exc:
            raise self._translate(exc, f"{op} #{seq}") from None
        wait([request])

    def barrier(self):
        return [self.comm.Ibarrier()]

    def comms(self):
        """Every MPI communicator this group's transfers use: its own, its send/recv
        fingerprints', and its shared-memory engine's node and cross-node ones once built (an
        elastic shrink revokes them all)."""
        return [self.comm, self.p2p, *(self._shm.comms() if self._shm else ())]

    def exchange_fingerprints(self, fingerprint, op, seq, timeout_s):
        """All-gather each rank's int64 fingerprint row; also an arrival barrier."""
        table = np.empty((self.comm.Get_size(), fingerprint.size), np.int64)
        self.wait([self.comm.Iallgather(fingerprint, table)], op=op, seq=seq, timeout_s=timeout_s)
        return table

    def blocking(self, op, seq, timeout_s):
        return self.monitor.blocking(op, seq, self.group_name, timeout_s)

    def _wait_fast(self, requests, op, seq, timeout_s):
        """wait() with a few direct polls first (peers usually answer within microseconds, and
        the deadline-aware wait costs more per poll than that). requests: MPI requests, or a
        callable poll() -> bool (the shared-memory mailbox flags)."""
        try:
            if not callable(requests):  # a shared-memory flag was already spun on
                for _ in range(ARRIVE_SPIN_TESTS):
                    if MPI.Request.Testall(requests):
                        return
        except MPI.Exception as exc:
            raise self._translate(exc, f"{op} #{seq}") from None
        self.wait(requests, op=op, seq=seq, timeout_s=timeout_s)

    def all_reduce_now(self, buf, mpi_op, seq, timeout_s, code=0):
        """Blocking in-place all_reduce of a contiguous 1-D `buf` with its own arrival check (the
        fast path of ProcessGroup.all_reduce; after a large transfer has flushed the caches, each
        Python call costs several times its warm time). The arrival check compares every rank's
        fingerprint (buf.size, code) before anything moves. Every wait is deadline-aware; the
        algorithm is chosen by `_all_reduce_blocking`. Raises CollectiveMismatch (the ranks'
        fingerprints differ), CollectiveTimeout (a rank did not arrive in time), RankFailure (a
        peer died)."""
        if self.size == 1:
            return
        engine = self._shm
        if engine and buf.nbytes <= engine.small_bytes:  # the mailbox, with the fewest calls
            # engine.small_all_reduce inlined for the compiled mailbox: no closure unless a peer
            # is late (call != 0) or nonblocking calls are queued, one Python layer less per call
            mailbox = engine.mailbox
            call = (None if mailbox is None or engine._queue
                    else mailbox.all_reduce(buf, mpi_op, shm.SPIN_NS, code))
            if call != 0:
                wait = lambda poll: self._wait_fast(poll, "all_reduce", seq, timeout_s)  # noqa: E731
                if call is None:
                    engine.small_all_reduce(buf, mpi_op, wait, code, seq)
                else:
                    engine.small_finish(buf, mpi_op, call, wait, seq, (buf.size, code))
            return
        fp = (buf.size, code)
        try:
            if engine is None and self._shm_wanted(buf.nbytes):
                self.arrive("all_reduce", seq, timeout_s, fp)  # the engine's creation is collective
                with self.blocking("all_reduce", seq, timeout_s):
                    self._shm_engine()
            self._all_reduce_blocking(
                buf, mpi_op,
                lambda requests: self._wait_fast(requests, "all_reduce", seq, timeout_s),
                lambda: self.blocking("all_reduce", seq, timeout_s),
                lambda: self.arrive("all_reduce", seq, timeout_s, fp), code, seq)
        except MPI.Exception as exc:
            raise self._translate(exc, f"all_reduce #{seq}") from None

    def _all_reduce_blocking(self, buf, mpi_op, wait, guard, arrive, code=0, seq=0):
        """The blocking all_reduce algorithm for `buf.nbytes`, the same on every rank whichever
        path (fast or general) each rank came by, with one synchronization where possible:
        - up to the mailbox size (comm/shm.py, one node): the mailbox, whose flags carry every
          rank's fingerprint (buf.size, `code`);
        - from the engine's all_reduce_from: comm/shm.py's cross-memory path, whose address
          exchange is the arrival and fingerprint check;
        - otherwise `arrive()` (with checking off, the fingerprint check: MPI's algorithms may
          truncate, hang or return garbage for arrays of different sizes), then up to
          NONBLOCKING_MAX_BYTES MPI's Iallreduce, else MPI's blocking Allreduce inside `guard()`
          (Open MPI's nonblocking algorithms are slower there).
        wait(requests or poll): completes requests (deadline-aware on the fast path). seq: the
        group's call number, for CollectiveMismatch's message."""
        nbytes, engine = buf.nbytes, self._shm
        if engine and engine.supports(buf, mpi_op):
            if nbytes <= engine.small_bytes:
                engine.small_all_reduce(buf, mpi_op, wait, code, seq)
                return
            if nbytes >= engine.all_reduce_from:
                engine.all_reduce(buf, mpi_op, wait, guard, code, seq)
                return
        arrive()
        if nbytes <= NONBLOCKING_MAX_BYTES:
            wait([self.comm.Iallreduce(MPI.IN_PLACE, buf, mpi_op)])
            return
        with guard():
            self.comm.Allreduce(MPI.IN_PLACE, buf, mpi_op)

    def all_reduce_start(self, buf, mpi_op, seq, timeout_s, code):
        """Start the all_reduce of a contiguous 1-D numpy `buf` (a dtype MPI reduces natively;
        an MPI op with a numpy ufunc) without waiting: the shared-memory engine's queue when it
        takes it (its flags carry the fingerprint (buf.size, code)), else MPI's Iallreduce after
        the arrival check that compares the fingerprints (blocking, with the deadline, as
        checking mode's). Returns a poll() or a list of MPI requests. Raises
        CollectiveMismatch, CollectiveTimeout (the arrival check)."""
        engine = self._shm
        if engine and engine.supports_nonblocking(buf, mpi_op):
            return engine.start_all_reduce(buf, mpi_op, code, seq)
        if self.size > 1:
            self.arrive("all_reduce", seq, timeout_s, (buf.size, code))
        return [self.comm.Iallreduce(MPI.IN_PLACE, buf, mpi_op)]

    def _shm_wanted(self, nbytes):
        """Whether a message of `nbytes` may take a shared-memory path (the engine is then
        built); the same answer on every rank. With the cross-memory start left automatic
        (RTXMPI_SHM_MIN_BYTES unset) every size may: the compiled cross-memory path starts just
        above the mailbox."""
        config = self.shm_config
        return (nbytes >= self.shm_min_bytes or nbytes <= config.small_threshold
                or (config.enabled and config.min_bytes is None))

    def _shm_engine(self):
        """The group's NodeAllReduce, built on first use (collective: every rank gets here at the
        same call); False when the group's layout does not allow one."""
        engine = self._shm
        if engine is None:
            engine = self._shm = shm.NodeAllReduce.create(self.comm, self.shm_config,
                                                          self.members) or False
            if engine is False:
                self.shm_min_bytes = shm.NEVER  # one rank per node: MPI from now on
            else:
                engine.group_name = self.group_name
        return engine

    # -- transfers: each returns a list of requests when nonblocking, else None -------------
    def all_reduce(self, buf, mpi_op, nonblocking):
        if nonblocking:
            # at the mailbox's and the cross-memory path's sizes on one node, the shared-memory
            # engine's queued nonblocking path (once a blocking call built the engine: the same
            # on every rank)
            engine = self._shm
            if engine and engine.supports_nonblocking(buf, mpi_op):
                return engine.start_all_reduce(buf, mpi_op)
            return [self.comm.Iallreduce(MPI.IN_PLACE, buf, mpi_op)]
        if self.size == 1:
            return None
        if self._shm is None and self._shm_wanted(buf.nbytes):
            self._shm_engine()  # every rank has arrived (the caller's arrival check)
        self._all_reduce_blocking(buf, mpi_op, shm._wait_all, contextlib.nullcontext, _nothing)

    def reduce_scatter(self, buf, out, mpi_op, nonblocking):
        if nonblocking:
            return [self.comm.Ireduce_scatter_block(buf, out, mpi_op)]
        if buf.nbytes < self.shm_min_bytes or not self._shm_reduce_scatter(
                buf, out, [out.size] * self.size, mpi_op):
            self.comm.Reduce_scatter_block(buf, out, mpi_op)

    def _shm_reduce_scatter(self, buf, out, counts, mpi_op):
        """reduce_scatter by cross-memory reads on one node (comm/shm.py), or False (MPI)."""
        engine = self._shm_engine()
        return engine is not False and engine.reduce_scatter(buf, out, counts, mpi_op)

    def reduce_scatter_counts(self, buf, out, recvcounts, mpi_op, nonblocking):
        """Uneven reduce_scatter: rank r receives recvcounts[r] elements (zero allowed)."""
        if nonblocking:
            return [self.comm.Ireduce_scatter(buf, out, recvcounts, mpi_op)]
        if buf.nbytes < self.shm_min_bytes or not self._shm_reduce_scatter(
                buf, out, recvcounts, mpi_op):
            self.comm.Reduce_scatter(buf, out, recvcounts, mpi_op)

    def all_gather(self, buf, out, nonblocking):
        send, recv = [as_bytes(buf), MPI.BYTE], [as_bytes(out), MPI.BYTE]
        if nonblocking:
            return [self.comm.Iallgather(send, recv)]
        if (out.nbytes < self.shm_min_bytes * ALL_GATHER_FACTOR
                or not self._shm_all_gather(buf, out)):
            self.comm.Allgather(send, recv)

    def _shm_all_gather(self, buf, out):
        """all_gather by cross-memory reads on one node (comm/shm.py), or False (MPI)."""
        engine = self._shm_engine()
        return engine is not False and engine.all_gather(buf, out)

    def broadcast(self, buf, root, nonblocking):
        data = [as_bytes(buf), MPI.BYTE]
        if nonblocking:
            return [self.comm.Ibcast(data, root=root)]
        self.comm.Bcast(data, root=root)

    def all_to_all(self, buf, out, nonblocking):
        send, recv = [as_bytes(buf), MPI.BYTE], [as_bytes(out), MPI.BYTE]
        if nonblocking:
            return [self.comm.Ialltoall(send, recv)]
        self.comm.Alltoall(send, recv)

    # send/recv: the data goes on `comm`; the sender's fingerprint (count, code) goes to the
    # receiver and the receiver's back to the sender on `p2p`, with the same tag, all posted at
    # once (no round trip before the data). A receive of more bytes than its buffer holds ends in
    # MPI's truncation error, which is safe; the receiver compares once its messages are done.
    # A send completes as before (it does not wait for its recv: rings of blocking send-then-recv
    # of small messages keep working); it compares when the reply is there by then, else at this
    # rank's next send or recv on the group (check_sent).
    def send(self, buf, dst, tag, fp, seq):
        """Start sending the contiguous `buf` to group rank `dst`; fp: (count, code) of the
        caller's array. Returns MPI requests; check_sent() after they complete, or the next
        send/recv of this rank on the group, raises CollectiveMismatch when dst's recv differs in
        count or dtype."""
        self.check_sent()
        mine, theirs = np.array(fp, np.int64), np.zeros(2, np.int64)
        requests = [self.p2p.Isend(mine, dest=dst, tag=tag),
                    self.comm.Isend([as_bytes(buf), MPI.BYTE], dest=dst, tag=tag)]
        reply = self.p2p.Irecv(theirs, source=dst, tag=tag)
        self._sent.append((reply, mine, theirs, f"send to {dst}", seq, dst))
        return requests

    def check_sent(self):
        """Compare the fingerprints of the sends whose recv's reply has arrived (in order);
        CollectiveMismatch for the first that differs. Local, never waits."""
        while self._sent:
            reply, mine, theirs, op, seq, dst = self._sent[0]
            try:
                if not reply.Test():
                    return
            except MPI.Exception as exc:
                self._sent.popleft()
                raise self._translate(exc, f"{op} #{seq}") from None
            self._sent.popleft()
            if not fingerprint.same_data(mine, theirs):
                raise self._p2p_mismatch(op, seq, [mine, theirs], dst, send=True)

    def recv(self, buf, src, tag, fp, seq):
        """Start receiving into the contiguous `buf` from group rank `src`; fp: (count, code) of
        the caller's array. Returns a poll() that raises CollectiveMismatch when src's send
        differs in count or dtype (buf's contents are then undefined)."""
        self.check_sent()
        mine, theirs = np.array(fp, np.int64), np.zeros(2, np.int64)
        control = [self.p2p.Irecv(theirs, source=src, tag=tag),
                   self.p2p.Isend(mine, dest=src, tag=tag)]
        data = [self.comm.Irecv([as_bytes(buf), MPI.BYTE], source=src, tag=tag)]
        truncated = []
        op = f"recv from {src}"

        def poll():
            try:
                if data and data[0].Test():
                    data.clear()
            except MPI.Exception as exc:  # a larger message than buf: MPI_ERR_TRUNCATE
                data.clear()
                truncated.append(exc)
            try:
                if data or not MPI.Request.Testall(control):
                    return False
            except MPI.Exception as exc:
                raise self._translate(exc, f"{op} #{seq}") from None
            if not fingerprint.same_data(mine, theirs):
                raise self._p2p_mismatch(op, seq, [theirs, mine], src, send=False)
            if truncated:
                raise self._translate(truncated[0], f"{op} #{seq}")
            return True

        poll.no_spin = True  # Work.wait: no busy spin before the deadline-aware wait
        return poll

    def _p2p_mismatch(self, op, seq, table, peer, send):
        """CollectiveMismatch for a send/recv pair (table: the sender's then the receiver's
        fingerprint)."""
        me = self.comm.Get_rank()
        ranks = [me, peer] if send else [peer, me]
        rows = [(int(count), int(code)) for count, code in table]
        return CollectiveMismatch(fingerprint.describe(op, seq, self.group_name, rows, ranks))

    def split(self, color, key):
        return self.comm.Split(MPI.UNDEFINED if color is None else color, key)
