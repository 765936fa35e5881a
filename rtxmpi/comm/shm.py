"""Shared-memory collectives on a node, and the hierarchical all_reduce / reduce_scatter across
nodes.

Open MPI's `Allreduce` between processes of one node runs far below the memory bandwidth for
large messages (about 0.5-2 GB/s busbw from 32 MiB on the 2-core CI machine, where one core
copies at about 20 GB/s), and every rtxmpi call pays a deadline-aware arrival check on top of it.
`NodeAllReduce` gives the MPI backend three faster paths, each with one deadline-aware wait as
its arrival check:

Mailbox (small all_reduce, one node; `small_bytes`): one synchronization. A shared mapping
(`/dev/shm`) holds per local rank a flag (its own cache line) and two slots. Every rank copies its
array into its slot of the call's parity and raises its flag to the call number; once every flag
has reached it, every rank reduces all slots in local-rank order into its array: every rank
computes bitwise the same result with no second synchronization. Slots alternate between calls,
so a rank one call ahead never overwrites a slot a peer still reads. The compiled mailbox
(`_mailbox.c`, built at install) does the copy, the flag store (release order), the spin on the
peers' flags (acquire loads, up to SPIN_NS) and the reduction in one C call, a few hundred
nanoseconds for a small message; the spin yields the core between polls after its first 500 ns,
and a peer later than the spin is waited for in Python, with the caller's deadline, yielding the
core between polls too: ranks that outnumber the cores (or share them with other processes) hand
the core to the peer they wait for, as MPI's progress does with mpi_yield_when_idle. Without the
extension a numpy mailbox does the same steps (up to NUMPY_SMALL_BYTES), relying on x86's total
store order for its plain stores. Each rank reads every slot, local_size times the message, so
the mailbox size shrinks as 1 / local_size (MAILBOX_READ_BYTES). The mailbox is off under ULFM (a
dead peer is reported through failing MPI requests, which a flag poll never sees).

Cross-memory (mode "cma", large messages; `min_bytes`): the reduce-scatter + all-gather all_reduce
(Rabenseifner, "Optimization of collective reduction operations", ICCS 2004; Thakur, Rabenseifner
and Gropp, IJHPCA 2005) with the local ranks reading and writing each other's arrays through Linux
cross-memory attach (`process_vm_readv` / `process_vm_writev`, the single-copy mechanism of Open
MPI's smsc/cma; step 2's loop runs in C without the GIL, `_mailbox.fold_peers`, with a ctypes
and numpy fallback; on one node with the compiled extension, steps 1, 2 and 4 are one C call,
`Mailbox.cross`, spinning up to SPIN_NS on each flag before the caller's deadline-aware wait).
The elements are split into `local_size` contiguous segments; local rank i owns segment i.
  1. every rank of the group publishes the address of its array (on one node in its flag line,
     then it raises its arrival flag; across nodes one all_gather of one int64 over the group:
     also the arrival check, with the deadline);
  2. for each piece of `chunk_bytes` of segment i: rank i reads that piece of every peer's array
     into a scratch buffer that stays in cache, folds it into its own array in place (its own
     value first, then the peers in ascending local-rank order) and, while the piece is still in
     cache, writes the reduced piece straight into every peer's array;
  3. across nodes (hierarchical path), segment i is instead all_reduced by MPI among the ranks
     that hold local index i on every node (one per node) before it is written to the peers, so
     each rank sends 1/local_size of the message over the network and all local ranks use it at
     once (the hierarchical / 2D all_reduce of Horovod and of Jia et al., "Highly scalable deep
     learning training system with mixed-precision", 2018);
  4. one node barrier (deadline-aware): no rank returns and reuses its array while a peer still
     reads or writes it.
  Two synchronizations per call; per rank, memory traffic of twice the message (read own and
  peer half, write own and peer half). Every rank's array in a registered shared region
  (shared_zeros): step 2 folds straight from the peers' mappings. Else, in the compiled call,
  step 2 may bounce instead (up to `bounce_bytes`), through a shared slot per rank of two
  round parities x local_size pieces (_mailbox.c, bounce_run): in round t each rank copies piece
  t of the other ranks' segments into its slot; rank i folds piece t of segment i from the
  peers' slots (the same order, so the same bits) into its array and its slot; every rank copies
  the other reduced pieces out. User-space copies (no page pinning, no system call), two flag
  waits per round, every rank running at once. Local rank 0 picks bounce or system calls per
  call by measured time (tuning.OnlineChoice, per size class) and publishes the pick with its
  arrival; ranks found on one CPU and nonblocking calls take the system calls. Availability is
  probed once per group (every local rank
  reads and writes a peer's probe word); it needs ptrace-read permission on the peers (same user;
  not forbidden by Yama or seccomp). reduce_scatter (one node, or hierarchical: local rank i first
  reduces on its node the rows of every rank with local index i, then those ranks reduce-scatter
  them by MPI) and all_gather (one node: every rank reads the peers' inputs straight into its
  output) use the same reads. A peer that exits during a transfer (ESRCH / EFAULT from a dead
  process) raises RankFailure naming it; any other failed transfer CollectiveError.

Mode "copy" (fallback, or `RTXMPI_SHM_CMA=0`; all_reduce only): a shared arena, one POSIX
shared-memory file per group and node (`/dev/shm`, unlinked as soon as every local rank has
mapped it, so nothing is left behind even if a process dies), holding per local rank `BUFFERS`
chunk buffers. Allocated once, first touched at creation and reused; its size does not depend on
the message (large messages are pipelined through it), so it never grows. Per chunk k: every
rank copies the segments other ranks own into its buffer; rank i folds the copies of segment i
into its own data in place (then step 3 above) and publishes the result in its buffer; every rank
copies the reduced segments out. One node barrier per chunk separates "chunk k reduced and chunk
k+1 copied in" from "chunk k copied out"; with three buffers per rank no rank overwrites a buffer
another still reads.

Memory ordering: stores made before a node barrier are visible to the other ranks after it (Open
MPI's shared-memory barrier uses atomics with full fences). Every element is reduced by exactly
one rank and copied to the others (or, in the mailbox, by every rank in the same order), so every
rank gets bitwise the same result. The order of the terms is fixed by the element's position and
the group layout (deterministic from run to run); for more than two local ranks it is not the
rank order.

Selection (MPIBackend, blocking calls; the same on every rank whichever of its paths a rank took):
all_reduce up to `small_bytes` on a group whose ranks all share one node takes the mailbox; from
`NodeAllReduce.all_reduce_from` on a group whose ranks share nodes (the same number on each) the
cross-memory path (or the arena); in between, and for groups with one rank per node, MPI's
algorithms. all_reduce_from is `min_bytes` (default DEFAULT_MIN_BYTES), or, when that is not set
and the compiled cross-memory call runs (one node), just above the mailbox and CROSS_SMALL_BYTES
(the mailbox then stops there by default). Nonblocking all_reduce on one node with the compiled
mailbox takes the queue (start_all_reduce) at the mailbox's sizes and, in mode "cma", from
all_reduce_from; other nonblocking calls take MPI's. reduce_scatter takes the cross-memory path
from `min_bytes`, all_gather from 16 times it.
Configuration, read on rank 0 by `configure()` at `rtxmpi.init()` and used on every rank:
`RTXMPI_SHM=0` turns every path off; `RTXMPI_SHM_CMA=0` forces the arena mode;
`RTXMPI_SHM_MIN_BYTES` (default: see Selection); `RTXMPI_SHM_SMALL_BYTES` (default
`DEFAULT_SMALL_BYTES` or CROSS_SMALL_BYTES, see Selection; 0 turns the mailbox off);
`RTXMPI_SHM_CHUNK_BYTES` (default `DEFAULT_CHUNK_BYTES`); `RTXMPI_SHM_BOUNCE_BYTES` (default
`DEFAULT_BOUNCE_BYTES`; 0 turns the bounce off); `RTXMPI_SHM_NODE_SIZE=k` splits every
node into pretend nodes of k consecutive local ranks, to exercise the hierarchical path on one
machine (tests). Groups take the settings current when they are created.
"""
import collections
import contextlib
import ctypes
import errno
import mmap
import os
import platform
import sys
import tempfile
import warnings
import weakref

import numpy as np
from mpi4py import MPI

from ..backend import env_flag
from ..errors import CollectiveError, CollectiveMismatch, ConfigError, RankFailure
from . import fingerprint, monitor, tuning
from .failure import ulfm_enabled

try:  # the compiled mailbox (_mailbox.c, built at install); numpy and plain stores without it
    from . import _mailbox
except ImportError:
    _mailbox = None

