"""GPU data plane: NCCL for cupy arrays (CUDA-aware MPI as the fallback), MPI for everything else.

`DeviceGroup` is a ProcessGroup whose cupy arrays travel device to device; numpy arrays, barriers
and the checking-mode fingerprints keep the MPI path of the base class. One transport per group:

- "nccl": an NCCL communicator per group (the world, every split, every mesh group), created on
  the group's first device collective from a unique id that group rank 0 draws and broadcasts
  over the group's MPI communicator; NCCL rank == group rank, always. Collectives run on the
  group's own CUDA stream, ordered after the caller's `stream` (None = cupy's current stream) by
  an event, and the caller's stream waits for them by an event: no host synchronization. Grouped
  send/recv (`send_recv`, all_to_all) run inside one ncclGroupStart/End.
- "cuda-aware-mpi": when NCCL is missing but the MPI library reads device memory, the MPI calls
  take cupy buffers directly after the caller's stream has reached the call (an event polled
  with the deadline).
- Host staging (the base ProcessGroup) is the last resort: `init(backend="mpi")`, or no NCCL and
  no CUDA-aware MPI.

Completion and deadlines: every device collective returns through an event (NCCL) or MPI
requests (CUDA-aware MPI) that a wait polls with the group's deadline; it never calls a stream or
device synchronize that could block forever. While polling it answers peers' diagnosis queries
and checks the NCCL communicator's asynchronous error (ncclCommGetAsyncError). Past the deadline
it runs the same diagnosis as the MPI path (which ranks did not arrive), aborts the NCCL
communicator (ncclCommAbort, which stops its kernels), and raises CollectiveTimeout on every
waiting rank; a peer the heartbeat finds stuck (or ULFM finds dead) aborts it the same way and
raises RankFailure. The group's device collectives then raise CollectiveError (make a new group).

Semantics equal the MPI path: float16 reduces in float32 (a float32 copy on the device), bool
sum/max are logical or, min/prod logical and, "avg" is a sum divided by the group size; uneven
reduce_scatter counts reduce the whole array and keep this rank's rows. bfloat16 device arrays do
not exist in cupy. Sources: NCCL user guide (communicator creation from ncclGetUniqueId, group
calls, ncclCommAbort/ncclCommGetAsyncError); cupyx.distributed's NCCL backend.
"""
import os
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

from ..backend import cupy_module, env_flag, is_device_array
from ..errors import CollectiveError, CollectiveTimeout, ConfigError, RankFailure
from .group import (_REDUCE_CODES, _counts_crc, _ARG_SHIFT, ProcessGroup, _parent_ranks,
                    register_subgroup)
from .arrays import accepts_dlpack
from .mpi import BOOL_OPS, REDUCE_OPS, MPIBackend
from .work import Work

ASYNC_ERROR_INTERVAL_S = 0.01  # how often a wait asks NCCL for the communicator's async error
_NCCL_TYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
               "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
               "int64": "NCCL_INT64"}
_NCCL_OPS = {"sum": "NCCL_SUM", "avg": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN",
             "prod": "NCCL_PROD"}
_NCCL_BOOL_OPS = {"sum": "NCCL_MAX", "max": "NCCL_MAX", "min": "NCCL_MIN", "prod": "NCCL_MIN"}
DEVICE_DTYPES = tuple(np.dtype(name) for name in _NCCL_TYPES) + (np.dtype(np.bool_),)


def nccl_module():
    """cupy.cuda.nccl, or None when cupy or its NCCL binding is missing."""
    cp = cupy_module()
    if cp is None:
        return None
    try:
        from cupy.cuda import nccl

        return nccl if getattr(nccl, "available", True) else None
    except Exception:
        return None


