"""rtxmpi: a distributed-training runtime launched with mpiexec or srun."""
from .spawn_deadline import arm as _arm_spawn_deadline
from .threads import default_blas_threads

default_blas_threads()  # before numpy loads: each rank its share of the node's cores
_arm_spawn_deadline()  # before MPI_Init: a spawned process must not block in it for good

from .comm import ProcessGroup, Work, init, is_initialized, shared_zeros, world  # noqa: E402
from .errors import (CheckpointError, CollectiveError, CollectiveMismatch,  # noqa: E402
                     CollectiveTimeout, ConfigError, RankFailure, RtxmpiError)

__version__ = "0.1.0"

__all__ = ["init", "world", "is_initialized", "ProcessGroup", "Work", "shared_zeros", "RtxmpiError",
           "ConfigError",
           "CollectiveError", "CollectiveTimeout", "CollectiveMismatch", "RankFailure",
           "CheckpointError", "__version__"]