# Messages from DEFAULT_MIN_BYTES take the cross-memory reduce-scatter + all-gather (its two
# synchronizations and its system calls cost more than MPI's single-copy algorithms below that);
# messages up to DEFAULT_SMALL_BYTES take the one-synchronization mailbox (one node only); sizes
# in between use MPI. Crossovers measured with bench/collectives.py (bench/RESULTS.md).
DEFAULT_MIN_BYTES = 2 << 20
# With the compiled cross-memory all_reduce (Mailbox.cross: arrival, piece loop and closing barrier
# in one C call) that path beats the mailbox and MPI from about 32-64 KiB at 2 local ranks, so by
# default the mailbox stops at CROSS_SMALL_BYTES and the cross-memory path takes every larger
# all_reduce (RTXMPI_SHM_MIN_BYTES / RTXMPI_SHM_SMALL_BYTES, when set, are used as given; with
# RTXMPI_SHM_MIN_BYTES set, the mailbox keeps its DEFAULT_SMALL_BYTES default below it).
CROSS_SMALL_BYTES = 32 << 10
NUMPY_SMALL_BYTES = 32 << 10  # the numpy mailbox's largest message (its Python costs grow with it)
DEFAULT_SMALL_BYTES = (1 << 20) if _mailbox is not None else NUMPY_SMALL_BYTES
# every rank of the mailbox reads every rank's slot: local_size x the message per rank and call,
# so the largest message shrinks as 1 / local_size (at 2 ranks, the default above)
MAILBOX_READ_BYTES = 2 << 20
DEFAULT_CHUNK_BYTES = 256 << 10
MIN_CHUNK_BYTES = 4 << 10
MAX_BUFFER_BYTES = 256 << 20  # largest mailbox slot or chunk a setting may ask for
BUFFERS = 3  # triple buffering: one barrier per chunk (see the module docstring)
NEVER = sys.maxsize  # min_bytes when the path is off
FLAG_BYTES = 128  # two cache lines per local rank for its flags (_mailbox.c's LINE)
# the compiled cross-memory all_reduce may bounce arrays up to RTXMPI_SHM_BOUNCE_BYTES (default:
# every size) through shared slots, pipelined (user-space copies: no page pinning, no system
# call); local rank 0's tuner picks it or the system calls per call, and ranks that share a CPU
# take the system calls
DEFAULT_BOUNCE_BYTES = NEVER
BOUNCE_SLOT_BYTES = 4 << 20  # largest bounce slot per rank: 2 round parities x local_size pieces
TSO_MACHINES = ("x86_64", "amd64", "i386", "i686")
# numpy's plain stores to the flag lines (numpy mailbox, cross-memory arrival flags) rely on x86's
# total store order; elsewhere only the compiled mailbox (atomics) uses the lines
TSO = platform.machine().lower() in TSO_MACHINES
BOX_VIEWS = 256  # cached mailbox views (dtype, size, parity); cleared when full
LIVENESS_POLLS = 1000  # flag polls between checks that the local peers are alive
SPIN_POLLS = 64  # polls of a mailbox flag (a few microseconds) before yielding the core
SPIN_NS = 20_000  # the compiled mailbox's spin on the peers' flags before the Python wait
# a nonblocking mailbox all_reduce's spin when it posts: peers already in the call (a few us
# apart, as ranks leave a barrier) complete it there, with no queue entry or later poll
START_SPIN_NS = 3_000


class ShmConfig:
    """Shared-memory path settings of one group (see the module docstring).

    enabled (bool), min_bytes (int, smallest message that takes the cross-memory path; None:
    DEFAULT_MIN_BYTES, or for all_reduce with the compiled cross-memory path just above the
    mailbox), small_bytes (int, largest message that takes the mailbox; 0: never; None:
    DEFAULT_SMALL_BYTES, at most MAILBOX_READ_BYTES / local_size, and CROSS_SMALL_BYTES with the
    compiled cross-memory path), chunk_bytes (int,
    pipeline chunk; a multiple of 8), node_size (int or None: pretend nodes of this many local
    ranks), cma (bool: cross-memory access allowed), bounce_bytes (int, largest all_reduce the
    compiled cross-memory path may bounce through shared slots; 0: never), bounce_any_cpu (bool:
    bounce even when two local ranks share a CPU; tests and benchmarks).
    """

    __slots__ = ("enabled", "min_bytes", "chunk_bytes", "node_size", "cma", "small_bytes",
                 "bounce_bytes", "bounce_any_cpu")

    def __init__(self, enabled=True, min_bytes=None, chunk_bytes=DEFAULT_CHUNK_BYTES,
                 node_size=None, cma=True, small_bytes=None, bounce_bytes=DEFAULT_BOUNCE_BYTES,
                 bounce_any_cpu=False):
        self.enabled = bool(enabled)
        self.min_bytes = None if min_bytes is None else int(min_bytes)
        self.chunk_bytes, self.node_size, self.cma = int(chunk_bytes), node_size, bool(cma)
        self.small_bytes = None if small_bytes is None else int(small_bytes)
        self.bounce_bytes, self.bounce_any_cpu = int(bounce_bytes), bool(bounce_any_cpu)

    @property
    def threshold(self):
        """Smallest message (bytes) that takes the shared-memory path (all_reduce: see
        NodeAllReduce.all_reduce_from); NEVER when off."""
        if not self.enabled:
            return NEVER
        return DEFAULT_MIN_BYTES if self.min_bytes is None else self.min_bytes

    @property
    def small_threshold(self):
        """Largest message (bytes) that may take the mailbox; -1 when off."""
        small = DEFAULT_SMALL_BYTES if self.small_bytes is None else self.small_bytes
        return small if self.enabled and small > 0 else -1

    def copy(self):
        return ShmConfig(self.enabled, self.min_bytes, self.chunk_bytes, self.node_size, self.cma,
                         self.small_bytes, self.bounce_bytes, self.bounce_any_cpu)

    def __repr__(self):
        return (f"ShmConfig(enabled={self.enabled}, min_bytes={self.min_bytes}, "
                f"small_bytes={self.small_bytes}, chunk_bytes={self.chunk_bytes}, "
                f"node_size={self.node_size}, cma={self.cma}, bounce_bytes={self.bounce_bytes}, "
                f"bounce_any_cpu={self.bounce_any_cpu})")

    @classmethod
    def from_env(cls, environ=os.environ):
        """Parse RTXMPI_SHM* variables. Raises ConfigError naming the variable and the value."""
        def integer(name, default, low, high=NEVER):
            text = environ.get(name)
            if text is None or not text.strip():
                return default
            try:
                value = int(text.strip())
            except ValueError:
                raise ConfigError(f"{name}={text!r} is not an integer (bytes)") from None
            if not low <= value <= high:
                raise ConfigError(f"{name}={text!r} must be >= {low}"
                                  + (f" and <= {high}" if high < NEVER else ""))
            return value

        chunk = integer("RTXMPI_SHM_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES,
                        MAX_BUFFER_BYTES)
        return cls(enabled=env_flag("RTXMPI_SHM", True, environ),
                   cma=env_flag("RTXMPI_SHM_CMA", True, environ),
                   min_bytes=integer("RTXMPI_SHM_MIN_BYTES", None, 0),
                   small_bytes=integer("RTXMPI_SHM_SMALL_BYTES", None, 0, MAX_BUFFER_BYTES),
                   chunk_bytes=chunk - chunk % 8,
                   node_size=integer("RTXMPI_SHM_NODE_SIZE", None, 1),
                   bounce_bytes=integer("RTXMPI_SHM_BOUNCE_BYTES", DEFAULT_BOUNCE_BYTES, 0))


CONFIG = ShmConfig()  # set by configure(); new groups take a copy


def shared_zeros(shape, dtype=np.float32):
    """A zero-filled C-contiguous numpy array (shape: int or tuple; dtype: any numpy dtype) whose
    memory the other ranks of this node can map: a Linux memfd mapping, registered with the
    compiled extension by its address. A blocking or nonblocking all_reduce on one node whose
    every rank passes an array inside such memory (the whole array or any contiguous slice, e.g.
    a gradient bucket) folds straight from the peers' memory and writes the result straight into
    it: no system call and no copy through a scratch buffer per piece (the registered-buffer idea
    of MPI-3 shared-memory windows and NCCL's user-buffer registration). Otherwise the array
    behaves like np.zeros; it is freed when it and its views are. Where there is no memfd or no
    compiled extension, returns np.zeros(shape, dtype). Local: any rank may call it any time; the
    fast path needs the peers' arrays to be shared too (checked at each call, the same decision
    on every rank). Raises what np.zeros raises for a bad shape or dtype, and MemoryError when
    the array is larger than this machine's memory plus swap or the memory cannot be had."""
    dtype = np.dtype(dtype)
    try:  # np.zeros' checks of the shape, nothing allocated
        shape = np.broadcast_to(np.zeros((), dtype), shape).shape
    except (TypeError, ValueError):
        return np.zeros(shape, dtype)  # raises np.zeros' own error
    count = int(np.prod(shape, dtype=np.int64))
    if (_mailbox is None or not hasattr(os, "memfd_create") or count * dtype.itemsize == 0
            or dtype.hasobject):  # objects: pointers, nothing another process could read
        return np.zeros(shape, dtype)
    size = -(-count * dtype.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    if size > _memory_bytes():  # a memfd is sparse: it would only fail when touched
        raise MemoryError(f"Unable to allocate {size / 2**30:.3g} GiB for an array with shape "
                          f"{shape} and data type {dtype} (more than this machine's memory)")
    try:
        fd = os.memfd_create("rtxmpi-shared", os.MFD_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise MemoryError(f"Unable to allocate a shared array with shape {shape} and data "
                              f"type {dtype}: {exc.strerror}") from None
        raise
    try:
        os.ftruncate(fd, size)
        try:
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            raise MemoryError(f"Unable to allocate {size / 2**30:.3g} GiB for an array with "
                              f"shape {shape} and data type {dtype}: {exc.strerror}") from None
        start = np.frombuffer(mapping, np.uint8, 1).ctypes.data  # no buffer export kept
        owner = _SharedRegion(start, size)
        array = np.asarray(owner)[:count * dtype.itemsize].view(dtype).reshape(shape)
        _mailbox.register_region(start, size, fd, os.fstat(fd).st_ino)
    except BaseException:
        os.close(fd)
        raise
    # every array over the memory (views too) holds `owner` (their base chain), not the mapping
    weakref.finalize(owner, _release_region, start, fd, mapping).atexit = False
    return array


def _memory_bytes():
    """This machine's physical memory plus swap, in bytes (sysconf and /proc/meminfo)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("SwapTotal:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


class _SharedRegion:
    """The memory of one shared_zeros mapping as numpy sees it (bytes, __array_interface__): the
    arrays over it hold this object, and its finalizer unmaps the memory."""

    def __init__(self, start, size):
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (start, False),
                                    "version": 3}


def _release_region(start, fd, mapping):
    """shared_zeros' arrays are gone: forget their region while it is still mapped (once it is
    unmapped, another thread may get that address for a new array, which must not look shared),
    then unmap it and close the memfd (the peers' mappings keep their pages until they drop
    them). Not at exit: arrays may still be in use then."""
    _mailbox.unregister_region(start)
    mapping.close()
    os.close(fd)


def configure(comm):
    """Collective over `comm` (rtxmpi.init): rank 0 parses the RTXMPI_SHM* variables and every
    rank adopts the result, or raises the same ConfigError. Returns the ShmConfig."""
    global CONFIG
    fields, error = np.zeros(len(ShmConfig.__slots__), np.int64), None
    if comm.Get_rank() == 0:
        try:
            parsed = ShmConfig.from_env()
            fields[:] = [-1 if v is None else int(v)
                         for v in (getattr(parsed, name) for name in ShmConfig.__slots__)]
        except ConfigError as exc:
            error = str(exc)
    error = _bcast_text(comm, error)
    if error is not None:
        raise ConfigError(error)
    comm.Bcast(fields, root=0)
    values = {name: None if name in _OPTIONAL and v == -1 else int(v)
              for name, v in zip(ShmConfig.__slots__, fields.tolist())}
    CONFIG = ShmConfig(**values)
    return CONFIG


_OPTIONAL = ("min_bytes", "node_size", "small_bytes")  # ShmConfig fields that may be None (-1)


# The set-up's small exchanges, as typed buffers (no pickling).
def _allgather_int(comm, value):
    """Every rank's int `value`, by rank. Collective over `comm`."""
    out = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([value], np.int64), out)
    return [int(v) for v in out]