def cuda_aware_mpi():
    """True when the MPI library can read device memory: $RTXMPI_CUDA_AWARE_MPI (1/0) decides
    when set; else Open MPI's ompi_info (mpi_built_with_cuda_support), MVAPICH2's MV2_USE_CUDA=1,
    or Cray MPICH's MPICH_GPU_SUPPORT_ENABLED=1."""
    forced = env_flag("RTXMPI_CUDA_AWARE_MPI", None)  # None: unset; ConfigError: not a boolean
    if forced is not None:
        return forced
    if os.environ.get("MV2_USE_CUDA") == "1" or os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1":
        return True
    if "Open MPI" in MPI.Get_library_version():
        try:
            out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                                 text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return False
        return "mpi_built_with_cuda_support:value:true" in out
    return False


def choose_transport(requested, allow_nccl=True):
    """The device transport for init(backend=...): "nccl", "cuda-aware-mpi" or None (host staging).

    "nccl" requires NCCL and a GPU (ConfigError naming what is missing otherwise); "auto" takes
    NCCL when present (and `allow_nccl`), else CUDA-aware MPI, else None; "mpi" is always None."""
    from ..backend import gpu_count

    if requested == "mpi":
        return None
    has_gpu = gpu_count() > 0
    if requested == "nccl":
        if cupy_module() is None:
            raise ConfigError("backend='nccl' needs cupy and NCCL: pip install -e '.[cuda12]' "
                              "(or use backend='mpi')")
        if nccl_module() is None:
            raise ConfigError("backend='nccl': cupy is installed but its NCCL binding is not; "
                              "pip install nvidia-nccl-cu12 (or use backend='mpi')")
        if not has_gpu:
            raise ConfigError("backend='nccl': no CUDA device is visible to this process "
                              "(CUDA_VISIBLE_DEVICES, driver); use backend='mpi' on CPU hosts")
        return "nccl"
    if not has_gpu:
        return None
    if allow_nccl and nccl_module() is not None:
        return "nccl"
    return "cuda-aware-mpi" if cuda_aware_mpi() else None


_STRENGTH = {None: 0, "cuda-aware-mpi": 1, "nccl": 2}


def agree_transport(comm, requested, device=None):
    """choose_transport on every rank, agreed over `comm` (lowercase allgather, once at init):
    ConfigError on EVERY rank when any rank cannot honour backend="nccl" (naming the ranks);
    otherwise the weakest transport any rank has, so all ranks take the same path.

    device: this rank's GPU as (host name, PCI bus id) (backend.device_identity), or None. NCCL
    refuses two ranks of one communicator on one GPU, so when ranks share a GPU "auto" takes the
    best transport without NCCL and "nccl" is a ConfigError on every rank naming them. Collective."""
    try:
        mine, error = choose_transport(requested), None
        without_nccl = choose_transport(requested, allow_nccl=False)
    except ConfigError as exc:
        mine, without_nccl, error = None, None, str(exc)
    table = comm.allgather((mine, without_nccl, error, device))
    failed = [(r, e) for r, (_, _, e, _) in enumerate(table) if e]
    if failed:
        ranks = [r for r, _ in failed]
        raise ConfigError(f"ranks {ranks} cannot use backend={requested!r}: {failed[0][1]}")
    sharing = shared_devices([row[3] for row in table])
    if sharing and any(row[0] == "nccl" for row in table):
        (host, bus), ranks = next(iter(sharing.items()))
        what = f"ranks {ranks} share the GPU {bus} on {host}"
        if requested == "nccl":
            raise ConfigError(f"backend='nccl': {what}, and NCCL needs one GPU per rank: launch at "
                              "most one rank per GPU, or use backend='mpi'")
        if comm.Get_rank() == 0:
            print(f"rtxmpi: {what}: cupy arrays travel without NCCL (one GPU per rank for NCCL)",
                  file=sys.stderr, flush=True)
        return min((row[1] for row in table), key=_STRENGTH.__getitem__)
    return min((row[0] for row in table), key=_STRENGTH.__getitem__)


