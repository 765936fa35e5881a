"""The device stand-in (tests/devicesim.py) fails loudly on numpy-only code, and with it: the model's
fused kernels on cupy, checkpoint device-to-host streaming, host-staged async sends. The whole
training paths on the stand-in are in tests/mpi/test_device_path.py."""
import os
import sys

import h5py
import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import devicesim  # noqa: E402

from rtxmpi import fused, kernels  # noqa: E402
from rtxmpi.backend import is_device_array, xp_of  # noqa: E402
from rtxmpi.checkpoint import Shard  # noqa: E402
from rtxmpi.checkpoint import format as fmt  # noqa: E402
from rtxmpi.comm.monitor import Monitor  # noqa: E402
from rtxmpi.comm.nccl import make_world  # noqa: E402
from rtxmpi.nn import GPT, GPTConfig  # noqa: E402


@pytest.fixture
def sim(monkeypatch):
    return devicesim.install(monkeypatch)


def test_stand_in_arrays_are_device_arrays_of_their_own_module(sim):
    x = sim.zeros(3, np.float32)
    assert not isinstance(x, np.ndarray) and is_device_array(x) and xp_of(x) is sim
    assert isinstance(x.sum(), sim.ndarray) and x.sum().ndim == 0  # 0-d arrays, as cupy


@pytest.mark.parametrize("call", [
    lambda x: np.asarray(x), lambda x: np.ascontiguousarray(x), lambda x: np.concatenate([x]),
    lambda x: np.add.at(x, [0], 1.0), lambda x: np.exp(x), lambda x: memoryview(x),
    lambda x: MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, x),
], ids=["asarray", "ascontiguousarray", "concatenate", "add.at", "ufunc", "buffer", "mpi4py"])
def test_numpy_and_buffer_consumers_refuse_stand_in_arrays(sim, call):
    with pytest.raises(TypeError):
        call(sim.arange(4, dtype=np.float32))


def test_h5py_write_and_numpy_only_methods_refuse(sim, tmp_path):
    x = sim.arange(4, dtype=np.float32)
    with h5py.File(tmp_path / "f.h5", "w") as f, pytest.raises(TypeError):
        f.create_dataset("x", data=x)
    for name in ("tobytes", "tostring", "resize", "byteswap"):
        with pytest.raises(AttributeError):
            getattr(x, name)
    with pytest.raises(AttributeError):
        sim.frombuffer


def test_mixing_host_and_device_arrays_raises_but_explicit_copies_work(sim):
    x, host = sim.zeros(4, np.float32), np.arange(4, dtype=np.float32)
    for mix in (lambda: x + host, lambda: host * x, lambda: sim.concatenate([x, host]),
                lambda: sim.multiply(x, 2.0, out=host)):
        with pytest.raises(TypeError):
            mix()
    with pytest.raises(TypeError):
        x[1:3] = host[:2]  # cupy copies a numpy value only into x[:]
    x[:] = host
    x += np.float32(1.0)  # numpy scalars are fine
    np.testing.assert_array_equal(x.get(), host + 1)
    np.testing.assert_array_equal(sim.asnumpy(sim.asarray(host)), host)


def test_kernel_launch_is_checked_against_the_cuda_signature(sim):
    fn = kernels._kernel("bias_gelu", "bias_gelu_forward_f32")
    h, b = sim.zeros((2, 8), np.float32), sim.zeros(8, np.float32)
    u, y = sim.empty_like(h), sim.empty_like(h)
    good = (h, b, u, y, np.int64(16), np.int64(8), np.float32(0.1), np.float32(0.8))
    fn((1,), (256,), good)
    for i, bad in [(4, 16), (5, np.int32(8)), (6, 0.1), (0, h.get())]:  # types, host pointer
        args = list(good)
        args[i] = bad
        with pytest.raises(TypeError):
            fn((1,), (256,), tuple(args))
    with pytest.raises(ValueError):  # n does not match the arrays
        fn((1,), (256,), good[:4] + (np.int64(15),) + good[5:])


def test_model_on_device_runs_the_fused_kernels_and_matches_numpy_bitwise(sim):
    """cupy path: bias+GELU (forward, backward), residual+LayerNorm, the attention softmax
    (forward, backward) and LayerNorm backward through rtxmpi.kernels, one launch per block and
    pass (LayerNorm backward: two per block and the final one; column sums: the three linear
    biases, bias+GELU's and the two LayerNorms' of each block, and the final LayerNorm's); the stand-in runs the kernels' numpy references, so loss and
    every gradient equal the numpy model's bit for bit on its numpy references (rtxmpi.fused
    off: the unfused path)."""
    cfg = GPTConfig.named("tiny", seq_len=16)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (2, 16)), rng.integers(0, 256, (2, 16))
    host, device = GPT(cfg, seed=1), GPT(cfg, seed=1, xp=sim)
    previous = fused.set_enabled(False)
    try:
        loss, cache = host.forward(x, y)
        host.backward(cache)
    finally:
        fused.set_enabled(previous)
    assert devicesim.launches == {}  # numpy never launches
    dloss, dcache = device.forward(x, y)
    device.backward(dcache)
    L = cfg.n_layer
    assert devicesim.launches == {"bias_gelu_forward_f32": L, "residual_layernorm_forward_f32": L,
                                  "bias_gelu_backward_f32": L, "softmax_forward_f32": L,
                                  "softmax_backward_f32": L, "layernorm_backward_dx_f32": 2 * L + 1,
                                  "column_sums_f32": 6 * L + 1}
    assert dloss == loss
    np.testing.assert_array_equal(device.flat_grad.get(), host.flat_grad)


def test_checkpoint_streams_a_device_tensor_in_chunks_with_the_same_bytes(sim, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(fmt, "STREAM_CHUNK_BYTES", 64)  # 16 float32 per chunk: 7 chunks
    pinned = []
    monkeypatch.setattr(fmt, "host_empty", lambda *a, **k: pinned.append(k) or np.empty(*a))
    values = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    host = fmt.write_rank_file(tmp_path / "host.h5", {"p": Shard(values, 100, 300)})
    dev = fmt.write_rank_file(tmp_path / "dev.h5", {"p": Shard(sim.asarray(values), 100, 300)})
    assert dev == host and pinned == [{"pinned": True}] * 2
    with h5py.File(tmp_path / "dev.h5") as f:
        np.testing.assert_array_equal(f["tensors/p"][...], values)
    empty = fmt.write_rank_file(tmp_path / "e.h5", {"p": Shard(sim.zeros(0, np.float32), 0, 0)})
    assert empty["p"]["length"] == 0


def test_host_staged_async_send_stays_in_flight(sim):
    """A cupy send with async_op=True on the host-staged path must not block until received:
    pipeline stages post their sends before their receives (send-send would deadlock)."""
    comm = MPI.COMM_SELF.Dup()
    group = make_world(None, comm, Monitor(comm), [0], "cuda:0", name="self", rank=0,
                       world_size=1, local_rank=0, timeout_s=10, check=False)
    x = sim.arange(1 << 18, dtype=np.float32)  # 1 MiB: past any eager limit
    work = group.send(x, 0, tag=3, async_op=True)  # blocking here would time out
    out = group.recv(sim.zeros(1 << 18, np.float32), 0, tag=3)
    work.wait()
    np.testing.assert_array_equal(out.get(), x.get())
    comm.Free()
