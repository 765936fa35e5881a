"""The CUDA kernels (kernels/*.cu) run on the CPU: compiled with g++ against
tests/kernel_host/host_cuda.h, which emulates the CUDA thread model (a std::thread per GPU
thread, barriers for __syncthreads and warp shuffles), and launched by rtxmpi.kernels' own
cupy path (the device stand-in of tests/devicesim.py holds the arrays; rtxmpi.kernels._kernel
hands out the emulated kernels). So the kernel sources, their launch shapes and their argument
lists are checked against the numpy references without a GPU; bench/gpu_check.py checks the
same on one."""
import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rtxmpi import kernels
from rtxmpi.nn import GPT, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import devicesim  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
HOST = os.path.join(HERE, "..", "kernel_host")
CXX = shutil.which("g++")
_CTYPES = {"long long": ctypes.c_longlong, "int": ctypes.c_int, "float": ctypes.c_float}
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def host_library(tmp_path_factory):
    if CXX is None:
        pytest.skip("no g++")
    tmp = tmp_path_factory.mktemp("kernel_host")
    probe = tmp / "probe.cpp"
    probe.write_text("#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n")
    if subprocess.run([CXX, "-std=c++20", "-pthread", str(probe), "-o", str(tmp / "probe")],
                      capture_output=True).returncode != 0:
        pytest.skip("g++ without C++20 <barrier>")
    lib = tmp / "kernels_host.so"
    out = subprocess.run([CXX, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared",
                          "-pthread", "-I", kernels.kernel_dir(), "-I", HOST, "-o", str(lib),
                          os.path.join(HOST, "launch.cpp")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr  # a kernel that does not compile fails here
    return ctypes.CDLL(str(lib))


class _HostKernel:
    """Stands for a cupy.RawKernel: kernel((grid...), (block,), args) runs host_<name>."""

    def __init__(self, library, name, signature):
        self.fn, self.signature = getattr(library, "host_" + name), signature

    def __call__(self, grid, block, args, **_):
        assert len(args) == len(self.signature)
        c_args = []
        for arg, (ctype, pointer) in zip(args, self.signature):
            if pointer:
                assert isinstance(arg, devicesim.SimArray) and arg._a.flags.c_contiguous
                c_args.append(ctypes.c_void_p(arg._a.ctypes.data))
            else:
                c_args.append(_CTYPES[ctype](arg))
        assert 1 <= block[0] <= 1024 and block[0] % 32 == 0
        self.fn(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1] if len(grid) > 1 else 1),
                ctypes.c_uint(block[0]), *c_args)


@pytest.fixture
def sim(monkeypatch, host_library):
    module = devicesim.install(monkeypatch)
    signatures = {}
    for name in kernels.KERNEL_FILES:
        signatures.update(devicesim.kernel_signatures(kernels.kernel_source(name)))
    monkeypatch.setattr(kernels, "_kernel", lambda name, function: _HostKernel(
        host_library, function, signatures[function]))
    return module


def _f32(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("shape", [(2, 2, 33, 33), (1, 1, 1, 1), (1, 3, 70, 70)])
@pytest.mark.parametrize("causal", [True, False])
def test_softmax_forward_and_backward(sim, shape, causal):
    scores, datt = _f32(*shape, scale=4.0), _f32(*shape)
    want = kernels.softmax_forward(scores.copy(), causal)
    got = kernels.softmax_forward(sim.asarray(scores), causal).get()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    if causal:  # the future keys are exactly 0
        assert not got[..., np.triu(np.ones(shape[-2:], bool), 1)].any()
    np.testing.assert_allclose(got.sum(axis=-1), 1.0, rtol=1e-5)
    dwant = kernels.softmax_backward(datt.copy(), want)
    dgot = kernels.softmax_backward(sim.asarray(datt), sim.asarray(got)).get()
    np.testing.assert_allclose(dgot, dwant, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("rows, C", [(37, 200), (5, 7), (600, 64)])
def test_layernorm_backward_and_column_sums(sim, rows, C):
    dy, xhat, g = _f32(rows, C), _f32(rows, C), _f32(C)
    rstd = (RNG.random((rows, 1)) + 0.5).astype(np.float32)
    got = kernels.layernorm_backward(*(sim.asarray(a) for a in (dy, xhat, rstd, g)))
    want = kernels.layernorm_backward(dy, xhat, rstd, g)
    for d, w in zip(got, want):
        np.testing.assert_allclose(d.get(), w, rtol=1e-4, atol=1e-5)
    total, none = kernels.column_sums(sim.asarray(dy))
    assert none is None
    np.testing.assert_allclose(total.get(), dy.sum(axis=0), rtol=1e-4, atol=1e-4)


def test_residual_layernorm_and_bias_gelu_as_on_the_gpu(sim):
    """Kernels already checked on a GPU (bench/gpu_check.py): the emulation agrees with them."""
    x, r, g, b = _f32(9, 130), _f32(9, 130), _f32(130), _f32(130)
    for d, w in zip(kernels.residual_layernorm_forward(*(sim.asarray(a) for a in (x, r, g, b))),
                    kernels.residual_layernorm_forward(x, r, g, b)):
        np.testing.assert_allclose(d.get(), w, rtol=1e-4, atol=5e-5)
    h, bias, dy = _f32(11, 96), _f32(96), _f32(11, 96)
    u, y = kernels.bias_gelu_forward(sim.asarray(h), sim.asarray(bias))
    ru, ry = kernels.bias_gelu_forward(h, bias)
    np.testing.assert_array_equal(u.get(), ru)
    np.testing.assert_allclose(y.get(), ry, rtol=1e-5, atol=1e-5)
    du, db = kernels.bias_gelu_backward(sim.asarray(dy), u)
    rdu, rdb = kernels.bias_gelu_backward(dy, ru)
    np.testing.assert_allclose(du.get(), rdu, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db.get(), rdb, rtol=1e-4, atol=1e-4)


def test_gpt_on_the_emulated_kernels_matches_numpy(sim):
    cfg = GPTConfig.named("tiny", seq_len=16)
    x, y = RNG.integers(0, 256, (2, 16)), RNG.integers(0, 256, (2, 16))
    host, device = GPT(cfg, seed=3), GPT(cfg, seed=3, xp=sim)
    loss, cache = host.forward(x, y)
    host.backward(cache)
    dloss, dcache = device.forward(x, y)
    device.backward(dcache)
    assert abs(float(dloss) - loss) <= 1e-5 * abs(loss)
    grad = device.flat_grad.get()
    assert np.max(np.abs(grad - host.flat_grad)) <= 1e-4 * np.max(np.abs(host.flat_grad))