def shared_devices(devices):
    """{device: [ranks]} for each device (any hashable; None = no GPU) that two or more of the
    ranks `devices[r]` use, in rank order."""
    ranks = {}
    for rank, device in enumerate(devices):
        if device is not None:
            ranks.setdefault(tuple(device), []).append(rank)
    return {device: members for device, members in ranks.items() if len(members) > 1}


def make_world(transport, comm, monitor, members, device, **group_kwargs):
    """The world group: a ProcessGroup on MPI when `transport` is None, else a DeviceGroup."""
    if transport is None:
        return ProcessGroup(MPIBackend(comm, monitor, "world", members), device=device,
                            members=members, **group_kwargs)
    device_id = int(device.split(":")[1]) if device.startswith("cuda:") else 0
    backend = DeviceBackend(comm, monitor, "world", members, transport=transport,
                            device_id=device_id)
    return DeviceGroup(backend, device=device, members=members, **group_kwargs)


# ------------------------------------------------------------------------------ completion
class _Pending:
    """A device operation in flight: done when `event` (on the transport's stream) has completed
    (NCCL), or when MPI `requests` complete (CUDA-aware MPI). Holds the buffers until then."""

    __slots__ = ("event", "requests", "keep")

    def __init__(self, event=None, requests=None, keep=None):
        self.event, self.requests, self.keep = event, requests, keep


