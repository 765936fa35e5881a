"""`ProcessGroup`: the collectives every layer above uses.

A group wraps one communicator and one transport backend. It owns what is the same for every
backend: argument validation, the per-group sequence number, the checking-mode fingerprint,
dtype handling (float16/bfloat16 reduce in float32; bool sum is logical or), non-contiguous inputs
(reduced on a contiguous copy, written back) and host staging of cupy arrays for backends that
cannot read device memory.

Mismatched calls raise CollectiveMismatch on every rank also with checking off: each call's
fingerprint (comm/fingerprint.py: element count, dtype, op and its reduce op / src / counts) is
compared where the transport synchronizes anyway (the arrival check of every collective but
all_reduce; for all_reduce the mailbox's flags, the cross-memory address exchange, or the arrival
check before MPI's algorithm; send/recv's header message).

Every collective is a *collective call*: every rank of the group must call it, in the same order,
with the same shape and dtype. Nothing here decides whether to enter a collective from local data.
"""
import contextlib
import functools
import operator
import weakref
import zlib

import numpy as np

from ..backend import LOW_PRECISION, SUPPORTED_DTYPES, dtype_name, is_device_array, xp_of
from ..errors import CollectiveMismatch, ConfigError
from . import fingerprint
from .arrays import accepts_dlpack
from .fingerprint import ARG_SHIFT as _ARG_SHIFT, OP_CODES as _OP_CODES, REDUCE_CODES as _REDUCE_CODES
from .fingerprint import counts_crc as _counts_crc, dtype_code as _dtype_code
from .fingerprint import dtype_from_code as _dtype_from_code
from .mpi import BOOL_OPS, REDUCE_OPS
from .work import CompletedWork, Work

_MAX_DIMS = 10
# all_reduce fast path (numpy, contiguous, checking off): op -> {dtype: (MPI op, fingerprint
# code)} for the dtypes MPI reduces in place with no staging ("avg" on integers is refused by the
# general path)
# int8 / uint8 sum and prod reduce in int32, then wrap back like numpy: Open MPI's AVX op
# component saturates 8-bit sums (127 + 1 = 127) where the shared-memory paths wrap, so the
# result would depend on the path (rank count, size, async)
WIDENED = {np.dtype(np.int8), np.dtype(np.uint8)}
WIDENED_OPS = ("sum", "prod")
_DIRECT_REDUCE = {op: {dtype: (mpi_op, fingerprint.code("all_reduce", dtype, _REDUCE_CODES[op]))
                        for dtype in SUPPORTED_DTYPES
                       if dtype not in LOW_PRECISION and dtype.kind != "b"
                       and not (op == "avg" and dtype.kind in "iu")
                       and not (op in WIDENED_OPS and dtype in WIDENED)}
                  for op, mpi_op in REDUCE_OPS.items()}
_NONE = {}
_FP_LEN = 5 + _MAX_DIMS + 1  # seq, op, arg, dtype, ndim, dims..., overflow-hash


def _host_staged(method):
    """Run a collective on a host copy of a cupy array when the backend cannot read device memory.

    The copy to the host synchronizes `stream`; the call itself is synchronous, and an async_op
    call returns an already-completed Work, except `send`, which stays in flight on the host copy
    (its Work keeps it) so that two ranks sending to each other before receiving cannot deadlock.
    """

    @functools.wraps(method)
    def wrapper(self, x, *args, **kwargs):
        if type(x) is np.ndarray or self.backend.device_native or not is_device_array(x):
            return method(self, x, *args, **kwargs)  # fast path: no keyword re-packing
        async_op, stream = kwargs.pop("async_op", False), kwargs.pop("stream", None)
        cp = xp_of(x)
        host = cp.asnumpy(x, stream=stream)
        if async_op and method.__name__ == "send":  # stays in flight (its Work keeps the copy):
            return method(self, host, *args, async_op=True, **kwargs)  # send-send can't deadlock
        result = method(self, host, *args, **kwargs)
        if result is host:
            if x.flags.c_contiguous or x.flags.f_contiguous:
                x.set(host, stream=stream)
            else:  # cupy's set() refuses a non-contiguous target
                with stream if stream is not None else contextlib.nullcontext():
                    x[...] = cp.asarray(host)
            result = x
        elif result is not None:  # send returns None
            result = cp.asarray(result)
        if async_op:
            return CompletedWork(self, method.__name__.lstrip("_"), self._seq, result)
        return result

    return wrapper


