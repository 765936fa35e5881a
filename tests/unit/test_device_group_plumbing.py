"""DeviceGroup's device path at one rank, on a stand-in for cupy and NCCL that keeps "device"
arrays in host memory and moves bytes by pointer exactly as the NCCL calls are told to (count,
datatype, pointers). This proves the Python plumbing without a GPU: buffer selection, element vs
byte counts, float16 in float32, bool as uint8, avg, uneven counts, write-back into strided views,
events, Work, grouped send/recv, split groups getting their own communicator. The real NCCL is
exercised by bench/gpu_check.py on a GPU."""
import ctypes
import types

import numpy as np
import pytest
from mpi4py import MPI

import rtxmpi.backend as backend
from rtxmpi.comm import nccl as nccl_mod
from rtxmpi.comm.monitor import Monitor
from rtxmpi.comm.work import Work


class FakeArray:
    """A "device" array: wraps a numpy array; results that are arrays come back wrapped."""

    def __init__(self, a):
        self._a = a

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self._a.ctypes.data)

    def __getattr__(self, name):
        value = getattr(self._a, name)
        if callable(value):
            return lambda *args, **kw: _wrap(value(*_unwrap_all(args), **_unwrap_kw(kw)))
        return value

    def __getitem__(self, key):
        return _wrap(self._a[key])

    def __setitem__(self, key, value):
        self._a[key] = _unwrap(value)

    def __itruediv__(self, other):
        self._a /= _unwrap(other)
        return self

    def __truediv__(self, other):
        return _wrap(self._a / _unwrap(other))

    def __mul__(self, other):
        return _wrap(self._a * _unwrap(other))

    def __eq__(self, other):
        return _wrap(self._a == _unwrap(other))

    def __len__(self):
        return len(self._a)


def _wrap(x):
    return FakeArray(x) if isinstance(x, np.ndarray) else x


def _unwrap(x):
    return x._a if isinstance(x, FakeArray) else x


def _unwrap_all(args):
    return [_unwrap(a) for a in args]


def _unwrap_kw(kw):
    return {k: _unwrap(v) for k, v in kw.items()}


class FakeStream:
    def __init__(self, non_blocking=False):
        self.ptr = id(self)
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeEvent:
    def __init__(self, disable_timing=False):
        self.recorded_on = None

    def record(self, stream=None):
        self.recorded_on = stream

    @property
    def done(self):
        return True


