"""init(backend="nccl") on a machine without a GPU: ConfigError on every rank, no hang."""


def test_nccl_backend_without_gpu_refuses_on_every_rank(run_mpi):
    result = run_mpi("""
import rtxmpi
from mpi4py import MPI
try:
    rtxmpi.init(backend="nccl", timeout_s=20)
    print("INIT ok", flush=True)
except rtxmpi.ConfigError as exc:
    print(f"REFUSED rank {MPI.COMM_WORLD.Get_rank()}: {exc}", flush=True)
""", n=2, outer_timeout_s=60)
    assert not result.outer_timeout, str(result)
    refused = result.lines("REFUSED")
    assert len(refused) == 2, str(result)
    assert all("cannot use backend='nccl'" in line for line in refused)
