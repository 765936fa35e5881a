"""Choosing the GPU transport, without a GPU: what init(backend=...) picks or refuses, and that
importing rtxmpi never imports cupy. The NCCL data path itself runs in bench/gpu_check.py."""
import subprocess
import sys
import types

import pytest

from rtxmpi.comm import nccl
from rtxmpi.errors import ConfigError


def test_mpi_backend_never_uses_a_device_transport():
    assert nccl.choose_transport("mpi") is None


def test_auto_on_a_cpu_machine_is_host_staging(monkeypatch):
    monkeypatch.setattr("rtxmpi.backend.gpu_count", lambda: 0)
    assert nccl.choose_transport("auto") is None


def test_nccl_without_cupy_says_how_to_install(monkeypatch):
    monkeypatch.setattr(nccl, "cupy_module", lambda: None)
    with pytest.raises(ConfigError, match=r"needs cupy and NCCL: pip install -e '\.\[cuda12\]'"):
        nccl.choose_transport("nccl")


def test_nccl_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(nccl, "cupy_module", lambda: types.SimpleNamespace())
    monkeypatch.setattr(nccl, "nccl_module", lambda: types.SimpleNamespace())
    monkeypatch.setattr("rtxmpi.backend.gpu_count", lambda: 0)
    with pytest.raises(ConfigError, match="no CUDA device"):
        nccl.choose_transport("nccl")


def test_auto_prefers_nccl_then_cuda_aware_mpi(monkeypatch):
    monkeypatch.setattr("rtxmpi.backend.gpu_count", lambda: 1)
    monkeypatch.setattr(nccl, "nccl_module", lambda: types.SimpleNamespace())
    assert nccl.choose_transport("auto") == "nccl"
    monkeypatch.setattr(nccl, "nccl_module", lambda: None)
    monkeypatch.setenv("RTXMPI_CUDA_AWARE_MPI", "1")
    assert nccl.choose_transport("auto") == "cuda-aware-mpi"
    monkeypatch.setenv("RTXMPI_CUDA_AWARE_MPI", "0")
    assert nccl.choose_transport("auto") is None


def test_ranks_agree_on_the_weakest_transport_and_all_refuse_together():
    class Comm:
        def __init__(self, table):
            self.table = table

        def allgather(self, mine):
            return self.table

    assert nccl.agree_transport(Comm([("nccl", None), ("cuda-aware-mpi", None)]), "auto") == \
        "cuda-aware-mpi"
    assert nccl.agree_transport(Comm([("nccl", None), (None, None)]), "auto") is None
    with pytest.raises(ConfigError, match=r"ranks \[1\] cannot use backend='nccl'"):
        nccl.agree_transport(Comm([("nccl", None), (None, "no CUDA device")]), "nccl")


def test_importing_rtxmpi_does_not_import_cupy():
    code = ("import sys, rtxmpi, rtxmpi.kernels, rtxmpi.topology, rtxmpi.comm.nccl; "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