class DeviceBackend(MPIBackend):
    """MPIBackend plus a device transport ("nccl" or "cuda-aware-mpi") for cupy arrays.

    Not used directly: see DeviceGroup. `name` is the transport's ("nccl" / "cuda-aware-mpi").
    """

    device_native = True

    def __init__(self, comm, monitor, group_name, members, transport="nccl", device_id=0):
        super().__init__(comm, monitor, group_name, members)
        self.transport = transport
        self.name = transport
        self.device_id = device_id
        self.nccl_comm = None
        self.aborted = None  # the error that aborted the communicator, once one has
        self._stream = None

    # -- NCCL communicator and stream ---------------------------------------------------------
    def stream(self):
        """The group's own CUDA stream (non-blocking), created on first use."""
        if self._stream is None:
            cp = cupy_module()
            with cp.cuda.Device(self.device_id):
                self._stream = cp.cuda.Stream(non_blocking=True)
        return self._stream

    def communicator(self, seq, timeout_s):
        """The group's NCCL communicator, created on first use. Collective over the group (all
        ranks reach it at the same device collective): rank 0 draws the unique id, an Ibcast
        polled with the deadline hands it out, an arrival barrier makes sure every rank is
        there, then ncclCommInitRank with NCCL rank = group rank."""
        if self.nccl_comm is not None:
            return self.nccl_comm
        nccl = nccl_module()
        uid = np.zeros(128, np.uint8)
        if self.comm.Get_rank() == 0:
            uid[:] = np.frombuffer(bytes(nccl.get_unique_id()), np.uint8)
        self.wait([self.comm.Ibcast(uid, root=0)], op="nccl_init", seq=seq, timeout_s=timeout_s)
        if self.size > 1:
            self.arrive("nccl_init", seq, timeout_s)
        cp = cupy_module()
        with cp.cuda.Device(self.device_id):
            self.nccl_comm = nccl.NcclCommunicator(self.size, uid.tobytes(), self.comm.Get_rank())
        return self.nccl_comm

    def check_usable(self, op):
        if self.aborted is not None:
            raise CollectiveError(f"{op} on group '{self.group_name}': the group's NCCL "
                                  f"communicator was aborted ({self.aborted}); create a new group")

    def abort(self, reason):
        """Abort the NCCL communicator (stops its kernels); the group's device path is then
        unusable. Local."""
        self.aborted = reason
        if self.nccl_comm is not None:
            try:
                self.nccl_comm.abort()
            except Exception:  # already failed or destroyed: nothing more to stop
                pass

    def launch(self, stream, run, keep):
        """Run `run(stream_ptr)` (enqueues NCCL calls) on the group's stream after the caller's
        `stream` (None = current) reached this point; the caller's stream then waits for it.
        Returns a _Pending completed by an event."""
        cp = cupy_module()
        caller = stream if stream is not None else cp.cuda.get_current_stream()
        own = self.stream()
        ready = cp.cuda.Event(disable_timing=True)
        ready.record(caller)
        own.wait_event(ready)
        run(own.ptr)
        done = cp.cuda.Event(disable_timing=True)
        done.record(own)
        caller.wait_event(done)
        return _Pending(event=done, keep=keep)

    def stream_reached(self, stream, op, seq, timeout_s):
        """Wait (polling, with the deadline) until the caller's stream has run everything queued
        so far: CUDA-aware MPI reads device memory outside any stream."""
        cp = cupy_module()
        event = cp.cuda.Event(disable_timing=True)
        event.record(stream if stream is not None else cp.cuda.get_current_stream())
        self.wait(_Pending(event=event), op=op, seq=seq, timeout_s=timeout_s)

    # -- waiting: MPI requests or device events ----------------------------------------------
    def test(self, requests):
        if not isinstance(requests, _Pending):
            return super().test(requests)
        if requests.requests is not None:
            return super().test(requests.requests)
        self._check_async_error(requests, "test")
        return requests.event.done

    def wait(self, requests, *, op, seq, timeout_s):
        if not isinstance(requests, _Pending):
            return super().wait(requests, op=op, seq=seq, timeout_s=timeout_s)
        if requests.requests is not None:
            return super().wait(requests.requests, op=op, seq=seq, timeout_s=timeout_s)
        event = requests.event
        if event.done:
            return
        next_check = time.monotonic() + ASYNC_ERROR_INTERVAL_S

        def done():  # the event, and every ASYNC_ERROR_INTERVAL_S the communicator's async error
            nonlocal next_check
            if event.done:
                return True
            now = time.monotonic()
            if now >= next_check:
                self._check_async_error(requests, op)
                next_check = now + ASYNC_ERROR_INTERVAL_S
            return False

        try:  # the monitor's deadline-aware wait: service, heartbeat, diagnosis on every member
            super().wait(done, op=op, seq=seq, timeout_s=timeout_s)
        except CollectiveTimeout:
            self.abort(f"{op} #{seq} timed out")  # never leave a kernel waiting on the device
            raise
        except RankFailure as exc:  # a stuck or dead peer (heartbeat, ULFM): the same
            self.abort(f"{op} #{seq}: {exc}")
            raise

    def _check_async_error(self, pending, op):
        if self.nccl_comm is None:
            return
        try:
            self.nccl_comm.check_async_error()
        except Exception as exc:  # cupy's NcclError: a peer failed or the network broke
            self.abort(f"NCCL error: {exc}")
            raise CollectiveError(f"{op} on group '{self.group_name}': NCCL reported "
                                  f"{exc}; the communicator was aborted") from None


