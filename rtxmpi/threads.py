"""Each rank's share of the node's cores for numpy's BLAS, set before numpy loads.

N ranks on a node that each start an all-core BLAS thread pool starve each other (5x slower
measured with 2 ranks on 2 cores). `import rtxmpi` calls `default_blas_threads()` before it imports
numpy. Standard library only: this module must not load numpy.
"""
import os
import sys

#: the count of ranks on this node that Open MPI and MPICH (Hydra) give each rank they start
#: (not Slurm's per-node counts: a batch script's own python process sees those too)
LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def default_blas_threads():
    """Unless OMP_NUM_THREADS is set, or numpy is already loaded (its BLAS pool then exists), set
    OMP_NUM_THREADS to this node's cores // ranks on this node (at least 1), the local rank count
    read from the launcher (LOCAL_SIZE_VARIABLES); without a launcher nothing changes. A malformed
    launcher value is ignored. Returns the value set, or None."""
    env = os.environ
    if "OMP_NUM_THREADS" in env or "numpy" in sys.modules:
        return None
    local = next((env[name] for name in LOCAL_SIZE_VARIABLES if name in env), "")
    if not local.isdigit() or int(local) < 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env["OMP_NUM_THREADS"] = str(max(1, (cores or 1) // int(local)))
    return env["OMP_NUM_THREADS"]