class ProcessGroup:
    """A set of ranks that run collectives together (the world, or a split of it).

    Attributes: rank (int, this process's rank in the group), world_size (int, ranks in the group),
    local_rank (int, rank among processes on this host), device ("cpu" or "cuda:i"), name (str),
    timeout_s (float, default deadline of every wait), check (bool, checking mode), members (list of
    world ranks, indexed by group rank), backend.

    Every collective's x may also be any DLPack array (a PyTorch tensor, a JAX array): viewed
    without a copy, results returned as the caller's kind (rtxmpi.comm.arrays, docs/interop.md).

    Errors common to every collective: CollectiveTimeout (a wait passed `timeout_s`; raised on every
    waiting rank), CollectiveMismatch (ranks disagree on op, element count, dtype or reduce op /
    src / counts, and in checking mode on shape; raised on every rank, nothing moved),
    TypeError (unsupported dtype, or an operation the dtype cannot do), ValueError /
    ConfigError (shapes or arguments the operation cannot take).
    """

    def __init__(self, backend, *, name, rank, world_size, members, local_rank, device,
                 timeout_s, check):
        self.backend = backend
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.members = members
        self.local_rank = local_rank
        self.device = device
        self.timeout_s = float(timeout_s)
        self.check = bool(check)
        self._seq = 0
        self._p2p_seq = 0
        self._children = 0

    def __repr__(self):
        return (f"<ProcessGroup '{self.name}' rank={self.rank} world_size={self.world_size} "
                f"backend={self.backend.name} check={self.check}>")

    # -- the common path of every collective --------------------------------------------------
    def _begin(self, op, x=None, arg=0, arrive=None):
        """Number the call and check that every rank makes the same call: in checking mode by
        exchanging full fingerprints (shape included); with checking off by the arrival check's
        all_gather of (count, code) (comm/fingerprint.py), except for all_reduce (unless
        `arrive`), whose transports compare them where they synchronize. Returns (seq, arrived)."""
        self._seq += 1
        seq = self._seq
        if not self.check:
            if (op == "all_reduce" and not arrive) or self.world_size == 1:
                return seq, False
            self.backend.arrive(op, seq, self.timeout_s, fingerprint.of(op, x, arg))
            return seq, True
        fp = np.zeros(_FP_LEN, np.int64)
        fp[0], fp[1], fp[2] = seq, _OP_CODES[op], arg
        if x is not None:
            shape = tuple(x.shape)
            fp[3], fp[4] = _dtype_code(x.dtype), len(shape)
            fp[5:5 + min(len(shape), _MAX_DIMS)] = shape[:_MAX_DIMS]
            fp[-1] = zlib.crc32(repr(shape[_MAX_DIMS:]).encode())
        table = self.backend.exchange_fingerprints(fp, op, seq, self.timeout_s)
        if not (table == table[0]).all():
            raise CollectiveMismatch(self._describe_mismatch(op, seq, table))
        return seq, True

    def _describe_mismatch(self, op, seq, table):
        names = {code: name for name, code in _OP_CODES.items()}
        rows = []
        for r, fp in enumerate(table):
            called = names.get(int(fp[1]), "?")
            shape = tuple(int(d) for d in fp[5:5 + min(int(fp[4]), _MAX_DIMS)])
            detail = f"seq={int(fp[0])}"
            if called not in ("barrier", "split", "new_group"):
                detail += f", shape={shape}, dtype={_dtype_from_code(int(fp[3]))}"
            if called == "all_reduce":
                detail += f", op={list(REDUCE_OPS)[int(fp[2]) - 1]}"
            elif called == "reduce_scatter":
                op_code, crc = int(fp[2]) % _ARG_SHIFT, int(fp[2]) // _ARG_SHIFT
                detail += f", op={list(REDUCE_OPS)[op_code - 1]}"
                detail += f", counts crc32={crc:#010x}" if crc else ", counts=None"
            elif called == "broadcast":
                detail += f", src={int(fp[2])}"
            rows.append(f"rank {r}: {called}({detail})")
        return (f"CollectiveMismatch in {op} #{seq} on group '{self.name}': ranks called it "
                "differently: " + "; ".join(rows))

    def _run(self, op, seq, arrived, transfer, finish, async_op):
        """Start `transfer(nonblocking)`; complete it now or return a Work."""
        if async_op:
            return Work(self, op, seq, transfer(True), finish, keep=transfer)  # holds the buffers
        if not arrived and self.world_size > 1:
            self.backend.arrive(op, seq, self.timeout_s)
        with self.backend.blocking(op, seq, self.timeout_s):
            transfer(False)
        return finish()

    # -- validation helpers -------------------------------------------------------------------
    def _check_array(self, x, op, writable=False):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{op}: expected a numpy or cupy array, got {type(x).__name__}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: dtype {x.dtype} is not supported by the {self.backend.name} "
                            f"backend; supported: {', '.join(dtype_name(d) for d in SUPPORTED_DTYPES)}")
        if writable and not x.flags.writeable:
            raise ValueError(f"{op}: the array is read-only; pass a writable array")

    def _check_reduce_op(self, x, op, reduce_op):
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"{op}: unknown reduce op {reduce_op!r}; use one of {list(REDUCE_OPS)}")
        if reduce_op == "avg" and x.dtype.kind in "biu":
            raise TypeError(f"{op}: op='avg' needs a floating dtype, got {x.dtype}; "
                            "use op='sum' and divide")

    def _check_rank(self, r, what):
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self.world_size:
            raise ValueError(f"{what}={r!r} is not a rank of group '{self.name}' "
                             f"(world_size {self.world_size})")

    def _check_divisible(self, x, op):
        if x.ndim == 0 or x.shape[0] % self.world_size:
            raise ValueError(f"{op}: dim 0 of shape {tuple(x.shape)} must be divisible by the "
                             f"group size {self.world_size}")

    @staticmethod
    def _reduce_buffer(x, op):
        """(contiguous 1-D buffer MPI can reduce, write-back callable or None, MPI op table) for
        reduce op `op`: float16/bfloat16 widen to float32, int8/uint8 sum and prod to int32
        (WIDENED; the write-back wraps like numpy)."""
        dtype = x.dtype
        wide = (np.float32 if dtype in LOW_PRECISION
                else np.int32 if dtype in WIDENED and op in WIDENED_OPS else None)
        if wide is not None:
            buf = x.astype(wide).reshape(-1)
            return buf, lambda: x.__setitem__(..., buf.reshape(x.shape)), REDUCE_OPS
        contiguous = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        buf = contiguous if contiguous.ndim == 1 else contiguous.reshape(-1)
        if isinstance(buf, np.ndarray) and type(buf) is not np.ndarray:
            buf = buf.view(np.ndarray)  # a subclass (np.memmap...): the algorithms take plain arrays
        writeback = None if contiguous is x else (lambda: x.__setitem__(..., contiguous))
        if dtype.kind == "b":  # bool travels as uint8 0/1
            return buf.view(np.uint8), writeback, BOOL_OPS
        return buf, writeback, REDUCE_OPS

    @staticmethod
    def _result_cast(result, dtype):
        return result if result.dtype == dtype else result.astype(dtype)

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, x, op="sum", *, async_op=False, stream=None):
        """Reduce `x` over the group, in place, and return it.

        x: array of any shape (empty and non-contiguous included), same shape and dtype on every
        rank. op: "sum", "avg", "max", "min", "prod". float16/bfloat16 accumulate in float32; for
        bool, sum and max are logical or, min and prod logical and; "avg" needs a floating dtype.
        Returns x (or a Work whose wait() returns x). stream: CUDA stream for cupy arrays (None =
        current). Collective: every rank of the group must call, in the same order.
        Raises CollectiveMismatch (ranks disagree on element count, dtype or op; checking mode:
        on shape), CollectiveTimeout, TypeError (dtype, or "avg" on an integer dtype),
        ValueError (unknown op, read-only x).
        """
        if type(x) is np.ndarray and type(op) is str and not self.check:
            direct = _DIRECT_REDUCE.get(op, _NONE).get(x.dtype)
            if direct is not None and x.flags.carray:  # C-contiguous, aligned, writeable
                # Fast path (the common case), same steps as the general path below: Python
                # costs per call are paid again, cold, after every large transfer.
                mpi_op, code = direct
                self._seq += 1
                flat = x if x.ndim == 1 else x.reshape(-1)
                if async_op:
                    return Work(self, "all_reduce", self._seq,
                                self.backend.all_reduce_start(flat, mpi_op, self._seq,
                                                              self.timeout_s, code),
                                self._averaged(x) if op == "avg" else lambda: x, keep=x)
                self.backend.all_reduce_now(flat, mpi_op, self._seq, self.timeout_s, code)
                if op == "avg":
                    np.divide(x, self.world_size, out=x)
                return x
        return self._all_reduce(x, op, async_op=async_op, stream=stream)

    def _averaged(self, x):
        """The completion step of an async "avg" all_reduce on the fast path: x / world_size."""
        def finish():
            np.divide(x, self.world_size, out=x)
            return x
        return finish

    @accepts_dlpack  # here, not on all_reduce: the fast path above pays nothing for it
    @_host_staged
    def _all_reduce(self, x, op, *, async_op=False, stream=None):
        """all_reduce for every case: any layout, dtype and array module, async, checking mode."""
        self._check_array(x, "all_reduce", writable=True)
        self._check_reduce_op(x, "all_reduce", op)
        seq, arrived = self._begin("all_reduce", x, _REDUCE_CODES[op])
        buf, writeback, ops = self._reduce_buffer(x, op)
        mpi_op, size = ops[op], self.world_size

        def finish():
            if op == "avg":
                np.divide(buf, size, out=buf)
            if writeback is not None:
                writeback()
            return x

        if not arrived and self.world_size > 1:
            # the fast path's steps (all_reduce above): whether a rank came by the fast or this
            # path depends on its own array (layout, subclass), so both must synchronize alike
            code = fingerprint.code("all_reduce", x.dtype, _REDUCE_CODES[op])
            if async_op:
                return Work(self, "all_reduce", seq,
                            self.backend.all_reduce_start(buf, mpi_op, seq, self.timeout_s, code),
                            finish, keep=buf)
            self.backend.all_reduce_now(buf, mpi_op, seq, self.timeout_s, code)
            return finish()
        return self._run("all_reduce", seq, arrived,
                         lambda nb: self.backend.all_reduce(buf, mpi_op, nb), finish, async_op)

    @accepts_dlpack
    @_host_staged
    def reduce_scatter(self, x, op="sum", *, counts=None, async_op=False, stream=None):
        """Reduce `x` over the group and return this rank's shard of rows.

        x: (N, ...) array, same shape and dtype on every rank; read only. op: as for all_reduce
        (float16/bfloat16 reduce in float32, bool sum/max is logical or, min/prod logical and,
        "avg" needs a floating dtype).
        counts: None (even shards: N must be divisible by the group size; rank r gets rows
        [r * N // world_size, (r + 1) * N // world_size)), or a sequence of world_size
        non-negative ints summing to N, the same on every rank: rank r gets rows
        [sum(counts[:r]), sum(counts[:r + 1])) — uneven shards, zero-length ones allowed.
        Returns a new (N // world_size, ...) or (counts[rank], ...) array of x's dtype holding
        those rows of the reduction (or a Work whose wait() returns it). stream: CUDA stream for
        cupy arrays. Collective: every rank of the group must call, in the same order, with the
        same op and counts.
        Raises CollectiveMismatch (ranks pass different counts, element counts, dtypes or ops;
        checking mode: shapes), CollectiveTimeout, TypeError (dtype/op), ValueError (N not
        divisible; counts of the wrong length, negative, not integers or not summing to N; a 0-d
        x) — on every rank, as the checks depend only on arguments every rank shares.
        """
        self._check_array(x, "reduce_scatter")
        self._check_reduce_op(x, "reduce_scatter", op)
        seq, arrived = self._begin("reduce_scatter", x,
                                   _REDUCE_CODES[op] + _ARG_SHIFT * _counts_crc(counts))
        if counts is None:
            self._check_divisible(x, "reduce_scatter")
            rows = x.shape[0] // self.world_size
        else:
            counts = self._check_counts(x, counts)
            rows = counts[self.rank]
        buf, _, ops = self._reduce_buffer(x, op)  # read only: no write-back
        shard_shape = (rows,) + tuple(x.shape[1:])
        out = np.empty(shard_shape, buf.dtype)
        mpi_op, size, dtype = ops[op], self.world_size, x.dtype

        def finish():
            if op == "avg":
                np.divide(out, size, out=out)
            return out.view(np.bool_) if dtype == np.bool_ else self._result_cast(out, dtype)

        if counts is None:
            def transfer(nb):
                return self.backend.reduce_scatter(buf, out.reshape(-1), mpi_op, nb)
        else:
            row = int(np.prod(x.shape[1:], dtype=np.int64))
            recvcounts = [c * row for c in counts]

            def transfer(nb):
                return self.backend.reduce_scatter_counts(buf, out.reshape(-1), recvcounts,
                                                          mpi_op, nb)

        return self._run("reduce_scatter", seq, arrived, transfer, finish, async_op)

    def _check_counts(self, x, counts):
        """reduce_scatter's counts as a list of ints, or ValueError."""
        what = f"reduce_scatter: counts={counts!r}"
        if x.ndim == 0:
            raise ValueError("reduce_scatter: a 0-d array has no rows to scatter by counts")
        try:
            values = [operator.index(c) for c in counts]
        except TypeError:
            raise ValueError(f"{what} must be a sequence of {self.world_size} ints") from None
        if len(values) != self.world_size:
            raise ValueError(f"{what} must have one entry per rank: {len(values)} given, group "
                             f"size {self.world_size}")
        if any(v < 0 for v in values):
            raise ValueError(f"{what} must be non-negative")
        if sum(values) != x.shape[0]:
            raise ValueError(f"{what} sum to {sum(values)}, but dim 0 of shape "
                             f"{tuple(x.shape)} is {x.shape[0]}")
        return values

    @accepts_dlpack
    @_host_staged
    def all_gather(self, x, *, async_op=False, stream=None):
        """Gather `x` from every rank, concatenated along dim 0 in group-rank order.

        x: (N, ...) array (or a 0-d array), same shape and dtype on every rank.
        Returns a new (world_size * N, ...) array (or (world_size,) for 0-d input), or a Work.
        Collective: every rank of the group must call, in the same order.
        Raises CollectiveMismatch (element count or dtype differ; checking mode: shape),
        CollectiveTimeout, TypeError (dtype).
        """
        self._check_array(x, "all_gather")
        seq, arrived = self._begin("all_gather", x)
        buf = np.ascontiguousarray(x)
        shape = (self.world_size,) if x.ndim == 0 else (self.world_size * x.shape[0],) + x.shape[1:]
        out = np.empty(shape, x.dtype)
        return self._run("all_gather", seq, arrived,
                         lambda nb: self.backend.all_gather(buf, out, nb), lambda: out, async_op)

    @accepts_dlpack
    @_host_staged
    def broadcast(self, x, src=0, *, async_op=False, stream=None):
        """Copy `x` from group rank `src` to every rank, in place; returns x (or a Work).

        x: array, same shape and dtype on every rank (its contents are ignored except on src).
        Collective: every rank of the group must call, in the same order, with the same src.
        Raises CollectiveMismatch (element count, dtype or src differ; checking mode: shape),
        CollectiveTimeout, TypeError, ValueError (src).
        """
        self._check_array(x, "broadcast", writable=True)
        self._check_rank(src, "src")
        seq, arrived = self._begin("broadcast", x, src)
        buf = x if x.flags.c_contiguous else np.ascontiguousarray(x)

        def finish():
            if buf is not x:
                x[...] = buf
            return x

        return self._run("broadcast", seq, arrived,
                         lambda nb: self.backend.broadcast(buf, src, nb), finish, async_op)

    @accepts_dlpack
    @_host_staged
    def all_to_all(self, x, *, async_op=False, stream=None):
        """Exchange equal chunks: rank i's chunk j goes to rank j, landing as chunk i.

        x: (world_size * N, ...) array, same shape and dtype on every rank.
        Returns a new array of x's shape whose chunk j (rows [j*N, (j+1)*N)) came from rank j
        (or a Work). Collective: every rank of the group must call, in the same order.
        Raises CollectiveMismatch (element count or dtype differ; checking mode: shape),
        CollectiveTimeout, TypeError, ValueError.
        """
        self._check_array(x, "all_to_all")
        seq, arrived = self._begin("all_to_all", x)
        self._check_divisible(x, "all_to_all")
        buf = np.ascontiguousarray(x)
        out = np.empty(x.shape, x.dtype)
        return self._run("all_to_all", seq, arrived,
                         lambda nb: self.backend.all_to_all(buf, out, nb), lambda: out, async_op)

    def barrier(self, *, async_op=False):
        """Return once every rank of the group has called barrier (or a Work).

        Collective. Raises CollectiveTimeout naming the ranks that did not arrive.
        """
        seq, arrived = self._begin("barrier")
        if async_op:
            return Work(self, "barrier", seq, self.backend.barrier(), lambda: None)
        if not arrived and self.world_size > 1:
            self.backend.arrive("barrier", seq, self.timeout_s)

    # -- point to point -------------------------------------------------------------------------
    @accepts_dlpack
    @_host_staged
    def send(self, x, dst, tag=0, *, async_op=False, stream=None):
        """Send `x` to group rank `dst`; the matching recv must have the same element count and
        dtype.

        Returns None (or a Work). Raises CollectiveMismatch when the recv's count or dtype
        differs: the recv raises it, and this rank here when dst's answer has come by the time
        the send completes, else at its next send or recv on the group.
        CollectiveTimeout when dst does not receive in time.
        """
        self._check_array(x, "send")
        self._check_rank(dst, "dst")
        self._p2p_seq += 1
        buf = np.ascontiguousarray(x)
        work = Work(self, f"send to {dst}", self._p2p_seq,
                    self.backend.send(buf, dst, tag, fingerprint.of("send", x), self._p2p_seq),
                    self.backend.check_sent, keep=buf)
        return work if async_op else work.wait()

    @accepts_dlpack
    @_host_staged
    def recv(self, x, src, tag=0, *, async_op=False, stream=None):
        """Receive into `x` (in place) from group rank `src`; returns x (or a Work).

        Raises CollectiveMismatch (the send's count or dtype differs; on both ranks; x's contents
        are then undefined), CollectiveTimeout when src does not send in time.
        """
        self._check_array(x, "recv", writable=True)
        self._check_rank(src, "src")
        self._p2p_seq += 1
        buf = x if x.flags.c_contiguous else np.empty(x.shape, x.dtype)

        def finish():
            if buf is not x:
                x[...] = buf
            return x

        work = Work(self, f"recv from {src}", self._p2p_seq,
                    self.backend.recv(buf, src, tag, fingerprint.of("recv", x), self._p2p_seq),
                    finish, keep=buf)
        return work if async_op else work.wait()

    # -- sub-groups -----------------------------------------------------------------------------
    def split(self, color, key=None):
        """Partition the group: ranks with the same `color` form a new group, ordered by `key`.

        color: int >= 0, or None for "not in any new group" (that rank gets None back).
        key: int ordering ranks in the new group (default: this rank). Collective: every rank of
        this group must call. Returns the new ProcessGroup, or None. Raises CollectiveTimeout.
        """
        if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
            raise ValueError(f"split: color must be an int >= 0 or None, got {color!r}")
        self._children += 1
        seq, arrived = self._begin("split")
        if not arrived and self.world_size > 1:
            self.backend.arrive("split", seq, self.timeout_s)
        with self.backend.blocking("split", seq, self.timeout_s):
            comm = self.backend.split(color, self.rank if key is None else int(key))
        if color is None:
            return None
        return self._child(comm, f"{self.name}/split{self._children}:{color}")

    def new_group(self, ranks):
        """A group of the given group ranks (sorted order = new rank order).

        Collective: every rank of this group must call with the same `ranks`. Returns the new
        ProcessGroup on members and None elsewhere. Raises ValueError for bad ranks.
        """
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"new_group: ranks must be distinct and non-empty, got {ranks}")
        for r in ranks:
            self._check_rank(r, "rank")
        ranks = sorted(ranks)
        self._children += 1
        seq, arrived = self._begin("new_group", arg=zlib.crc32(np.asarray(ranks, np.int64).tobytes()))
        if not arrived and self.world_size > 1:
            self.backend.arrive("new_group", seq, self.timeout_s)
        member = self.rank in ranks
        with self.backend.blocking("new_group", seq, self.timeout_s):
            comm = self.backend.split(0 if member else None, ranks.index(self.rank) if member else 0)
        if not member:
            return None
        return self._child(comm, f"{self.name}/group{self._children}")

    def _child(self, comm, name):
        members = [self.members[r] for r in _parent_ranks(comm, self.backend.comm)]
        backend = register_subgroup(type(self.backend)(comm, self.backend.monitor, name, members))
        return ProcessGroup(backend, name=name, rank=comm.Get_rank(), world_size=comm.Get_size(),
                            members=members, local_rank=self.local_rank, device=self.device,
                            timeout_s=self.timeout_s, check=self.check)