# ---------------------------------------------------------------------------------- group
class DeviceGroup(ProcessGroup):
    """A ProcessGroup whose cupy arrays stay on the device (NCCL or CUDA-aware MPI).

    Same methods, arguments, results and errors as ProcessGroup (docs/comm.md); cupy arrays take
    the device transport, numpy arrays the MPI path. `stream=` orders a device collective after
    that CUDA stream's work (None: cupy's current stream) and makes the stream wait for the
    result; `async_op=True` returns a Work completed by a CUDA event (NCCL) or MPI requests.
    Extra: `send_recv(sends, recvs)`, grouped point-to-point.
    """

    # -- helpers ------------------------------------------------------------------------------
    def _device_array(self, x, op, writable=False):
        if x.dtype not in DEVICE_DTYPES:
            raise TypeError(f"{op}: dtype {x.dtype} is not supported by the {self.backend.name} "
                            "backend for cupy arrays; supported: "
                            + ", ".join(d.name for d in DEVICE_DTYPES))
        self.backend.check_usable(op)

    def _nccl_type(self, dtype):
        return getattr(nccl_module(), _NCCL_TYPES[np.dtype(dtype).name])

    def _reduce_device_buffer(self, x, op):
        """(contiguous 1-D device buffer, write-back callable or None, NCCL/MPI op) for reducing
        x with `op`: float16 as a float32 copy, bool as uint8 with max/min."""
        cp = cupy_module()
        if x.dtype == np.float16:
            buf = x.astype(cp.float32).reshape(-1)
            return buf, (lambda: x.__setitem__(..., buf.reshape(x.shape))), op
        contiguous = x if x.flags.c_contiguous else cp.ascontiguousarray(x)
        buf = contiguous.reshape(-1)
        writeback = None if contiguous is x else (lambda: x.__setitem__(..., contiguous))
        if x.dtype == np.bool_:
            return buf.view(cp.uint8), writeback, ("bool", op)
        return buf, writeback, op

    def _nccl_op(self, op):
        nccl = nccl_module()
        if isinstance(op, tuple):
            return getattr(nccl, _NCCL_BOOL_OPS[op[1]])
        return getattr(nccl, _NCCL_OPS[op])

    def _mpi_op(self, op):
        return BOOL_OPS[op[1]] if isinstance(op, tuple) else REDUCE_OPS[op]

    def _device_run(self, op, seq, start, finish, async_op, stream):
        """Start the device transfer (`start(stream)` -> _Pending); complete it now (polling with
        the deadline) or return a Work."""
        pending = start(stream)
        work = Work(self, op, seq, pending, finish, keep=pending)
        return work if async_op else work.wait()

    def _collective(self, op, stream, nccl_call, mpi_call, keep, seq, timeout_s):
        """A _Pending for one transfer on the group's transport."""
        backend = self.backend
        if backend.transport == "nccl":
            comm = backend.communicator(seq, timeout_s)
            return backend.launch(stream, lambda s: nccl_call(comm, s), keep)
        backend.stream_reached(stream, op, seq, timeout_s)
        return _Pending(requests=mpi_call(), keep=keep)

    @staticmethod
    def _on(stream):
        cp = cupy_module()
        return stream if stream is not None else cp.cuda.get_current_stream()

    # -- collectives ----------------------------------------------------------------------------
    @accepts_dlpack
    def all_reduce(self, x, op="sum", *, async_op=False, stream=None):
        if not is_device_array(x):
            return super().all_reduce(x, op, async_op=async_op, stream=stream)
        self._device_array(x, "all_reduce", writable=True)
        self._check_reduce_op(x, "all_reduce", op)
        seq, _ = self._begin("all_reduce", x, _REDUCE_CODES[op], arrive=True)
        buf, writeback, dop = self._reduce_device_buffer(x, op)
        size, on = self.world_size, self._on(stream)

        def finish():
            with on:
                if op == "avg":
                    buf[...] /= size
                if writeback is not None:
                    writeback()
            return x

        def start(stream_):
            return self._collective(
                "all_reduce", stream_,
                lambda comm, s: comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size,
                                               self._nccl_type(buf.dtype), self._nccl_op(dop), s),
                lambda: [self.backend.comm.Iallreduce(MPI.IN_PLACE, buf, self._mpi_op(dop))],
                buf, seq, self.timeout_s)

        return self._device_run("all_reduce", seq, start, finish, async_op, stream)

    @accepts_dlpack
    def reduce_scatter(self, x, op="sum", *, counts=None, async_op=False, stream=None):
        if not is_device_array(x):
            return super().reduce_scatter(x, op, counts=counts, async_op=async_op, stream=stream)
        cp = cupy_module()
        self._device_array(x, "reduce_scatter")
        self._check_reduce_op(x, "reduce_scatter", op)
        seq, _ = self._begin("reduce_scatter", x, _REDUCE_CODES[op] + _ARG_SHIFT * _counts_crc(counts))
        if counts is None:
            self._check_divisible(x, "reduce_scatter")
            rows = x.shape[0] // self.world_size
            first = self.rank * rows
        else:
            counts = self._check_counts(x, counts)
            rows, first = counts[self.rank], sum(counts[:self.rank])
        size, on = self.world_size, self._on(stream)
        with on:
            work_buf, _, dop = self._reduce_device_buffer(x.copy() if counts is not None else x, op)
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        shard_shape = (rows,) + tuple(x.shape[1:])
        if counts is None:
            out = cp.empty(rows * row, work_buf.dtype)
        else:
            out = work_buf  # uneven: reduce everything, keep this rank's rows

        def finish():
            with on:
                result = out if counts is None else out[first * row:(first + rows) * row]
                if op == "avg":
                    result = result / size
                if x.dtype == np.bool_:
                    return result.view(cp.bool_).reshape(shard_shape)
                return result.astype(x.dtype, copy=False).reshape(shard_shape)

        def start(stream_):
            if counts is None:
                return self._collective(
                    "reduce_scatter", stream_,
                    lambda comm, s: comm.reduceScatter(work_buf.data.ptr, out.data.ptr, out.size,
                                                       self._nccl_type(out.dtype),
                                                       self._nccl_op(dop), s),
                    lambda: [self.backend.comm.Ireduce_scatter_block(work_buf, out, self._mpi_op(dop))],
                    (work_buf, out), seq, self.timeout_s)
            return self._collective(
                "reduce_scatter", stream_,
                lambda comm, s: comm.allReduce(work_buf.data.ptr, work_buf.data.ptr, work_buf.size,
                                               self._nccl_type(work_buf.dtype), self._nccl_op(dop), s),
                lambda: [self.backend.comm.Iallreduce(MPI.IN_PLACE, work_buf, self._mpi_op(dop))],
                work_buf, seq, self.timeout_s)

        return self._device_run("reduce_scatter", seq, start, finish, async_op, stream)

    @accepts_dlpack
    def all_gather(self, x, *, async_op=False, stream=None):
        if not is_device_array(x):
            return super().all_gather(x, async_op=async_op, stream=stream)
        cp = cupy_module()
        self._device_array(x, "all_gather")
        seq, _ = self._begin("all_gather", x)
        with self._on(stream):
            buf = cp.ascontiguousarray(x).reshape(-1).view(cp.uint8)
        shape = (self.world_size,) if x.ndim == 0 else (self.world_size * x.shape[0],) + x.shape[1:]
        out = cp.empty(shape, x.dtype)
        raw = out.reshape(-1).view(cp.uint8)

        def start(stream_):
            return self._collective(
                "all_gather", stream_,
                lambda comm, s: comm.allGather(buf.data.ptr, raw.data.ptr, buf.size,
                                               self._nccl_type(np.uint8), s),
                lambda: [self.backend.comm.Iallgather(buf, raw)], (buf, raw), seq, self.timeout_s)

        return self._device_run("all_gather", seq, start, lambda: out, async_op, stream)

    @accepts_dlpack
    def broadcast(self, x, src=0, *, async_op=False, stream=None):
        if not is_device_array(x):
            return super().broadcast(x, src, async_op=async_op, stream=stream)
        cp = cupy_module()
        self._device_array(x, "broadcast", writable=True)
        self._check_rank(src, "src")
        seq, _ = self._begin("broadcast", x, src)
        on = self._on(stream)
        with on:
            contiguous = x if x.flags.c_contiguous else cp.ascontiguousarray(x)
        raw = contiguous.reshape(-1).view(cp.uint8)

        def finish():
            if contiguous is not x:
                with on:
                    x[...] = contiguous
            return x

        def start(stream_):
            return self._collective(
                "broadcast", stream_,
                lambda comm, s: comm.broadcast(raw.data.ptr, raw.data.ptr, raw.size,
                                               self._nccl_type(np.uint8), src, s),
                lambda: [self.backend.comm.Ibcast(raw, root=src)], raw, seq, self.timeout_s)

        return self._device_run("broadcast", seq, start, finish, async_op, stream)

    @accepts_dlpack
    def all_to_all(self, x, *, async_op=False, stream=None):
        if not is_device_array(x):
            return super().all_to_all(x, async_op=async_op, stream=stream)
        cp = cupy_module()
        self._device_array(x, "all_to_all")
        seq, _ = self._begin("all_to_all", x)
        self._check_divisible(x, "all_to_all")
        with self._on(stream):
            buf = cp.ascontiguousarray(x).reshape(-1).view(cp.uint8)
        out = cp.empty(x.shape, x.dtype)
        raw = out.reshape(-1).view(cp.uint8)
        n, chunk = self.world_size, buf.size // self.world_size
        uint8 = self._nccl_type(np.uint8)

        def grouped(comm, s):
            nccl = nccl_module()
            nccl.groupStart()
            try:
                for peer in range(n):
                    comm.send(buf.data.ptr + peer * chunk, chunk, uint8, peer, s)
                    comm.recv(raw.data.ptr + peer * chunk, chunk, uint8, peer, s)
            finally:
                nccl.groupEnd()

        def start(stream_):
            return self._collective("all_to_all", stream_, grouped,
                                    lambda: [self.backend.comm.Ialltoall(buf, raw)],
                                    (buf, raw), seq, self.timeout_s)

        return self._device_run("all_to_all", seq, start, lambda: out, async_op, stream)

    # -- point to point -------------------------------------------------------------------------
    def send_recv(self, sends=(), recvs=(), *, async_op=False, stream=None):
        """Grouped point-to-point: every (array, dst) of `sends` and (array, src) of `recvs`
        posted together (one ncclGroupStart/End on NCCL; nonblocking MPI otherwise), so pairs of
        ranks may exchange in both directions without deadlock. Receive arrays are filled in
        place; shapes and dtypes must match the peers' sends. Returns None (or a Work). Only the
        ranks named take part (not a collective over the group). Arrays must all be cupy (device
        path) or all numpy. Raises CollectiveTimeout past the deadline, ValueError (ranks)."""
        arrays = [a for a, _ in sends] + [a for a, _ in recvs]
        for _, peer in list(sends) + list(recvs):
            self._check_rank(peer, "peer")
        if not arrays:
            return None
        device = [is_device_array(a) for a in arrays]
        if any(device) != all(device):
            raise TypeError("send_recv: mix of cupy and numpy arrays; pass one kind")
        self._p2p_seq += 1
        if not device[0] or self.backend.transport != "nccl":
            works = [self.send(a, p, async_op=True, stream=stream) for a, p in sends]
            works += [self.recv(a, p, async_op=True, stream=stream) for a, p in recvs]
            if async_op:
                return _Joined(self, works)
            for w in works:
                w.wait()
            return None
        return self._grouped_p2p(sends, recvs, async_op, stream, None)

    def _grouped_p2p(self, sends, recvs, async_op, stream, result):
        """NCCL send/recv inside one group call; the Work's result is `result`."""
        cp = cupy_module()
        for a, _ in list(sends) + list(recvs):
            self._device_array(a, "send_recv")
        on = self._on(stream)
        with on:
            send_bufs = [(cp.ascontiguousarray(a).reshape(-1).view(cp.uint8), p) for a, p in sends]
            recv_bufs = [(a, a if a.flags.c_contiguous else cp.empty(a.shape, a.dtype), p)
                         for a, p in recvs]
        uint8 = self._nccl_type(np.uint8)

        def grouped(comm, s):
            nccl = nccl_module()
            nccl.groupStart()
            try:
                for buf, peer in send_bufs:
                    comm.send(buf.data.ptr, buf.size, uint8, peer, s)
                for _, buf, peer in recv_bufs:
                    comm.recv(buf.data.ptr, buf.nbytes, uint8, peer, s)
            finally:
                nccl.groupEnd()

        def finish():
            with on:
                for a, buf, _ in recv_bufs:
                    if buf is not a:
                        a[...] = buf
            return result

        seq = self._p2p_seq
        comm = self.backend.communicator(seq, self.timeout_s)
        pending = self.backend.launch(stream, lambda s: grouped(comm, s), (send_bufs, recv_bufs))
        work = Work(self, "send_recv", seq, pending, finish, keep=pending)
        return work if async_op else work.wait()

    @accepts_dlpack
    def send(self, x, dst, tag=0, *, async_op=False, stream=None):
        if not is_device_array(x) or self.backend.transport != "nccl":
            if is_device_array(x):  # CUDA-aware MPI: the stream must have produced x first
                self.backend.stream_reached(stream, "send", self._p2p_seq + 1, self.timeout_s)
                return self._device_p2p_mpi(x, dst, tag, async_op, send=True)
            return super().send(x, dst, tag, async_op=async_op, stream=stream)
        self._check_rank(dst, "dst")
        self._p2p_seq += 1
        return self._grouped_p2p([(x, dst)], [], async_op, stream, None)

    @accepts_dlpack
    def recv(self, x, src, tag=0, *, async_op=False, stream=None):
        if not is_device_array(x) or self.backend.transport != "nccl":
            if is_device_array(x):
                self.backend.stream_reached(stream, "recv", self._p2p_seq + 1, self.timeout_s)
                return self._device_p2p_mpi(x, src, tag, async_op, send=False)
            return super().recv(x, src, tag, async_op=async_op, stream=stream)
        self._check_rank(src, "src")
        self._p2p_seq += 1
        return self._grouped_p2p([], [(x, src)], async_op, stream, x)

    def _device_p2p_mpi(self, x, peer, tag, async_op, send):
        cp = cupy_module()
        self._device_array(x, "send" if send else "recv")
        self._check_rank(peer, "dst" if send else "src")
        self._p2p_seq += 1
        buf = cp.ascontiguousarray(x).reshape(-1).view(cp.uint8) if send or not x.flags.c_contiguous \
            else x.reshape(-1).view(cp.uint8)
        comm = self.backend.comm
        request = comm.Isend(buf, dest=peer, tag=tag) if send else comm.Irecv(buf, source=peer, tag=tag)

        def finish():
            if not send and buf.data.ptr != x.data.ptr:
                x[...] = buf.view(x.dtype).reshape(x.shape)
            return None if send else x

        work = Work(self, f"{'send to' if send else 'recv from'} {peer}", self._p2p_seq,
                    _Pending(requests=[request], keep=buf), finish, keep=buf)
        return work if async_op else work.wait()

    # -- sub-groups -----------------------------------------------------------------------------
    def _child(self, comm, name):
        members = [self.members[r] for r in _parent_ranks(comm, self.backend.comm)]
        parent = self.backend
        backend = register_subgroup(DeviceBackend(comm, parent.monitor, name, members,
                                                  transport=parent.transport,
                                                  device_id=parent.device_id))
        return DeviceGroup(backend, name=name, rank=comm.Get_rank(), world_size=comm.Get_size(),
                           members=members, local_rank=self.local_rank, device=self.device,
                           timeout_s=self.timeout_s, check=self.check)


class _Joined(Work):
    """A Work over several Works (send_recv on the MPI path): done when all are."""

    __slots__ = ("_works",)

    def __init__(self, group, works):
        super().__init__(group, "send_recv", group._p2p_seq, None, lambda: None)
        self._works = works

    def test(self):
        if not self._done and all(w.test() for w in self._works):
            self._complete()
        return self._done

    def wait(self, timeout_s=None):
        if not self._done:
            for w in self._works:
                w.wait(timeout_s)
            self._complete()
        return self._result
