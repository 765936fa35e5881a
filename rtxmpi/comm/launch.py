"""Checks on how the job was launched, made before any communication."""
import os

from ..backend import env_flag
from ..errors import ConfigError


def env_int(environ, *names, minimum=0):
    """The first of the variables `names` that is set and non-empty, as an int >= minimum; None
    when none is. Raises ConfigError naming the variable when its value is anything else: a
    launcher's variable that does not parse means the job is not what it seems (a silent None
    would skip the checks that rely on it)."""
    for name in names:
        value = environ.get(name)
        if value in (None, ""):
            continue
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < minimum:
            raise ConfigError(f"{name}={value!r} is not an integer >= {minimum}; the launcher sets "
                              f"it: unset it or give the value the launcher would")
        return number
    return None


def slurm_tasks(environ=os.environ):
    """Number of tasks Slurm started for this step (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS;
    None outside Slurm). Raises ConfigError for a value that is not an integer >= 1."""
    return env_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", minimum=1)


def check_launch(world_size, environ=os.environ):
    """Refuse to start when Slurm started N > 1 tasks that MPI sees as separate worlds of 1.

    `srun -n 2 python train.py` without an MPI plugin starts two singletons that each believe they
    are rank 0 of 1: they would train the same model twice and overwrite each other's files.
    An explicit launcher size of 1 (`mpiexec -n 1` inside an allocation) is allowed, and
    RTXMPI_ALLOW_SINGLETON=1 overrides the check. Raises ConfigError (also for a value of
    RTXMPI_ALLOW_SINGLETON that is not a boolean, backend.env_flag, and for SLURM_STEP_NUM_TASKS,
    SLURM_NTASKS, OMPI_COMM_WORLD_SIZE or PMI_SIZE that is not an integer >= 1). Local: init
    agrees on its errors over the ranks.
    """
    tasks = slurm_tasks(environ)
    # Only a launcher that itself says "1" makes a world of 1 deliberate: `srun --mpi=pmi2 -n 2`
    # with an MPI built without PMI-2 sets PMI_SIZE=2 yet still starts singletons.
    explicit_one = env_int(environ, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", minimum=1) == 1
    if (tasks and tasks > 1 and world_size == 1 and not explicit_one
            and not env_flag("RTXMPI_ALLOW_SINGLETON", environ=environ)):
        raise ConfigError(
            f"Slurm started {tasks} tasks but MPI sees a world of 1: the tasks were started without "
            f"an MPI launcher and cannot talk to each other. Launch with `srun --mpi=pmix -n {tasks} "
            f"python ...` or `mpiexec -n {tasks} python ...` inside the allocation "
            "(set RTXMPI_ALLOW_SINGLETON=1 to run one independent process per task on purpose)")


def slurm_env(environ=os.environ):
    """What Slurm says about this process, or None outside a Slurm job (no SLURM_JOB_ID).

    Returns a dict: job_id (str), ntasks (SLURM_NTASKS, tasks of the allocation), nnodes
    (SLURM_NNODES / SLURM_JOB_NUM_NODES), step_id (SLURM_STEP_ID, None in the batch script),
    step_tasks (SLURM_STEP_NUM_TASKS), procid, localid, nodeid (SLURM_PROCID / LOCALID / NODEID,
    ints or None), and launcher: "srun" when srun started this process as a task of a step (its
    procid/localid are then this rank's), "mpiexec" when an MPI launcher started it inside the
    allocation (OMPI_COMM_WORLD_SIZE set: the SLURM_PROCID/LOCALID it inherited are the batch
    script's or a daemon's, not the rank's), else "batch". Raises ConfigError naming the
    variable when a count or id is set but not an integer (counts >= 1, ids >= 0).
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or None
    if environ.get("OMPI_COMM_WORLD_SIZE"):
        launcher = "mpiexec"
    elif step_id is not None:
        launcher = "srun"
    else:
        launcher = "batch"
    return {"job_id": job_id, "ntasks": env_int(environ, "SLURM_NTASKS", "SLURM_NPROCS", minimum=1),
            "nnodes": env_int(environ, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", minimum=1),
            "step_id": step_id, "step_tasks": env_int(environ, "SLURM_STEP_NUM_TASKS", minimum=1),
            "procid": env_int(environ, "SLURM_PROCID"), "localid": env_int(environ, "SLURM_LOCALID"),
            "nodeid": env_int(environ, "SLURM_NODEID"), "launcher": launcher}


def check_slurm_ranks(rank, world_size, local_rank, environ=os.environ):
    """Cross-check Slurm's view of this task with MPI's, for tasks that srun started.

    Under `srun --mpi=pmix` every rank is a Slurm task, so SLURM_STEP_NUM_TASKS must equal the
    MPI world size, SLURM_PROCID the MPI rank and SLURM_LOCALID the rank among the ranks of this
    host (rtxmpi's local_rank). A mismatch means the tasks joined different MPI worlds or another
    launch mixed in (e.g. several srun steps wired into one world): files and devices chosen by
    rank would collide, so it raises ConfigError. Under mpiexec inside an allocation the SLURM_*
    task variables describe the batch script, not the rank, and only the singleton check
    (`check_launch`) applies. Returns the `slurm_env` dict (None outside Slurm). Local: no
    communication; every rank calls it (each checks its own variables).
    """
    env = slurm_env(environ)
    if env is None or env["launcher"] != "srun" or env_flag("RTXMPI_ALLOW_SINGLETON",
                                                             environ=environ):
        return env
    expected = [("SLURM_STEP_NUM_TASKS", env["step_tasks"], "MPI world_size", world_size),
                ("SLURM_PROCID", env["procid"], "MPI rank", rank),
                ("SLURM_LOCALID", env["localid"], "local_rank", local_rank)]
    wrong = [f"{name}={got} but {what} is {want}" for name, got, what, want in expected
             if got is not None and got != want]
    if wrong:
        raise ConfigError(
            f"Slurm job {env['job_id']} step {env['step_id']}: {'; '.join(wrong)} (rank {rank}): the "
            "srun tasks do not form one MPI world in task order. Launch one step with "
            "`srun --mpi=pmix -n N python ...` (docs/elastic.md, Slurm)")
    return env


def slurm_summary(envs, world_size, hosts):
    """Lines for `rtxmpi info`: the Slurm job as each rank sees it, checked against MPI.

    envs: `slurm_env()` of every rank, in rank order (None entries outside Slurm); world_size and
    hosts (the distinct host names of the MPI ranks) as MPI sees them. Returns [] outside Slurm.
    """
    envs = list(envs)
    env = next((e for e in envs if e), None)
    if env is None:
        return []
    jobs = sorted({e["job_id"] for e in envs if e})
    lines = [f"job {', '.join(jobs)}: {env['ntasks']} tasks on {env['nnodes']} node(s); "
             f"ranks started by {env['launcher']}"
             + (f" (step {env['step_id']}, {env['step_tasks']} tasks)" if env["launcher"] == "srun"
                else "")]
    if len(jobs) > 1:
        lines.append("MISMATCH: the ranks belong to different Slurm jobs")
    if any(e is None for e in envs):
        lines.append("MISMATCH: some ranks run outside the Slurm job")
    if env["launcher"] == "srun":
        bad = [r for r, e in enumerate(envs) if e and (e["procid"] != r or e["step_tasks"] != world_size)]
        lines.append("SLURM_PROCID == rank and SLURM_STEP_NUM_TASKS == world_size on every rank"
                     if not bad else f"MISMATCH: SLURM_PROCID/STEP_NUM_TASKS disagree with MPI on "
                                     f"rank(s) {bad}")
    elif env["ntasks"] is not None and world_size > env["ntasks"]:
        lines.append(f"note: {world_size} ranks in an allocation of {env['ntasks']} tasks "
                     "(oversubscribed)")
    elif env["ntasks"] is not None and world_size < env["ntasks"]:
        lines.append(f"note: {world_size} ranks use {world_size} of the {env['ntasks']} tasks")
    if env["nnodes"] is not None and len(hosts) != env["nnodes"]:
        lines.append(f"note: ranks run on {len(hosts)} host(s) of the {env['nnodes']} node(s) "
                     "allocated")
    return lines