_subgroups = weakref.WeakKeyDictionary()  # Monitor -> WeakSet of its world's sub-group backends


def register_subgroup(backend):
    """Record the backend of a group split or made from a world, for subgroup_comms; returns it.
    Held weakly: a group the program drops leaves the record with it. Local."""
    _subgroups.setdefault(backend.monitor, weakref.WeakSet()).add(backend)
    return backend


def subgroup_comms(monitor):
    """The MPI communicators of every live group split or made (at any depth) from the world
    that `monitor` serves, their shared-memory engines' node and cross-node communicators
    included. An elastic shrink revokes them with the world (ULFM): a rank blocked in a
    sub-group's transfer whose peer left for the shrink is then released with an error. Local."""
    return [comm for backend in list(_subgroups.get(monitor, ())) for comm in backend.comms()]


def _parent_ranks(comm, parent):
    """Ranks in `parent` of each rank of `comm`."""
    return list(comm.Get_group().Translate_ranks(list(range(comm.Get_size())), parent.Get_group()))


def validate_timeout(timeout_s, name="timeout_s"):
    """Check a user-given deadline (`name`: what the message calls it, e.g. the environment
    variable it came from); returns it as float seconds. Raises ConfigError."""
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number of seconds, got {timeout_s!r}") from None
    if not value > 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {timeout_s!r}")
    return value
