"""Shared-memory all_reduce on a node, and the hierarchical all_reduce across nodes.

Open MPI's `Allreduce` between processes of one node runs far below the memory bandwidth for
large messages (about 1.5-2 GB/s busbw at 64-256 MiB on the 2-core CI machine, where one core
copies at about 20 GB/s). `NodeAllReduce` gives the MPI backend a faster path for large blocking
all_reduce calls. It is the reduce-scatter + all-gather all_reduce (Rabenseifner, "Optimization
of collective reduction operations", ICCS 2004; Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005) run through a shared-memory arena,
pipelined in chunks so that the data in flight stays in cache:

- Arena: one POSIX shared-memory file per group and node (`/dev/shm`, unlinked as soon as every
  local rank has mapped it, so nothing is left behind even if a process dies), holding per local
  rank `BUFFERS` chunk buffers of `chunk_bytes`. Allocated once, first touched at creation and
  reused by every call; its size does not depend on the message size (large messages are
  pipelined through it), so it never grows.
- Per chunk k (elements split into `local_size` contiguous segments, segment i owned by local
  rank i):
  1. copy-in: every rank copies the segments of its chunk that other ranks own into its buffer;
  2. reduce: rank i adds the other ranks' copies of segment i into its own data in place, in
     ascending local-rank order, then publishes the result in its buffer. Across nodes
     (hierarchical path), the reduced segment is then all_reduced by MPI among the ranks holding
     local index i on every node (one per node), so each rank sends 1/local_size of the message
     over the network and all local ranks use it at once (the hierarchical / 2D all_reduce of
     Horovod and of Jia et al., "Highly scalable deep learning training system with mixed-precision",
     2018);
  3. copy-out: every rank copies the reduced segments the other ranks own into its array.
  One node barrier per chunk separates "chunk k reduced and chunk k+1 copied in" from "chunk k
  copied out"; with three buffers per rank (triple buffering) no rank can overwrite a buffer
  another rank is still reading. A call starts only after every rank of the group has arrived
  (the group's arrival check), so consecutive calls cannot overlap either.
- Memory ordering: the stores of one step are visible to the other ranks after the node barrier:
  Open MPI's shared-memory barrier is built on atomic operations with full memory fences.

Every element is reduced by exactly one rank and copied to the others, so every rank gets bitwise
the same result. The order of the terms is fixed by the element's position and the group layout
(deterministic from run to run), but for more than two local ranks it is not the rank order.

Selection (MPIBackend): blocking all_reduce of at least `min_bytes` on a group whose ranks share
nodes uses this path; smaller messages, nonblocking calls and groups with one rank per node keep
MPI's algorithms. Configuration (read on rank 0 by `configure()` at `rtxmpi.init()`, the same on
every rank): `RTXMPI_SHM=0` turns the path off; `RTXMPI_SHM_MIN_BYTES` (default
`DEFAULT_MIN_BYTES`), `RTXMPI_SHM_CHUNK_BYTES` (default `DEFAULT_CHUNK_BYTES`);
`RTXMPI_SHM_NODE_SIZE=k` splits every node into pretend nodes of k consecutive local ranks, to
exercise the hierarchical path on one machine (tests).
"""
import mmap
import os
import sys
import tempfile

import numpy as np
from mpi4py import MPI

from ..errors import ConfigError

DEFAULT_MIN_BYTES = 1 << 20
DEFAULT_CHUNK_BYTES = 512 << 10
MIN_CHUNK_BYTES = 4 << 10
BUFFERS = 3  # triple buffering: one barrier per chunk (see the module docstring)
NEVER = sys.maxsize  # min_bytes when the path is off


