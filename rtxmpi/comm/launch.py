"""Checks on how the job was launched, made before any communication."""
import os

from ..errors import ConfigError


def slurm_tasks(environ=os.environ):
    """Number of tasks Slurm started for this step (None outside Slurm)."""
    value = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    try:
        return int(value) if value else None
    except ValueError:
        return None


def check_launch(world_size, environ=os.environ):
    """Refuse to start when Slurm started N > 1 tasks that MPI sees as separate worlds of 1.

    `srun -n 2 python train.py` without an MPI plugin starts two singletons that each believe they
    are rank 0 of 1: they would train the same model twice and overwrite each other's files.
    An explicit launcher size of 1 (`mpiexec -n 1` inside an allocation) is allowed, and
    RTXMPI_ALLOW_SINGLETON=1 overrides the check. Raises ConfigError.
    """
    tasks = slurm_tasks(environ)
    # Only a launcher that itself says "1" makes a world of 1 deliberate: `srun --mpi=pmi2 -n 2`
    # with an MPI built without PMI-2 sets PMI_SIZE=2 yet still starts singletons.
    launcher_size = environ.get("OMPI_COMM_WORLD_SIZE") or environ.get("PMI_SIZE")
    explicit_one = launcher_size is not None and launcher_size.strip() == "1"
    if (tasks and tasks > 1 and world_size == 1 and not explicit_one
            and environ.get("RTXMPI_ALLOW_SINGLETON") != "1"):
        raise ConfigError(
            f"Slurm started {tasks} tasks but MPI sees a world of 1: the tasks were started without "
            f"an MPI launcher and cannot talk to each other. Launch with `srun --mpi=pmix -n {tasks} "
            f"python ...` or `mpiexec -n {tasks} python ...` inside the allocation "
            "(set RTXMPI_ALLOW_SINGLETON=1 to run one independent process per task on purpose)")
