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


class _Comm:
    """allgather answers a fixed table of (transport, without NCCL, error, device) rows."""

    def __init__(self, table, rank=0):
        self.table, self.rank = table, rank

    def allgather(self, mine):
        return self.table

    def Get_rank(self):
        return self.rank


def test_ranks_agree_on_the_weakest_transport_and_all_refuse_together():
    assert nccl.agree_transport(_Comm([("nccl", None, None, None),
                                       ("cuda-aware-mpi", None, None, None)]), "auto") == \
        "cuda-aware-mpi"
    assert nccl.agree_transport(_Comm([("nccl", None, None, None), (None, None, None, None)]),
                                "auto") is None
    with pytest.raises(ConfigError, match=r"ranks \[1\] cannot use backend='nccl'"):
        nccl.agree_transport(_Comm([("nccl", None, None, None), (None, None, "no CUDA device", None)]),
                             "nccl")


def test_ranks_sharing_a_gpu_never_get_nccl(capsys):
    gpu0, gpu1 = ("node1", "0000:19:00.0"), ("node1", "0000:3b:00.0")
    # one GPU per rank: NCCL
    rows = [("nccl", "cuda-aware-mpi", None, gpu0), ("nccl", "cuda-aware-mpi", None, gpu1)]
    assert nccl.agree_transport(_Comm(rows), "auto") == "nccl"
    # ranks 1 and 2 on one GPU: auto takes the best transport without NCCL, and says why once
    rows = [("nccl", "cuda-aware-mpi", None, gpu0), ("nccl", "cuda-aware-mpi", None, gpu1),
            ("nccl", "cuda-aware-mpi", None, gpu1)]
    assert nccl.agree_transport(_Comm(rows), "auto") == "cuda-aware-mpi"
    assert "ranks [1, 2] share the GPU 0000:3b:00.0 on node1" in capsys.readouterr().err
    assert nccl.agree_transport(_Comm(rows, rank=1), "auto") == "cuda-aware-mpi"
    assert capsys.readouterr().err == ""
    rows = [(r[0], None, None, r[3]) for r in rows]
    assert nccl.agree_transport(_Comm(rows), "auto") is None
    # backend="nccl" refuses on every rank, naming them
    for rank in (0, 1, 2):
        with pytest.raises(ConfigError, match=r"ranks \[1, 2\] share the GPU .* one GPU per rank"):
            nccl.agree_transport(_Comm(rows, rank=rank), "nccl")
    # the same bus id on two hosts is two GPUs
    rows = [("nccl", None, None, ("a", "0000:19:00.0")), ("nccl", None, None, ("b", "0000:19:00.0"))]
    assert nccl.agree_transport(_Comm(rows), "nccl") == "nccl"


def test_device_identity_is_the_bound_gpus_bus_id(monkeypatch):
    from rtxmpi import backend

    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    assert backend.device_identity(3) is None
    buses = ["0000:19:00.0", "0000:3b:00.0"]
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda i: types.SimpleNamespace(pci_bus_id=buses[i])))
    monkeypatch.setattr(backend, "gpu_count", lambda: 2)
    monkeypatch.setattr(backend, "cupy_module", lambda: fake)
    assert [backend.device_identity(r)[1] for r in range(4)] == buses * 2


def test_importing_rtxmpi_does_not_import_cupy():
    code = ("import sys, rtxmpi, rtxmpi.kernels, rtxmpi.topology, rtxmpi.comm.nccl; "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