class ShmConfig:
    """Shared-memory path settings of one group (see the module docstring).

    enabled (bool), min_bytes (int, smallest message that takes the path), chunk_bytes (int,
    pipeline chunk; a multiple of 8), node_size (int or None: pretend nodes of this many local
    ranks).
    """

    __slots__ = ("enabled", "min_bytes", "chunk_bytes", "node_size")

    def __init__(self, enabled=True, min_bytes=DEFAULT_MIN_BYTES, chunk_bytes=DEFAULT_CHUNK_BYTES,
                 node_size=None):
        self.enabled, self.min_bytes = bool(enabled), int(min_bytes)
        self.chunk_bytes, self.node_size = int(chunk_bytes), node_size

    @property
    def threshold(self):
        """Smallest message (bytes) that takes the shared-memory path; NEVER when off."""
        return self.min_bytes if self.enabled else NEVER

    def copy(self):
        return ShmConfig(self.enabled, self.min_bytes, self.chunk_bytes, self.node_size)

    def __repr__(self):
        return (f"ShmConfig(enabled={self.enabled}, min_bytes={self.min_bytes}, "
                f"chunk_bytes={self.chunk_bytes}, node_size={self.node_size})")

    @classmethod
    def from_env(cls, environ=os.environ):
        """Parse RTXMPI_SHM* variables. Raises ConfigError naming the variable and the value."""
        def integer(name, default, low):
            text = environ.get(name)
            if text is None or not text.strip():
                return default
            try:
                value = int(text.strip())
            except ValueError:
                raise ConfigError(f"{name}={text!r} is not an integer") from None
            if value < low:
                raise ConfigError(f"{name}={text!r} must be >= {low}")
            return value

        flag = environ.get("RTXMPI_SHM", "1").strip().lower()
        if flag not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
            raise ConfigError(f"RTXMPI_SHM={environ['RTXMPI_SHM']!r}: use 1 (on, default) or 0 (off)")
        chunk = integer("RTXMPI_SHM_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES)
        return cls(enabled=flag not in ("0", "false", "no", "off"),
                   min_bytes=integer("RTXMPI_SHM_MIN_BYTES", DEFAULT_MIN_BYTES, 0),
                   chunk_bytes=chunk - chunk % 8,
                   node_size=integer("RTXMPI_SHM_NODE_SIZE", None, 1))


CONFIG = ShmConfig()  # set by configure(); new groups take a copy


def configure(comm):
    """Collective over `comm` (rtxmpi.init): rank 0 parses the RTXMPI_SHM* variables and every
    rank adopts the result, or raises the same ConfigError. Returns the ShmConfig."""
    global CONFIG
    parsed = None
    if comm.Get_rank() == 0:
        try:
            parsed = ShmConfig.from_env()
        except ConfigError as exc:
            parsed = str(exc)
    parsed = comm.bcast(parsed, root=0)
    if isinstance(parsed, str):
        raise ConfigError(parsed)
    CONFIG = parsed
    return CONFIG


# MPI reduction op -> in-place numpy ufunc (bool travels as uint8: MAX is or, MIN is and)
_UFUNCS = ((MPI.SUM, np.add), (MPI.MAX, np.maximum), (MPI.MIN, np.minimum),
           (MPI.PROD, np.multiply))


def ufunc_of(mpi_op):
    for op, ufunc in _UFUNCS:
        if op is mpi_op or op == mpi_op:
            return ufunc
    return None


def _arena_dir():
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class NodeAllReduce:
    """The shared-memory (and hierarchical) all_reduce of one group; see the module docstring.

    Built by `create()` (collective over the group's communicator). Attributes: local_size,
    local_rank (this rank's index on its node), nodes (number of nodes), chunk_bytes.
    """

    def __init__(self, node, cross, mm, chunk_bytes):
        self.node, self.cross, self._mm = node, cross, mm
        self.local_size, self.local_rank = node.Get_size(), node.Get_rank()
        self.nodes = 1 if cross is None else cross.Get_size()
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = BUFFERS * chunk_bytes
        self._arena = np.frombuffer(mm, np.uint8)
        self._views = {}  # dtype -> [1-D view of each local rank's buffers]

    @classmethod
    def create(cls, comm, config):
        """Collective over `comm`: the engine, or None on every rank when the group has one rank
        per node, nodes of different sizes, or the arena cannot be created on some rank."""
        rank, size = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        if config.node_size:
            pretend = node.Split(node.Get_rank() // config.node_size, key=rank)
            node.Free()
            node = pretend
        local_size, local_rank = node.Get_size(), node.Get_rank()
        sizes = comm.allgather(local_size)
        if local_size == 1 or min(sizes) != max(sizes):
            node.Free()
            return None
        cross = comm.Split(local_rank, key=rank) if local_size < size else None
        chunk_bytes = config.chunk_bytes
        total = local_size * BUFFERS * chunk_bytes
        mm, error = None, None
        path = None
        if local_rank == 0:
            try:
                fd, path = tempfile.mkstemp(prefix="rtxmpi-shm-", dir=_arena_dir())
                try:
                    os.ftruncate(fd, total)
                finally:
                    os.close(fd)
            except OSError as exc:
                error, path = f"{type(exc).__name__}: {exc}", None
        path = node.bcast(path, root=0)
        if path is not None:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, total)
                finally:
                    os.close(fd)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        node.Barrier()  # every local rank has mapped (or failed to map) the file
        if local_rank == 0 and path is not None:
            os.unlink(path)
        if not comm.allreduce(error is None and mm is not None, op=MPI.LAND):
            if mm is not None:
                mm.close()
            node.Free()
            if cross is not None:
                cross.Free()
            return None
        engine = cls(node, cross, mm, chunk_bytes)
        mine = engine._arena[local_rank * engine.slot_bytes:(local_rank + 1) * engine.slot_bytes]
        mine.fill(0)  # first touch here, by the rank that writes it, not inside a timed call
        node.Barrier()
        return engine

    def _slots(self, dtype):
        views = self._views.get(dtype)
        if views is None:
            count = self.slot_bytes // dtype.itemsize
            views = [self._arena[i * self.slot_bytes:(i + 1) * self.slot_bytes].view(dtype)[:count]
                     for i in range(self.local_size)]
            self._views[dtype] = views
        return views

    def all_reduce(self, x, mpi_op):
        """Reduce the contiguous 1-D array `x` in place over the group; every rank must call,
        after every rank has arrived. Returns False (nothing done) for an MPI op it does not
        handle; the caller then uses MPI."""
        ufunc = ufunc_of(mpi_op)
        if ufunc is None or x.ndim != 1 or not x.flags.c_contiguous:
            return False
        total = x.size
        if total == 0:
            return True
        n, me, cross = self.local_size, self.local_rank, self.cross
        slots = self._slots(x.dtype)
        mine = slots[me]
        step = max(1, self.chunk_bytes // x.itemsize)
        chunks = -(-total // step)
        barrier = self.node.Barrier
        others = [i for i in range(n) if i != me]

        def layout(k):
            start = k * step
            m = min(step, total - start)
            base = (k % BUFFERS) * step
            return start, base, [(m * i) // n for i in range(n + 1)]

        def copy_in(k):
            start, base, cuts = layout(k)
            for i in others:
                lo, hi = cuts[i], cuts[i + 1]
                mine[base + lo:base + hi] = x[start + lo:start + hi]

        copy_in(0)
        barrier()
        for k in range(chunks):
            start, base, cuts = layout(k)
            lo, hi = cuts[me], cuts[me + 1]
            own = x[start + lo:start + hi]
            for i in others:
                ufunc(own, slots[i][base + lo:base + hi], out=own)
            if cross is not None:
                cross.Allreduce(MPI.IN_PLACE, own, mpi_op)
            mine[base + lo:base + hi] = own
            if k + 1 < chunks:
                copy_in(k + 1)
            barrier()
            for i in others:
                lo, hi = cuts[i], cuts[i + 1]
                x[start + lo:start + hi] = slots[i][base + lo:base + hi]
        return True

    def close(self):
        """Release the arena and the communicators (local; the group must not use it after)."""
        self._views.clear()
        self._arena = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it does
        for comm in (self.node, self.cross):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()
        self.node = self.cross = None
