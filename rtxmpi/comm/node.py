"""The MPI launch and the node seen from a communicator: COMM_WORLD, the MPI library's name, the
ranks that share this node's memory. The layers above ask here instead of importing mpi4py."""
import numpy as np
from mpi4py import MPI


def launch_comm():
    """MPI_COMM_WORLD: every process of the launch (after an elastic shrink it still holds the
    failed ones; the world group's own communicator does not)."""
    return MPI.COMM_WORLD


def library_version():
    """The first line of MPI_Get_library_version (e.g. "Open MPI v5.0.11, ..."). Local."""
    return MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip()


def node_ranks(comm):
    """(this rank's index among the ranks of `comm` on its node, how many there are, the lowest
    `comm` rank on the node). Collective over `comm` (MPI_Comm_split_type SHARED)."""
    rank = comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        lowest = np.array([rank], np.int64)
        node.Allreduce(MPI.IN_PLACE, lowest, MPI.MIN)
        return node.Get_rank(), node.Get_size(), int(lowest[0])
    finally:
        node.Free()