def _allreduce_int(comm, value, op):
    """The reduction (MPI.MIN / MPI.MAX) of every rank's int `value`. Collective over `comm`."""
    out = np.empty(1, np.int64)
    comm.Allreduce(np.array([int(value)], np.int64), out, op=op)
    return int(out[0])


def _all_true(comm, flag):
    """Whether `flag` is true on every rank. Collective over `comm`."""
    return _allreduce_int(comm, bool(flag), MPI.MIN) == 1


def _bcast_text(comm, text, root=0):
    """`text` (str or None) of rank `root` on every rank: its UTF-8 length, then its bytes.
    Collective over `comm`."""
    data = b"" if text is None or comm.Get_rank() != root else text.encode()
    size = np.array([-1 if text is None and comm.Get_rank() == root else len(data)], np.int64)
    comm.Bcast(size, root=root)
    if size[0] < 0:
        return None
    buf = bytearray(data) if comm.Get_rank() == root else bytearray(int(size[0]))
    comm.Bcast([buf, MPI.BYTE], root=root)
    return buf.decode()


# MPI reduction op -> in-place numpy ufunc (bool travels as uint8: MAX is or, MIN is and)
_UFUNCS = ((MPI.SUM, np.add), (MPI.MAX, np.maximum), (MPI.MIN, np.minimum),
           (MPI.PROD, np.multiply))


_FOLD_CODES = {np.add: 0, np.maximum: 1, np.minimum: 2, np.multiply: 3}  # _mailbox.c's op codes
_FOLD_CHARS = "fdbBhHiIlLqQ"  # the dtypes _mailbox.c folds (native order): float32/64, integers


def ufunc_of(mpi_op):
    for op, ufunc in _UFUNCS:
        if op is mpi_op or op == mpi_op:
            return ufunc
    return None


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_cma():
    """libc's process_vm_readv and process_vm_writev (Linux cross-memory attach, "CMA"), or
    None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = libc.process_vm_readv, libc.process_vm_writev
    except (OSError, AttributeError):
        return None
    for fn in fns:
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
    return fns


class PeerAccessError(OSError):
    """A cross-memory read or write of a local peer's array failed. Attribute: pid (the peer)."""

    def __init__(self, err, pid, what):
        super().__init__(err, f"{what} pid {pid}: {os.strerror(err)}")
        self.pid = pid


class _PeerReader:
    """Copies bytes out of (read) or into (write) another process's memory with one system call
    each (process_vm_readv / process_vm_writev: the kernel copies directly, no staging buffer).
    Needs ptrace-read permission on the peer: same user, and not forbidden by the Yama ptrace
    scope or a seccomp profile."""

    def __init__(self, fns):
        self._readv, self._writev = fns
        self._local, self._remote = _Iovec(), _Iovec()
        self._local_ref, self._remote_ref = ctypes.byref(self._local), ctypes.byref(self._remote)

    def _move(self, fn, what, pid, local_addr, remote_addr, nbytes):
        local, remote = self._local, self._remote
        while nbytes > 0:
            local.base, local.len, remote.base, remote.len = local_addr, nbytes, remote_addr, nbytes
            got = fn(pid, self._local_ref, 1, self._remote_ref, 1, 0)
            if got <= 0:
                raise PeerAccessError(ctypes.get_errno() or errno.EIO, pid, what)
            local_addr, remote_addr, nbytes = local_addr + got, remote_addr + got, nbytes - got

    def read(self, pid, dst, src, nbytes):
        """Copy `nbytes` from address `src` of process `pid` to address `dst` here;
        PeerAccessError."""
        self._move(self._readv, "process_vm_readv from", pid, dst, src, nbytes)

    def write(self, pid, dst, src, nbytes):
        """Copy `nbytes` from address `src` here to address `dst` of process `pid`;
        PeerAccessError."""
        self._move(self._writev, "process_vm_writev to", pid, src, dst, nbytes)


def process_gone(pid):
    """True when process `pid` has exited (no /proc entry, or a zombie / dead task). Local."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state in (b"Z", b"X", b"x")


def peer_failure(op, exc, pids, ranks, me):
    """The error for a failed cross-memory transfer `exc` (PeerAccessError) in collective `op`:
    RankFailure naming the peer's rank when that process has exited (ESRCH, or EFAULT from a
    dying process), else CollectiveError. pids / ranks: each local rank's pid and world rank;
    me: this process's world rank. Local."""
    pid = getattr(exc, "pid", None)
    if pid in pids and process_gone(pid):
        rank = ranks[pids.index(pid)]
        return RankFailure(f"{op}: rank {rank} (pid {pid}, on this node) exited during a "
                           f"cross-memory transfer ({exc}) [rank {me}]", ranks=[rank])
    return CollectiveError(f"{op}: a cross-memory transfer with a local peer failed ({exc}); set "
                           "RTXMPI_SHM_CMA=0 to use the shared arena (all_reduce) or MPI instead "
                           f"[rank {me}]")


def watch_peers(poll, pids, ranks, me, every=LIVENESS_POLLS, on_failure=None):
    """`poll` that also checks, every `every` calls, whether a local peer process has exited, and
    then raises RankFailure naming it: a flag wait has no MPI request through which a dead peer
    could be reported, and without it only the deadline would end the wait. pids / ranks: each
    local rank's pid and world rank; me: this process's world rank; on_failure(exc): called with
    the RankFailure before it is raised."""
    calls = 0

    def watched():
        nonlocal calls
        if poll():
            return True
        calls += 1
        if calls % every == 0:
            try:
                check_alive(pids, ranks, me)
            except RankFailure as exc:
                if on_failure is not None:
                    on_failure(exc)
                raise
        return False

    return watched


def check_alive(pids, ranks, me):
    """Raise RankFailure naming the first local peer process (pids / ranks, as for watch_peers)
    that has exited. Local."""
    for pid, rank in zip(pids, ranks):
        if rank != me and process_gone(pid):
            raise RankFailure(f"rank {rank} (pid {pid}, on this node) exited while rank {me} "
                              "waited for it in a shared-memory collective", ranks=[rank])


def fail_queued(error):
    """End every engine's queue of nonblocking all_reduces with `error`: each queued call's
    poll() raises it and no wait runs those queues again. For rtxmpi.comm.replace_world (elastic
    shrink): the old world's groups are revoked, so their queued transfers never complete, and a
    wait of the new world must not run them (a dead peer's transfer would raise RankFailure out
    of it). Local."""
    for progress in tuple(monitor.PROGRESS):
        engine = getattr(progress, "__self__", None)
        if isinstance(engine, NodeAllReduce):
            engine._fail(error)


def _probe_peers(node, comm, enabled):
    """Collective over `comm` (node: this rank's node communicator): a _PeerReader and every
    local rank's pid when every rank of `comm` can read and write its local peers' memory, else
    None."""
    fns = _load_cma() if enabled else None
    local_size, local_rank = node.Get_size(), node.Get_rank()
    probe = np.array([os.getpid(), 0, 0x5EED0000 + local_rank], np.int64)
    probe[1] = probe.ctypes.data + 16  # address of probe[2]
    table = np.empty((local_size, 3), np.int64)
    node.Allgather(probe, table)
    reader = _PeerReader(fns) if fns is not None else None
    ok = reader is not None
    if ok:
        got = np.zeros(1, np.int64)
        for j in range(local_size):
            if j == local_rank:
                continue
            try:
                reader.read(int(table[j, 0]), got.ctypes.data, int(table[j, 1]), 8)
                ok = ok and int(got[0]) == int(table[j, 2])
                reader.write(int(table[j, 0]), int(table[j, 1]), got.ctypes.data, 8)  # same value
            except OSError:
                ok = False
                break
    ok = _all_true(comm, ok)
    node.Barrier()  # every peer has read our probe before it goes away
    return (reader, [int(p) for p in table[:, 0]]) if ok else None


def _arena_dir():
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _reserve(fd, total):
    """Size the file `fd` to `total` bytes with its pages reserved: on tmpfs a /dev/shm too small
    for it fails here (OSError ENOSPC, then no shared-memory path) rather than with SIGBUS at the
    first touch of a page. File systems without fallocate get a plain ftruncate."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, total)


def _map_arena(node, comm, total):
    """Collective over `comm`: a shared mapping of `total` bytes common to the local ranks of
    `node` (a /dev/shm file, unlinked once every local rank has mapped it), or None on every rank
    when some rank could not create or map it."""
    mm, ok, path = None, True, None
    if node.Get_rank() == 0:
        try:
            fd, path = tempfile.mkstemp(prefix="rtxmpi-shm-", dir=_arena_dir())
            try:
                _reserve(fd, total)
            finally:
                os.close(fd)
        except (OSError, OverflowError):
            if path is not None:
                os.unlink(path)
            ok, path = False, None
    path = _bcast_text(node, path)
    if path is not None:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, total)
            finally:
                os.close(fd)
        except OSError:
            ok = False
    node.Barrier()  # every local rank has mapped (or failed to map) the file
    if node.Get_rank() == 0 and path is not None:
        os.unlink(path)
    if not _all_true(comm, ok and mm is not None):
        if mm is not None:
            mm.close()
        return None
    return mm


def yielding(poll):
    """`poll` that gives the core away (sched_yield) each time it finds nothing yet."""
    return lambda: poll() or _yield()


def _yield():
    """Give the core away once (like Open MPI's progress loop with mpi_yield_when_idle): ranks
    may outnumber cores, and the peer a poll waits for may need this one. Returns False."""
    os.sched_yield()
    return False


# the dtypes _mailbox.c folds, by the index of their character in _FOLD_CHARS, and its type
# and op codes (T_* and OP_* in _mailbox.c), for the size-mismatch message
_FOLD_NAMES = {i: np.dtype(c).name for i, c in enumerate(_FOLD_CHARS)}
_TYPE_NAMES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
               "uint64")
_OP_NAMES = ("sum", "max", "min", "prod")


def _described(keys):
    """Mailbox.keys() as text: 'N bytes, dtype, op' per local rank."""
    return [f"{n} bytes, {_TYPE_NAMES[t]}, {_OP_NAMES[op]}" for n, t, op in keys]


# Mailbox.cross statuses that wait for the peers (on cross_ready()): status -> stage to resume at
_CROSS_WAITS = {1: 1, 4: 2, 2: 3}
_ALGORITHMS = (0, 1)  # local rank 0's tuner picks the system calls (0) or the bounce (1)


def _box_column(call):
    """The flag line column of a mailbox call's element count (its code follows): [11] for even
    calls, [13] for odd ones (_mailbox.c)."""
    return 11 + 2 * (call & 1)


def _finished():
    """The poll() of a nonblocking call that completed when it started."""
    return True


def _wait_all(requests):
    """Complete MPI requests, or poll a callable until it returns True (no deadline: callers run
    under the backend's watchdog entry)."""
    if not callable(requests):
        MPI.Request.Waitall(requests)
        return
    while not (requests() or _yield()):
        pass


def describe(backend, size=str):
    """One line on what the all_reduce of an MPI backend's group runs (blocking, then
    async_op=True), after its first blocking all_reduce built the engine (rtxmpi info,
    bench/collectives.py). size(n): bytes as text."""
    config, engine = backend.shm_config, backend._shm
    if not config.enabled:
        return "off (RTXMPI_SHM=0): MPI at every size"
    if not engine:
        return ("not built yet (no all_reduce large or small enough)" if engine is None
                else "not used: one rank per node, or nodes with different rank counts")
    kind = "compiled" if engine.mailbox is not None else "numpy"
    mailbox = (f"mailbox ({kind}) up to {size(engine.small_bytes)}" if engine.small_bytes > 0
               else f"no mailbox ({engine.mailbox_off})")
    start = engine.all_reduce_from
    larger = (f"{engine.mode} for every larger message" if start == max(engine.small_bytes, 0) + 1
              else f"{engine.mode} from {size(start)} (between: MPI)")
    if engine.bounce_bytes:
        upto = "" if engine.bounce_bytes == NEVER else f" up to {size(engine.bounce_bytes)}"
        larger += (f", bounced through shared slots{upto} at every call" if engine.bounce_any_cpu
                   else f" or bounced through shared slots{upto}, picked per call by measured "
                   "time (never on a shared CPU)")
    shared = ("shared_zeros arrays folded from the peers' memory" if engine.mailbox is not None
              and engine.mode == "cma" else f"shared_zeros arrays as plain memory "
              f"({engine.mailbox_off or 'no cross-memory access'})")
    why = engine.mailbox_off or "no compiled mailbox"
    queued = ("async_op=True: queued on the same paths (never bounced)"
              if engine.mailbox is not None else f"async_op=True: MPI's Iallreduce ({why})")
    return (f"{mailbox}; {larger}; {shared}; {queued}; "
            f"chunk {size(config.chunk_bytes)}; {engine.local_size} local ranks x "
            f"{engine.nodes} node(s); RTXMPI_SHM=0 turns it off")


class NodeAllReduce:
    """The shared-memory (and hierarchical) collectives of one group; see the module docstring.

    Built by `create()` (collective over the group's communicator). Attributes: mode ("cma":
    ranks read and write each other's arrays directly; "copy": through the shared arena),
    local_size, local_rank (this rank's index on its node), nodes (number of nodes),
    chunk_bytes.

    Every method is collective over the group and takes two hooks from the caller: `wait(requests)`
    completes MPI requests (the backend passes a deadline-aware wait, so an arrival that never
    comes raises CollectiveTimeout; default: MPI Waitall), and `guard()` a context manager around
    a blocking MPI call (the backend's watchdog entry; default: none).
    """

    _lines = None  # the mailbox's flag lines (__init__)
    _poisoned = 0  # a mismatched cross-memory call this rank posted (_post_cross), else 0
    # the mailbox call during which this rank posted a mismatched cross-memory call, and the
    # cross-memory call during which it posted a mismatched mailbox call: once per call each
    _cross_posted_in = _box_posted_in = 0
    _no_data = np.zeros(0, np.int64)  # the (empty, never written) array of arrive()'s mailbox call

    def __init__(self, comm, node, cross, chunk_bytes, *, members=None, mm=None, peers=None,
                 box=None, small_bytes=0, compiled=False, min_bytes=DEFAULT_MIN_BYTES,
                 bounce_slot=0, bounce_bytes=0, bounce_any_cpu=False):
        self.comm, self.node, self.cross, self._mm, self._box_mm = comm, node, cross, mm, box
        self.local_size, self.local_rank = node.Get_size(), node.Get_rank()
        self.nodes = 1 if cross is None else cross.Get_size()
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = BUFFERS * chunk_bytes
        self.mode = "copy" if peers is None else "cma"
        size = comm.Get_size()
        members = list(members) if members is not None else list(range(size))
        # group ranks of the local ranks (by local rank), and of the cross ranks (by cross rank)
        self._local_group = _allgather_int(node, comm.Get_rank())
        self._node_pids = _allgather_int(node, os.getpid())
        # world ranks of the local ranks (by local rank), and this rank's (RankFailure)
        self._local_ranks = [members[g] for g in self._local_group]
        self._group_ranks = members
        self._rank = members[comm.Get_rank()]
        self._cross_group = ([comm.Get_rank()] if cross is None else
                             _allgather_int(cross, comm.Get_rank()))
        self._arena = None if mm is None else np.frombuffer(mm, np.uint8)
        self._views = {}  # dtype -> [1-D view of each local rank's buffers]
        self._stage = np.zeros(0, np.uint8)  # hierarchical reduce_scatter: grown, reused
        # the mailbox (one node): per local rank a flag line, two slots of small_bytes (maybe 0)
        # and the compiled cross-memory path's bounce slot of bounce_slot (maybe 0). Flag line
        # (int64): [0] mailbox call, [1] cross-memory arrival call, [2] this call's array address,
        # [3] cross-memory done call, [4]-[6] shared region, [7] size, dtype and op, [8]-[10]
        # bounce rounds and CPU (_mailbox.c). bounce_bytes: largest all_reduce that may bounce.
        self.small_bytes = small_bytes if box is not None and small_bytes > 0 else -1
        bounce = box is not None and compiled and bounce_slot > 0
        self.bounce_bytes = bounce_bytes if bounce else 0
        self.bounce_any_cpu = bounce_any_cpu
        # local rank 0 times both algorithms and picks (the others follow its flag line); with
        # bounce_any_cpu every call that may bounce does
        self._tuner = (tuning.OnlineChoice() if bounce and bounce_bytes and not bounce_any_cpu
                       and self.local_rank == 0 else None)
        self.mailbox_off = None  # create(): why there is no mailbox (None: there is one)
        self.group_name = "?"  # the group's name, for CollectiveMismatch (set by its backend)
        self.all_reduce_from = min_bytes  # smallest all_reduce of the cross-memory path / arena
        self._lines = self.mailbox = None
        if box is not None:
            region = FLAG_BYTES + 2 * small_bytes + bounce_slot
            raw = np.frombuffer(box, np.uint8)
            self._lines = raw.view(np.int64).reshape(self.local_size, region // 8)
            self._flags = self._lines[:, 0]
            self._cma_calls = 0
            self._boxes = [[raw[j * region + FLAG_BYTES + k * small_bytes:
                                j * region + FLAG_BYTES + (k + 1) * small_bytes] for k in (0, 1)]
                           for j in range(self.local_size)]
            self._box_slots = [[boxes[k] for boxes in self._boxes] for k in (0, 1)]
            self._box_calls = 0
            self._box_views = {}  # (dtype, count, parity) -> [typed view of each rank's slot]
            self.mailbox = (_mailbox.Mailbox(box, self.local_size, self.local_rank, small_bytes,
                                             tuple(op for op, _ in _UFUNCS),
                                             peers[1] if peers is not None else None,
                                             bounce_slot, bounce_max=self.bounce_bytes,
                                             bounce_any_cpu=bounce_any_cpu)
                            if compiled else None)
        self._queue = collections.deque()  # nonblocking mailbox and cross-memory all_reduces
        if peers is not None:
            self._reader, self._pids = peers
            self._tmp = np.zeros(chunk_bytes, np.uint8)  # touched once, reused
            self._my_addr = np.zeros(3, np.int64)  # (address, key, code) of this call's array
            self._addrs = np.zeros((size, 3), np.int64)

    @classmethod
    def create(cls, comm, config, members=None):
        """Collective over `comm`: the engine, or None on every rank when the group has one rank
        per node, nodes of different sizes, or neither cross-memory access nor the arena work on
        every rank. members: world ranks of the group (for RankFailure), by group rank."""
        rank, size = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        if config.node_size:
            pretend = node.Split(node.Get_rank() // config.node_size, key=rank)
            node.Free()
            node = pretend
        local_size, local_rank = node.Get_size(), node.Get_rank()
        sizes = _allgather_int(comm, local_size)
        if local_size == 1 or min(sizes) != max(sizes):
            node.Free()
            return None
        cross = comm.Split(local_rank, key=rank) if local_size < size else None
        # flags need MPI calls under ULFM: a dead peer is reported through a failing MPI
        # request, which a flag poll would never see (RankFailure for shrink-and-continue)
        # (the compiled mailbox orders its stores with atomics; the numpy one needs x86's order).
        # Ranks that outnumber the cores poll too: every poll yields the core to the peer it
        # waits for (with 2 ranks pinned to one CPU, 8 B took 8-11 us against MPI's 13-14 us)
        ordered = (cross is None and not ulfm_enabled() and (_mailbox is not None or TSO))
        # agreed: _map_arena below is collective, and each rank's facts (environment, installed
        # extension) are its own
        ordered = _all_true(comm, ordered)
        compiled = _all_true(comm, ordered and _mailbox is not None)
        peers = _probe_peers(node, comm, config.cma)
        # slots in whole cache lines, so every rank's flag line starts one (FLAG_BYTES)
        small = max(config.small_threshold, 0) // FLAG_BYTES * FLAG_BYTES if ordered else 0
        small = _allreduce_int(comm, small if compiled else min(small, NUMPY_SMALL_BYTES), MPI.MIN)
        if config.small_bytes is None:  # the default: less per message as local ranks add reads
            fast = compiled and peers is not None and config.min_bytes is None
            small = min(small, MAILBOX_READ_BYTES // local_size // FLAG_BYTES * FLAG_BYTES,
                        CROSS_SMALL_BYTES if fast else NEVER)
        # the bounce slots: only for the compiled cross-memory path; two round parities of
        # local_size pieces of whole cache lines (a chunk, less as local ranks add pieces);
        # dropped if /dev/shm cannot hold them (the mailbox matters more)
        piece = min(config.chunk_bytes, BOUNCE_SLOT_BYTES // (2 * local_size))
        bounce = (2 * local_size * (piece // FLAG_BYTES * FLAG_BYTES)
                  if compiled and peers is not None and config.bounce_bytes > 0 else 0)
        total = local_size * (FLAG_BYTES + 2 * small + bounce)
        box = _map_arena(node, comm, total) if ordered else None
        if ordered and box is None and bounce:
            bounce, total = 0, local_size * (FLAG_BYTES + 2 * small)
            box = _map_arena(node, comm, total)
        if ordered and box is None and comm.Get_rank() == 0:  # the same on every rank
            warnings.warn(f"rtxmpi: /dev/shm could not hold the all_reduce mailbox ({total} bytes "
                          f"for {local_size} local ranks); all_reduce up to {small} bytes uses "
                          "MPI instead (a smaller RTXMPI_SHM_SMALL_BYTES, or a larger /dev/shm, "
                          "brings it back)", RuntimeWarning, stacklevel=2)
        if box is not None:
            np.frombuffer(box, np.uint8).fill(0)  # every rank touches it all: flags start at 0
            node.Barrier()
        # why this rank's group has no mailbox (a description: rtxmpi info, benchmarks)
        off = ("ranks on several nodes" if cross is not None
               else "ULFM: a dead peer must fail an MPI request" if ulfm_enabled()
               else "no compiled mailbox on this CPU" if _mailbox is None and not TSO
               else "not possible on another rank" if not ordered
               else "RTXMPI_SHM_SMALL_BYTES=0" if small == 0
               else "/dev/shm too small" if box is None else None)
        if peers is not None:
            engine = cls(comm, node, cross, config.chunk_bytes, members=members, peers=peers,
                         box=box, small_bytes=small, compiled=compiled,
                         min_bytes=config.threshold, bounce_slot=bounce,
                         bounce_bytes=config.bounce_bytes, bounce_any_cpu=config.bounce_any_cpu)
            engine.mailbox_off = off
            if config.min_bytes is None and engine.mailbox is not None:  # the compiled path
                # just above the mailbox; MPI below CROSS_SMALL_BYTES when the mailbox is off
                engine.all_reduce_from = max(engine.small_bytes, CROSS_SMALL_BYTES) + 1
            return engine
        mm = _map_arena(node, comm, local_size * BUFFERS * config.chunk_bytes)
        if mm is None:
            node.Free()
            if cross is not None:
                cross.Free()
            if box is not None:
                box.close()
            return None
        engine = cls(comm, node, cross, config.chunk_bytes, members=members, mm=mm, box=box,
                     small_bytes=small, compiled=compiled, min_bytes=config.threshold)
        engine.mailbox_off = off
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

    # -- cross-memory helpers ---------------------------------------------------------------
    def _exchange(self, x, wait, code=0):
        """Arrival of every rank of the group and the local peers' array addresses. Returns
        [(pid, address)] of the other local ranks, in local-rank order. On one node with the
        flag lines (see __init__): this rank publishes its address, then raises its arrival flag,
        and polls the peers' flags (the deadline-aware `wait` after a short spin); a peer cannot
        start its next call, and overwrite its address, before this rank has finished (`_done`).
        Otherwise one all_gather of two int64 over the group. Each rank publishes its array's
        size and dtype with the address; CollectiveMismatch on every local rank when they
        differ (checking off: a larger peer array would send transfers past the end of x), or
        when their fingerprint codes (`code`: the caller's dtype and op) differ."""
        self._drain(wait)
        me, pids = self.local_rank, self._pids
        lines = self._lines if TSO else None
        if lines is not None:
            self._settle(wait)
        key = x.nbytes * 64 + _FOLD_CHARS.find(x.dtype.char) + 1  # what every rank must share
        if lines is None:
            self._my_addr[:] = x.ctypes.data, key, code
            wait([self.comm.Iallgather(self._my_addr, self._addrs)])
            keys, codes, ranks = self._addrs[:, 1], self._addrs[:, 2], self._group_ranks
            table = self._addrs[self._local_group]  # (address, key, code) by local rank
        else:
            self._cma_calls += 1
            lines[me, 2], lines[me, 7], lines[me, 15] = x.ctypes.data, key, code
            lines[me, 1] = self._cma_calls
            self._await(1, wait)
            table = lines[:, [2, 7]]
            keys, codes, ranks = table[:, 1], lines[:, 15].copy(), self._local_ranks
        if (keys != key).any() or (codes != code).any():  # every rank sees every key: each
            # raises, before any transfer
            error = self._mismatch(ranks, [f"{int(k) // 64} bytes, "
                                           f"{_FOLD_NAMES.get(int(k) % 64 - 1, 'other dtype')}"
                                           for k in keys])
            # after the closing barrier: a rank gone on to its next call would overwrite its key
            # while a peer still compares this call's, and might match it
            self._done(wait)
            raise error
        return [(pids[j], int(table[j, 0])) for j in range(self.local_size) if j != me]

    def _done(self, wait):
        """The closing node barrier of a cross-memory call: no rank returns while a peer still
        reads or writes its array. Flag [3] on one node with the flag lines, else MPI Ibarrier."""
        lines = self._lines if TSO else None
        if lines is None:
            wait([self.node.Ibarrier()])
            return
        lines[self.local_rank, 3] = self._cma_calls
        self._await(3, wait)

    def _await(self, column, wait):
        """Until every local rank's flag `column` has reached this call: spin briefly, then
        `wait(poll)`."""
        lines, call = self._lines, self._cma_calls
        if self.local_size == 2:
            flag = lines[1 - self.local_rank, column:column + 1]

            def poll():
                return flag[0] >= call
        else:
            flags = lines[:, column]

            def poll():
                return bool((flags >= call).all())
        for _ in range(SPIN_POLLS):
            if poll():
                return
        wait(self._watched(poll))

    def _watched(self, poll):
        return watch_peers(poll, self._node_pids, self._local_ranks, self._rank)

    def _peer_error(self, op, exc):
        return peer_failure(op, exc, self._pids, self._local_ranks, self._rank)

    def _mismatch(self, ranks, calls):
        """The error when the ranks' arrays for one cross-memory call differ (ranks: world
        ranks; calls: what each one published, as text): raised on every rank, as each sees
        every rank's published size, dtype (and op) before any transfer."""
        sizes = "; ".join(f"rank {r}: {call}" for r, call in zip(ranks, calls))
        return CollectiveMismatch(
            f"the ranks of one collective passed arrays of different sizes, dtypes or ops "
            f"({sizes}); nothing was transferred. Run with checking on (RTXMPI_CHECK=1, or "
            f"rtxmpi.init(check=True)) to see each rank's call [rank {self._rank}]")

    # -- all_reduce -------------------------------------------------------------------------
    def small_all_reduce(self, x, mpi_op, wait=_wait_all, code=0, seq=0, count=None,
                         op="all_reduce"):
        """The mailbox all_reduce: one synchronization. Every local rank copies `x` into its slot
        of the shared mailbox and raises its flag to the call number; once every flag has reached
        it (`wait(poll)`: the arrival check), every rank reduces all slots in local-rank order
        into `x`, so every rank computes bitwise the same result. Slots alternate between calls
        (a rank can be at most one call ahead of a peer, whose slot of the previous call it then
        no longer reads). Each rank posts the call's fingerprint beside its flag, (x.size or
        `count`, `code`): when they differ, nothing is reduced and every rank raises
        CollectiveMismatch naming each rank's call (`seq`: the group's call number, `op`: the
        collective's name). Same contract as all_reduce; the caller checks
        `x.nbytes <= small_bytes` and supports() (both the same on every rank for matching
        calls)."""
        self._drain(wait)
        fp = (x.size if count is None else count, code)
        if self.mailbox is not None:  # compiled: post, spin and reduce in one call (_mailbox.c)
            call = self.mailbox.all_reduce(x, mpi_op, SPIN_NS, code, fp[0])
            if call:
                self.small_finish(x, mpi_op, call, wait, seq, fp, op)
            return True
        self._box_calls += 1
        call, flags, me = self._box_calls, self._flags, self.local_rank
        key = (x.dtype, x.size, call & 1)
        views = self._box_views.get(key)
        if views is None:  # typed views of every slot, cached for repeated sizes (buckets)
            if len(self._box_views) >= BOX_VIEWS:
                self._box_views.clear()
            views = self._box_views[key] = [slot[:x.nbytes].view(x.dtype)
                                            for slot in self._box_slots[call & 1]]
        np.copyto(views[me], x)
        column = _box_column(call)
        lines = self._lines
        lines[me, column], lines[me, column + 1] = fp
        flags[me] = call
        if self.local_size == 2:
            peer = 1 - me

            def poll():
                return flags[peer] >= call
        else:
            def poll():
                return bool((flags >= call).all())
        for _ in range(SPIN_POLLS):  # the peers are usually a few microseconds away
            if poll():
                break
        else:
            wait(self._watched(self._watch_paths(poll, self._box_diverged, call, fp)))
        keys = lines[:, column:column + 2].copy()
        if (keys != keys[me]).any():
            raise self._box_mismatch(keys, seq, op, fp, wait, call)
        ufunc = ufunc_of(mpi_op)
        ufunc(views[0], views[1], out=x)
        for view in views[2:]:
            ufunc(x, view, out=x)
        return True

    def small_finish(self, x, mpi_op, call, wait, seq=0, fp=(0, 0), op="all_reduce"):
        """After `mailbox.all_reduce(x, mpi_op, SPIN_NS, *fp)` returned `call` != 0: a negative
        call, the ranks' fingerprints differ (CollectiveMismatch); else a peer had not posted
        it within the spin: wait(poll) until every local rank has (the caller's deadline; a dead
        local peer raises RankFailure), then reduce into x, or raise CollectiveMismatch. seq,
        op: the group's call number and the collective, for the message."""
        mailbox = self.mailbox
        if call > 0:
            arrived = self._watch_paths(lambda: mailbox.arrived(call), self._box_diverged, call, fp)
            wait(self._watched(arrived))
            if mailbox.finish(x, mpi_op, call):
                return
        raise self._box_mismatch(mailbox.box_keys(abs(call)), seq, op, fp, wait, abs(call))

    def arrive(self, op, fp, seq, wait):
        """The arrival check of a collective other than all_reduce through the mailbox (the
        caller checked small_bytes >= 0): an empty mailbox call that posts the fingerprint fp =
        (count, code). Raises CollectiveMismatch on every rank when the fingerprints differ
        (also against an all_reduce on another rank), and what `wait` raises."""
        self.small_all_reduce(self._no_data, MPI.SUM, wait, fp[1], seq, fp[0], op)

    # Mismatched calls on two paths of one node: a rank in a mailbox call whose peer is in a
    # cross-memory call (or the reverse: their sizes fall on either side of all_reduce_from, or
    # one calls all_reduce and the other another collective) would each wait for the other's
    # flag. The waiting rank sees the peer's other flag ahead of its own count, and posts a
    # mismatched call on that path with its own fingerprint and the POISON bit: every rank of
    # each path then finds the fingerprints differ, raises CollectiveMismatch, and the calls
    # numbered on both paths stay the same on every rank.
    def _box_count(self):
        return self.mailbox.calls() if self.mailbox is not None else self._box_calls

    def _watch_paths(self, poll, diverged, call, fp):
        """poll() of a wait in `call` that also runs diverged(poll, call, fp) (_box_diverged or
        _cross_diverged) every SPIN_POLLS polls; `poll` itself where the flag lines' plain stores
        are not ordered (not TSO)."""
        if not TSO or self._lines is None:
            return poll
        polls = [0]

        def watched():
            if poll():
                return True
            polls[0] += 1
            if polls[0] % SPIN_POLLS == 0:
                diverged(poll, call, fp)
            return False

        return watched

    def _box_diverged(self, poll, call, fp):
        """While mailbox `call` waits (poll() False): post a cross-memory call if a peer is in
        one this rank did not make (its arrival flag ahead of this rank's count, and its mailbox
        flag, read after that, still short of `call`)."""
        lines = self._lines
        if (self._cross_posted_in != call and self._cma_calls < lines[:, 1].max()
                and (lines[:, 0] < call).any() and not poll()):
            self._post_cross(fp)
            self._cross_posted_in = call

    def _cross_diverged(self, poll, call, fp):
        """While cross-memory `call` waits for the arrivals (poll() False): post a mailbox call if
        a peer is in one this rank did not make."""
        lines = self._lines
        if (self._box_posted_in != call and self._box_count() < lines[:, 0].max()
                and (lines[:, 1] < call).any() and not poll()):
            self._post_box(fp)
            self._box_posted_in = call

    def _post_box(self, fp):
        """Post a mailbox call that matches no real one: fingerprint fp with the POISON bit."""
        count, code = fp
        if self.mailbox is not None:
            self.mailbox.all_reduce(self._no_data, MPI.SUM, 0, code | fingerprint.POISON, count)
            return
        self._box_calls += 1
        call, me = self._box_calls, self.local_rank
        column = _box_column(call)
        self._lines[me, column], self._lines[me, column + 1] = count, code | fingerprint.POISON
        self._flags[me] = call

    def _post_cross(self, fp):
        """Post a cross-memory arrival that matches no real one (key -(count + 1) * 64, code fp
        with the POISON bit, no region, no bounce) and its done flag; the next cross-memory call
        first waits until every peer has compared it (_settle)."""
        count, code = fp
        self._cma_calls += 1
        call, line = self._cma_calls, self._lines[self.local_rank]
        line[4], line[10], line[7], line[15] = -1, 0, -(count + 1) * 64, code | fingerprint.POISON
        line[1] = call
        line[3] = call
        self._poisoned = call

    def _settle(self, wait):
        """Before a cross-memory call: wait until every peer has compared this rank's posted
        mismatched call (_post_cross), whose flag line the call rewrites."""
        call = self._poisoned
        if call:
            self._poisoned = 0
            done = self._lines[:, 3]
            if not (done >= call).all():
                wait(self._watched(lambda: bool((done >= call).all())))

    def _box_mismatch(self, keys, seq, op="all_reduce", fp=None, wait=None, call=0):
        """CollectiveMismatch for a mailbox call whose local ranks posted different (count, code)
        pairs (keys, by local rank = group rank: the mailbox serves one node). A peer that
        posted it from a cross-memory call (POISON) waits for this rank's arrival in that call:
        post it, then wait (`wait`; None: before the next cross-memory call) until every peer
        has compared it."""
        keys = [(int(count), int(code)) for count, code in keys]
        if (fp is not None and any(code & fingerprint.POISON for _, code in keys)
                and self._cross_posted_in != call):
            self._post_cross(fp)
            self._cross_posted_in = call
            if wait is not None:
                self._settle(wait)
        return CollectiveMismatch(fingerprint.describe(op, seq, self.group_name, keys))

    def supports(self, x, mpi_op):
        """Whether all_reduce(x, mpi_op) runs here: a contiguous 1-D numpy array and an MPI op
        with a numpy ufunc (sum, max, min, prod). Local; the same answer on every rank for the
        same call (it depends only on the arguments every rank shares)."""
        return (type(x) is np.ndarray and x.ndim == 1 and x.flags.c_contiguous
                and ufunc_of(mpi_op) is not None)

    def all_reduce(self, x, mpi_op, wait=_wait_all, guard=contextlib.nullcontext, code=0, seq=0):
        """Reduce the contiguous 1-D array `x` in place over the group; every rank must call, with
        the same size, dtype and op, and only when supports(x, mpi_op). Includes the arrival check
        (through `wait`), which compares every rank's size, dtype and `code` (the caller's
        fingerprint code) before anything moves. Raises CollectiveMismatch (they differ; `seq`:
        the group's call number, for the message), RankFailure (a local peer exited during a
        transfer), CollectiveError (another cross-memory failure), and what `wait` raises."""
        ufunc = ufunc_of(mpi_op)
        if self.mode == "cma":
            self._all_reduce_cma(x, ufunc, mpi_op, wait, guard, code, seq)
        else:  # the arena: the fingerprints' agreement is the arrival check
            fingerprint.agree(self.comm, (x.size, code), wait, "all_reduce", seq, self.group_name)
            if x.size:
                with guard():
                    self._all_reduce_copy(x, ufunc, mpi_op)
        return True

    def _all_reduce_cma(self, x, ufunc, mpi_op, wait, guard, code=0, seq=0):
        """Arrival + address exchange; then for each cache-sized piece of this rank's segment:
        read the piece of every peer into the scratch buffer, fold it into `x` in place, and
        write the reduced piece straight into every peer's array (one node; across nodes the
        segment is first all_reduced among the ranks with this local index); then one node
        barrier (no rank returns while a peer still reads or writes its array)."""
        mailbox = self.mailbox
        if mailbox is not None and x.dtype.isnative and x.dtype.char in _FOLD_CHARS:
            self._cross_compiled(mailbox, x, mpi_op, wait, code, seq)
            return
        peers = self._exchange(x, wait, code)
        n, me = self.local_size, self.local_rank
        total, itemsize = x.size, x.itemsize
        lo, hi = (total * me) // n, (total * (me + 1)) // n
        tmp = self._tmp.view(x.dtype)
        tmp_addr, step, base = tmp.ctypes.data, tmp.size, x.ctypes.data
        read, write = self._reader.read, self._reader.write
        push = self.cross is None
        code = _FOLD_CODES.get(ufunc) if _mailbox is not None else None
        try:
            if code is not None and x.dtype.isnative and x.dtype.char in _FOLD_CHARS:
                # the loop below, in C without the GIL
                failed = _mailbox.fold_peers(x, lo, hi, peers, self._tmp, code, push)
                if failed:
                    raise PeerAccessError(*failed)
            else:
                for start in range(lo, hi, step):
                    stop = min(hi, start + step)
                    own, part = x[start:stop], tmp[:stop - start]
                    offset, nbytes = start * itemsize, (stop - start) * itemsize
                    for pid, addr in peers:
                        read(pid, tmp_addr, addr + offset, nbytes)
                        ufunc(own, part, out=own)
                    if push:  # the piece is still in cache: hand it to the peers now
                        for pid, addr in peers:
                            write(pid, addr + offset, base + offset, nbytes)
            if not push and hi > lo:
                with guard():
                    self.cross.Allreduce(MPI.IN_PLACE, x[lo:hi], mpi_op)
                for pid, addr in peers:
                    write(pid, addr + lo * itemsize, base + lo * itemsize, (hi - lo) * itemsize)
        except PeerAccessError as exc:
            raise self._peer_error("all_reduce", exc) from exc
        self._done(wait)

    def _cross_compiled(self, mailbox, x, mpi_op, wait, code=0, seq=0):
        """_all_reduce_cma on one node in one C call (_mailbox.c, Mailbox.cross: the same flag
        lines, steps and piece loop); a peer later than the spin is waited for here, with the
        caller's deadline."""
        self._drain(wait)
        self._settle(wait)
        self._cma_calls += 1
        call, tuner = self._cma_calls, self._tuner
        fp = (x.size, code)
        bounce = True  # the other local ranks follow local rank 0; none bounces beyond bounce_bytes
        if tuner is not None and x.nbytes <= self.bounce_bytes:
            bounce = tuner.pick(x.nbytes, _ALGORITHMS) == 1
        else:  # beyond bounce_bytes only the system calls run: nothing to choose
            tuner = None
        status = mailbox.cross(x, mpi_op, call, self._tmp, SPIN_NS, 0, bounce, code)
        while status in _CROSS_WAITS:  # a peer later than the spin: wait, then the next stage
            ready = mailbox.cross_ready
            if status == 1:  # waiting for the arrivals: is a peer on the mailbox path?
                ready = self._watch_paths(ready, self._cross_diverged, call, fp)
            wait(self._watched(ready))
            status = mailbox.cross(x, mpi_op, call, self._tmp, SPIN_NS, _CROSS_WAITS[status],
                                   bounce, code)
        error = self._cross_error(status, seq, fp, call)
        if error is not None:
            raise error
        if tuner is not None:
            algorithm, ns = mailbox.last_call()
            if algorithm == int(bounce):  # not a fallback (ranks on a shared CPU, regions):
                # those would count as the tuner's check of the other algorithm
                tuner.record(x.nbytes, _ALGORITHMS, algorithm, ns * 1e-9)

    def _cross_error(self, status, seq, fp, call=0):
        """The error a Mailbox.cross status stands for (a failed transfer's tuple: RankFailure or
        CollectiveError; 3: the ranks' calls differ, CollectiveMismatch naming each rank's count,
        dtype and op, from the fingerprint codes when the caller gave them), else None. A peer
        that posted its arrival from a mailbox call (_post_cross: a negative key) waits for this
        rank in that call: it is posted (_post_box) with this call's fingerprint `fp`."""
        if type(status) is tuple:
            return self._peer_error("all_reduce", PeerAccessError(*status))
        if status == 3:
            keys, codes = self.mailbox.keys(), self.mailbox.codes()
            if not any(codes):
                return self._mismatch(self._local_ranks, _described(keys))
            if any(n < 0 for n, _, _ in keys) and self._box_posted_in != call:
                self._post_box(fp)
                self._box_posted_in = call
            table = [(-n - 1 if n < 0 else n // np.dtype(_TYPE_NAMES[t]).itemsize, c)
                     for (n, t, _), c in zip(keys, codes)]
            return CollectiveMismatch(fingerprint.describe("all_reduce", seq, self.group_name, table))
        return None

    # -- nonblocking all_reduce --------------------------------------------------------------
    def supports_nonblocking(self, x, mpi_op):
        """Whether start_all_reduce(x, mpi_op) runs here: the compiled mailbox (_mailbox.c), x
        supported and of a dtype it folds, and x of the mailbox's size (small_bytes at most) or
        of the cross-memory call's (from all_reduce_from, mode "cma"): the sizes whose blocking
        all_reduce takes those paths. Local; the same answer on every rank for the same call."""
        return (self.supports(x, mpi_op) and x.dtype.isnative and x.dtype.char in _FOLD_CHARS
                and self.queues(x.nbytes))

    def queues(self, nbytes):
        """Whether a nonblocking all_reduce of `nbytes` takes start_all_reduce, for an array and
        op it supports (supports_nonblocking's size condition). Local, the same on every rank."""
        return self.mailbox is not None and (
            nbytes <= self.small_bytes or (self.mode == "cma" and nbytes >= self.all_reduce_from))

    def start_all_reduce(self, x, mpi_op, code=0, seq=0):
        """Start the all_reduce of `x` without waiting (the caller checked supports_nonblocking):
        through the mailbox up to small_bytes, else the cross-memory call. Returns poll() ->
        bool, True once x holds the result. Every rank must start the same calls in the same
        order (as for MPI's nonblocking collectives); x must not be read or written until poll()
        is True.

        The calls queue in launch order, and only the head is in flight (the flag lines hold one
        call's addresses; a mailbox slot is rewritten two calls later, once every peer has
        reduced it). progress() advances the queue as far as it can without waiting: poll()
        runs it, every rtxmpi wait of this process runs it between its polls (monitor.PROGRESS,
        so a rank waiting for a peer elsewhere still serves this transfer, as MPI's progress
        engine does), and every blocking mailbox or cross-memory call first drains the queue. A
        peer transfer that fails raises RankFailure (CollectiveError) from whichever call ran
        progress(), and every queued call fails with it: their poll() raises it too. So does a
        local peer found dead while a poll() waits (the queue can never complete). A call whose
        ranks passed different counts, dtypes or ops (`code`: the caller's fingerprint code)
        moves nothing; its poll() raises CollectiveMismatch on every rank (`seq`: the group's
        call number, for the message) and the queue goes on."""
        small = x.nbytes <= self.small_bytes
        if small:  # numbered by the mailbox when posted: now (a short spin, START_SPIN_NS), when
            # nothing is queued before it
            call = (self.mailbox.all_reduce(x, mpi_op, START_SPIN_NS, code) if not self._queue
                    else None)
            if call == 0:  # every peer had posted it: reduced already
                return _finished
        else:
            self._cma_calls += 1
            call = self._cma_calls
        # array, op, call, status, outcome, mailbox, code, seq
        entry = [x, mpi_op, call, None, False, small, code, seq]

        def done():  # outcome: False (queued), True (done) or the error that ended the queue
            if entry[4] is False:
                self.progress()
            if entry[4] is not True and entry[4] is not False:
                raise entry[4]
            return entry[4] is True

        self._queue.append(entry)
        if len(self._queue) == 1:
            monitor.PROGRESS.append(self.progress)
        self.progress()
        return self._queue_poll(done)

    def progress(self):
        """Advance the queued nonblocking all_reduces in launch order as far as possible without
        waiting. A mailbox call is posted (Mailbox.all_reduce with no spin: 0, done; else its
        call number) and then finished once every peer has posted it. A cross-memory call runs
        Mailbox.cross with no spin, at the stage its last status waited for (_CROSS_WAITS: 1, a
        peer has not arrived; 4, a peer's bounce slot is not filled; 2, this rank's segment is
        done, a peer's is not). Local; raises RankFailure when a transfer with a local
        peer fails (CollectiveError for another failure), and every queued call then fails with
        it (_fail). A call whose ranks' calls differ ends with CollectiveMismatch as its outcome;
        the calls after it go on."""
        queue, mailbox = self._queue, self.mailbox
        while queue:
            entry = queue[0]
            x, mpi_op, call, status, _, small, code, seq = entry
            outcome, fp = True, (x.size, code)
            if small:
                if call is None:
                    call = entry[2] = mailbox.all_reduce(x, mpi_op, 0, code)
                    if call > 0:
                        return
                elif call > 0:
                    if not mailbox.arrived(call):
                        if TSO and self._lines is not None:  # a peer on the cross-memory path?
                            self._box_diverged(lambda: mailbox.arrived(call), call, fp)
                        return
                    if not mailbox.finish(x, mpi_op, call):
                        call = -call
                if call < 0:  # every rank posted it; their counts or codes differ
                    outcome = self._box_mismatch(mailbox.box_keys(-call), seq, "all_reduce", fp,
                                                 None, -call)
            else:  # the next stage of the call (0 at first), after the flag its status awaits
                if status is None and self._poisoned:  # _settle, without waiting
                    if not mailbox.cross_reached(3, self._poisoned):
                        return
                    self._poisoned = 0
                stage = 0 if status is None else _CROSS_WAITS[status]
                status = entry[3] = mailbox.cross(x, mpi_op, call, self._tmp, 0, stage, False,
                                                  code)
                if status == 1 and TSO and self._lines is not None:  # a peer on the mailbox path?
                    self._cross_diverged(lambda: mailbox.cross_reached(1, call), call, fp)
                error = self._cross_error(status, seq, fp, call)
                if status == 3:
                    outcome = error
                elif error is not None:
                    self._fail(error)
                    raise error
                elif status:
                    return
            entry[4] = outcome
            entry[0] = None  # the array: no longer held here
            queue.popleft()
        self._end_queue()

    def _fail(self, error):
        """End the queue with `error` (a transfer failed, or a local peer died): each queued
        call's poll() raises it, and the waits stop running progress()."""
        for entry in self._queue:
            entry[4] = error
        self._end_queue()

    def _queue_poll(self, done):
        """poll() for a wait on the queue: done() under watch_peers; a local peer found dead ends
        the queue (_fail) before RankFailure is raised, so no later wait of this process runs a
        queue that cannot finish."""
        return watch_peers(done, self._node_pids, self._local_ranks, self._rank,
                           on_failure=self._fail)

    def _end_queue(self):
        """Stop the waits' progress calls for this engine (its queue is empty or failed)."""
        self._queue.clear()
        if self.progress in monitor.PROGRESS:
            monitor.PROGRESS.remove(self.progress)

    def _drain(self, wait):
        """Before a blocking mailbox or cross-memory call: finish the queued nonblocking ones
        (they take the lower call numbers), waiting through `wait` (the caller's deadline)."""
        if self._queue:
            wait(self._queue_poll(lambda: self.progress() or not self._queue))

    # -- reduce_scatter ---------------------------------------------------------------------
    def reduce_scatter(self, x, out, counts, mpi_op, wait=_wait_all, guard=contextlib.nullcontext):
        """Reduce the contiguous 1-D array `x` over the group and write group rank r's elements
        [sum(counts[:r]), sum(counts[:r+1])) into the contiguous 1-D `out`; every rank must call
        with the same x size, dtype and counts (elements per group rank). Only in mode "cma":
        returns False (nothing done, on every rank) otherwise or for an MPI op it does not
        handle; the caller then uses MPI. Includes the arrival check (through `wait`).

        Local rank i folds, for every rank g with local index i (on every node), rows g of every
        local peer's x into its own (read in cache-sized pieces, in ascending local-rank order):
        into `out` directly on one node; across nodes into a staging buffer that the ranks with
        local index i then reduce-scatter among themselves (MPI). Then one node barrier.
        Raises RankFailure / CollectiveError as all_reduce.
        """
        ufunc = ufunc_of(mpi_op)
        if (ufunc is None or self.mode != "cma" or type(x) is not np.ndarray
                or type(out) is not np.ndarray or x.ndim != 1 or out.ndim != 1
                or not (x.flags.c_contiguous and out.flags.c_contiguous)):
            return False
        peers = self._exchange(x, wait)
        offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        mine = self._cross_group  # the ranks whose rows this rank reduces on this node
        col_counts = [int(counts[g]) for g in mine]
        if self.cross is None:
            dest = out
        else:
            need = sum(col_counts) * x.itemsize
            if self._stage.nbytes < need:
                self._stage = np.zeros(need, np.uint8)
            dest = self._stage[:need].view(x.dtype)
        tmp = self._tmp.view(x.dtype)
        tmp_addr, step, itemsize, read = tmp.ctypes.data, tmp.size, x.itemsize, self._reader.read
        try:
            pos = 0
            for g, count in zip(mine, col_counts):
                first = int(offsets[g])
                for start in range(0, count, step):
                    stop = min(count, start + step)
                    piece, part = dest[pos + start:pos + stop], tmp[:stop - start]
                    piece[...] = x[first + start:first + stop]
                    offset, nbytes = (first + start) * itemsize, (stop - start) * itemsize
                    for pid, addr in peers:
                        read(pid, tmp_addr, addr + offset, nbytes)
                        ufunc(piece, part, out=piece)
                pos += count
        except PeerAccessError as exc:
            raise self._peer_error("reduce_scatter", exc) from exc
        if self.cross is not None:
            with guard():
                self.cross.Reduce_scatter(dest, out, col_counts, mpi_op)
        self._done(wait)
        return True

    # -- all_gather -------------------------------------------------------------------------
    def all_gather(self, buf, out, wait=_wait_all):
        """Concatenate every rank's contiguous `buf` (bytes, same size everywhere) into the
        contiguous `out` (group size x buf bytes) in group-rank order; every rank must call. Only
        in mode "cma" on one node: returns False (nothing done, on every rank) otherwise; the
        caller then uses MPI. Includes the arrival check (through `wait`): each rank copies its
        own block and reads every peer's block straight into `out`, then one node barrier.
        Raises RankFailure / CollectiveError as all_reduce."""
        if (self.mode != "cma" or self.cross is not None or type(buf) is not np.ndarray
                or type(out) is not np.ndarray or not (buf.flags.c_contiguous
                                                       and out.flags.c_contiguous)):
            return False
        peers = self._exchange(buf, wait)
        nbytes, me = buf.nbytes, self.local_rank
        src, dst = buf.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
        dst[me * nbytes:(me + 1) * nbytes] = src
        base, read = dst.ctypes.data, self._reader.read
        others = [g for j, g in enumerate(self._local_group) if j != me]
        try:
            if nbytes:
                for g, (pid, addr) in zip(others, peers):
                    read(pid, base + g * nbytes, addr, nbytes)
        except PeerAccessError as exc:
            raise self._peer_error("all_gather", exc) from exc
        self._done(wait)
        return True

    def _all_reduce_copy(self, x, ufunc, mpi_op):
        """The pipelined arena path (see the module docstring)."""
        total = x.size
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

    def comms(self):
        """The node and cross-node MPI communicators of this engine (local)."""
        return [comm for comm in (self.node, self.cross) if comm is not None]

    def close(self):
        """Release the arena and the communicators (local; the group must not use it after).
        Queued nonblocking all_reduces fail: their Work.wait raises CollectiveError."""
        if self._queue:
            self._fail(CollectiveError("the group's shared-memory engine was closed with "
                                       f"{len(self._queue)} nonblocking all_reduce(s) queued"))
        self._views.clear()
        self._arena = None
        self._boxes = self._flags = self._lines = None  # views of the mailbox: dropped first,
        self._box_slots, self._box_views = None, {}     # or its mapping cannot close
        if self.mailbox is not None:
            self.mailbox.close()
        try:
            if self._box_mm is not None:
                self._box_mm.close()
        except BufferError:
            pass
        try:
            if self._mm is not None:
                self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it does
        for comm in (self.node, self.cross):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()
        self.node = self.cross = None