class FakeDevice:
    def __init__(self, index=0):
        self.id = index

    def use(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_CURRENT = FakeStream()
_TYPES = {"NCCL_FLOAT16": np.float16, "NCCL_FLOAT32": np.float32, "NCCL_FLOAT64": np.float64,
          "NCCL_INT8": np.int8, "NCCL_UINT8": np.uint8, "NCCL_INT32": np.int32,
          "NCCL_INT64": np.int64}
_CODES = {name: code for code, name in enumerate(_TYPES)}
_ITEMSIZE = {code: np.dtype(_TYPES[name]).itemsize for name, code in _CODES.items()}


class FakeNcclComm:
    """One-rank NCCL: every collective is a copy of the bytes it is told about."""

    created = []

    def __init__(self, size, uid, rank):
        assert size == 1 and rank == 0 and len(uid) == 128
        self.calls, self._sends = [], []
        FakeNcclComm.created.append(self)

    def _move(self, dst, src, count, dtype):
        if dst != src:
            ctypes.memmove(dst, src, count * _ITEMSIZE[dtype])

    def allReduce(self, send, recv, count, dtype, op, stream):
        self.calls.append(("allReduce", count, dtype, op))
        self._move(recv, send, count, dtype)

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        self.calls.append(("reduceScatter", count, dtype, op))
        self._move(recv, send, count, dtype)

    def allGather(self, send, recv, count, dtype, stream):
        self.calls.append(("allGather", count, dtype))
        self._move(recv, send, count, dtype)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.calls.append(("broadcast", count, dtype, root))
        self._move(recv, send, count, dtype)

    def send(self, ptr, count, dtype, peer, stream):
        self.calls.append(("send", count, dtype, peer))
        self._sends.append((ptr, count, dtype))

    def recv(self, ptr, count, dtype, peer, stream):
        self.calls.append(("recv", count, dtype, peer))
        src, n, t = self._sends.pop(0)
        assert n * _ITEMSIZE[t] == count * _ITEMSIZE[dtype], "send and recv sizes differ"
        self._move(ptr, src, count, dtype)

    def check_async_error(self):
        pass

    def abort(self):
        pass


@pytest.fixture
def group(monkeypatch):
    cp = types.SimpleNamespace(
        ndarray=FakeArray, float16=np.float16, float32=np.float32, uint8=np.uint8, bool_=np.bool_,
        asarray=lambda a, dtype=None: FakeArray(np.array(_unwrap(a), dtype=dtype)),
        asnumpy=lambda a: np.array(_unwrap(a)),
        empty=lambda shape, dtype=np.float32: FakeArray(np.empty(shape, dtype)),
        ascontiguousarray=lambda a: FakeArray(np.ascontiguousarray(_unwrap(a))),
        cuda=types.SimpleNamespace(Stream=FakeStream, Event=FakeEvent, Device=FakeDevice,
                                   get_current_stream=lambda: _CURRENT,
                                   runtime=types.SimpleNamespace(getDeviceCount=lambda: 1)))
    fake_nccl = types.SimpleNamespace(NcclCommunicator=FakeNcclComm, groupStart=lambda: None,
                                      groupEnd=lambda: None, get_unique_id=lambda: bytes(128),
                                      NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3, **_CODES)
    monkeypatch.setattr(backend, "_cupy", cp)
    monkeypatch.setattr(backend, "_cupy_checked", True)
    monkeypatch.setattr(nccl_mod, "nccl_module", lambda: fake_nccl)
    FakeNcclComm.created = []
    comm = MPI.COMM_SELF.Dup()
    g = nccl_mod.make_world("nccl", comm, Monitor(comm), [0], "cuda:0", name="fake", rank=0,
                            world_size=1, local_rank=0, timeout_s=10, check=False)
    g.cp = cp
    return g


def dev(a):
    return FakeArray(np.array(a))


def test_all_reduce_counts_elements_and_orders_streams(group):
    x = dev(np.arange(10, dtype=np.float32))
    assert group.all_reduce(x) is x and (x._a == np.arange(10)).all()
    comm = FakeNcclComm.created[0]
    assert comm.calls == [("allReduce", 10, _CODES["NCCL_FLOAT32"], 0)]
    own = group.backend.stream()
    assert own.waited and _CURRENT.waited  # group stream after the caller's, and back


def test_float16_reduces_as_float32_and_bool_as_uint8_max(group):
    h = dev(np.array([1.5, -2.0], np.float16))
    group.all_reduce(h, op="avg")
    assert h._a.dtype == np.float16 and h._a.tolist() == [1.5, -2.0]
    b = dev(np.array([True, False]))
    group.all_reduce(b)
    calls = FakeNcclComm.created[0].calls
    assert calls[0][2] == _CODES["NCCL_FLOAT32"]
    assert calls[1][2:] == (_CODES["NCCL_UINT8"], 2)  # bool sum is MAX on uint8
    assert b._a.tolist() == [True, False]


def test_strided_view_is_written_back(group):
    base = np.arange(12, dtype=np.float64).reshape(3, 4)
    view = FakeArray(base[:, 1])
    group.all_reduce(view, op="max")
    assert base[:, 1].tolist() == [1.0, 5.0, 9.0]


def test_reduce_scatter_all_gather_broadcast_all_to_all(group):
    x = dev(np.arange(12, dtype=np.int64).reshape(4, 3))
    shard = group.reduce_scatter(x)
    assert shard.shape == (4, 3) and (shard._a == x._a).all()
    uneven = group.reduce_scatter(dev(np.ones((5, 2), np.float32)), counts=[5], op="avg")
    assert uneven.shape == (5, 2) and (uneven._a == 1).all()
    gathered = group.all_gather(dev(np.array([7, 8], np.int32)))
    assert gathered._a.tolist() == [7, 8]
    y = dev(np.array([3.0, 4.0]))
    assert group.broadcast(y, src=0)._a.tolist() == [3.0, 4.0]
    z = group.all_to_all(dev(np.arange(6, dtype=np.float32)))
    assert z._a.tolist() == list(range(6))
    names = [c[0] for c in FakeNcclComm.created[0].calls]
    assert names == ["reduceScatter", "allReduce", "allGather", "broadcast", "send", "recv"]
    assert FakeNcclComm.created[0].calls[2][1] == 8  # all_gather counts bytes (2 x int32)


def test_async_work_and_grouped_send_recv_to_self(group):
    work = group.all_reduce(dev(np.ones(4, np.float32)), async_op=True)
    assert isinstance(work, Work) and work.test() and (work.wait()._a == 1).all()
    src, dst = dev(np.arange(5, dtype=np.int64)), dev(np.zeros(5, np.int64))
    group.send_recv(sends=[(src, 0)], recvs=[(dst, 0)])
    assert dst._a.tolist() == list(range(5))
    got = dev(np.zeros(3, np.float32))
    group.send(dev(np.full(3, 2.0, np.float32)), 0, async_op=True)
    assert group.recv(got, 0) is got and got._a.tolist() == [2.0] * 3


def test_split_groups_create_their_own_communicator(group):
    sub = group.split(color=0)
    assert isinstance(sub, nccl_mod.DeviceGroup) and sub.backend.transport == "nccl"
    sub.all_reduce(dev(np.ones(2)))
    group.all_reduce(dev(np.ones(2)))
    assert len(FakeNcclComm.created) == 2  # one per group, created on first use


def test_unsupported_device_dtype_and_numpy_arrays(group):
    with pytest.raises(TypeError, match="complex64 is not supported by the nccl backend"):
        group.all_reduce(dev(np.ones(2, np.complex64)))
    host = np.ones(3, np.float32)
    assert group.all_reduce(host) is host  # numpy stays on MPI
    assert not FakeNcclComm.created


def test_device_collectives_compare_fingerprints_before_launching(group, monkeypatch):
    """Checking off, every device collective runs the arrival check with its fingerprint before
    it enqueues anything (before: a device all_reduce, reduce_scatter, all_gather, broadcast or
    all_to_all with ranks passing different sizes launched NCCL kernels that could hang or
    corrupt memory)."""
    from rtxmpi.comm import fingerprint
    from rtxmpi.errors import CollectiveMismatch

    seen = []

    def arrive(op, seq, timeout_s, fp=None):
        seen.append((op, fp))
        raise CollectiveMismatch(f"{op}: the ranks' fingerprints differ")

    monkeypatch.setattr(group.backend, "arrive", arrive)
    group.world_size = 2  # the check runs only with peers
    x = dev(np.ones(4, np.float32))
    calls = {"all_reduce": lambda: group.all_reduce(x, op="max"),
             "reduce_scatter": lambda: group.reduce_scatter(x),
             "all_gather": lambda: group.all_gather(x),
             "broadcast": lambda: group.broadcast(x, src=1),
             "all_to_all": lambda: group.all_to_all(x)}
    for call in calls.values():
        with pytest.raises(CollectiveMismatch):
            call()
    assert [op for op, _ in seen] == list(calls)
    host = np.ones(4, np.float32)
    assert seen[0][1] == fingerprint.of("all_reduce", host, fingerprint.REDUCE_CODES["max"])
    assert seen[3][1] == fingerprint.of("broadcast", host, 1)
    assert not FakeNcclComm.created  # nothing was launched
