"""MPI's dynamic processes: start processes into a running job and merge them with its ranks.

Source: MPI-4.1 standard, chapter 11 (MPI_Comm_spawn, MPI_Comm_get_parent,
MPI_Intercomm_merge). rtxmpi.elastic.grow builds replacement of lost ranks on these.
"""
import sys

from mpi4py import MPI

from ..errors import SpawnFailed


def spawned():
    """True in a process started by MPI_Comm_spawn (it has a parent communicator). Local."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def spawn_merged(comm, count, argv, info=None):
    """Start `count` processes of `sys.executable argv...` and merge them after the ranks of
    `comm` (which keep their ranks). info: {key: value} MPI_Info hints read on rank 0 only.
    Returns the merged intracommunicator, errors returned rather than fatal. Collective over
    `comm`. Raises SpawnFailed when MPI_Comm_spawn fails (no free slot, program not found)."""
    mpi_info = MPI.Info.Create()
    for key, value in (info or {}).items():
        mpi_info.Set(str(key), str(value))
    try:
        inter = comm.Spawn(sys.executable, args=[str(a) for a in argv], maxprocs=count,
                           info=mpi_info, root=0)
    except MPI.Exception as exc:
        raise SpawnFailed(exc.Get_error_string().strip()) from None
    finally:
        mpi_info.Free()
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


def merge_with_parent():
    """In a spawned process: the intracommunicator of the parent's ranks followed by the spawned
    ones (errors returned). Collective over the spawned processes and the parent's
    spawn_merged."""
    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged
