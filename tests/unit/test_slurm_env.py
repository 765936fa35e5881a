"""SLURM_* variables: parsed (slurm_env), checked against MPI for srun tasks (check_slurm_ranks),
summarised for `rtxmpi info` (slurm_summary). Variable sets as Slurm 22.05 sets them here."""
import re

import pytest

from rtxmpi.comm.launch import check_slurm_ranks, slurm_env, slurm_summary
from rtxmpi.errors import ConfigError

JOB = {"SLURM_JOB_ID": "41", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2"}
BATCH = {**JOB, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}


def srun_task(procid, localid, tasks=4, **extra):
    return {**JOB, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": "0",
            "PMIX_RANK": str(procid), **extra}


def test_outside_slurm_there_is_nothing():
    assert slurm_env({}) is None
    assert check_slurm_ranks(0, 1, 0, {}) is None
    assert slurm_summary([None, None], 2, ["a"]) == []


def test_batch_script_variables():
    env = slurm_env(BATCH)
    assert env == {"job_id": "41", "ntasks": 4, "nnodes": 2, "step_id": None, "step_tasks": None,
                   "procid": 0, "localid": 0, "nodeid": 0, "launcher": "batch"}


def test_mpiexec_rank_inherits_the_batch_scripts_task_variables_and_is_not_checked():
    environ = {**BATCH, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"}
    assert slurm_env(environ)["launcher"] == "mpiexec"
    assert check_slurm_ranks(3, 4, 3, environ)["procid"] == 0  # SLURM_PROCID=0 is not rank 3: fine


def test_mpiexec_across_nodes_daemons_started_by_srun_are_still_mpiexec():
    environ = {**srun_task(1, 0, tasks=2), "OMPI_COMM_WORLD_SIZE": "4"}
    assert slurm_env(environ)["launcher"] == "mpiexec"
    check_slurm_ranks(3, 4, 1, environ)


@pytest.mark.parametrize("rank,local", [(0, 0), (1, 1), (2, 0), (3, 1)])
def test_srun_tasks_matching_mpi_pass(rank, local):
    env = check_slurm_ranks(rank, 4, local, srun_task(rank, local))
    assert env["launcher"] == "srun" and env["step_id"] == "0" and env["step_tasks"] == 4


def test_srun_step_size_differs_from_mpi_world():
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NUM_TASKS=4 but MPI world_size is 2"):
        check_slurm_ranks(1, 2, 1, srun_task(1, 1))


def test_srun_task_with_another_mpi_rank():
    with pytest.raises(ConfigError) as info:
        check_slurm_ranks(0, 4, 0, srun_task(2, 0))
    assert "SLURM_PROCID=2 but MPI rank is 0" in str(info.value)
    assert "srun --mpi=pmix -n N" in str(info.value) and "job 41 step 0" in str(info.value)


def test_srun_localid_differs_from_local_rank():
    with pytest.raises(ConfigError, match="SLURM_LOCALID=1 but local_rank is 0"):
        check_slurm_ranks(1, 4, 0, srun_task(1, 1))


def test_allow_singleton_skips_the_cross_check():
    check_slurm_ranks(0, 1, 0, {**srun_task(1, 1), "RTXMPI_ALLOW_SINGLETON": "1"})


def test_empty_values_are_unknown():
    env = slurm_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "", "SLURM_PROCID": ""})
    assert env["ntasks"] is None and env["procid"] is None and env["launcher"] == "batch"


@pytest.mark.parametrize("variable, value", [("SLURM_NTASKS", "four"), ("SLURM_NNODES", "0"),
                                             ("SLURM_PROCID", "?"), ("SLURM_LOCALID", "-1"),
                                             ("SLURM_NODEID", "1e3")])
def test_a_malformed_value_is_a_config_error_naming_the_variable(variable, value):
    environ = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", variable: value}
    with pytest.raises(ConfigError, match=re.escape(f"{variable}={value!r} is not an integer")):
        slurm_env(environ)
    with pytest.raises(ConfigError, match=re.escape(f"{variable}={value!r}")):
        check_slurm_ranks(5, 8, 1, environ)


def test_summary_for_srun_and_mismatches():
    envs = [slurm_env(srun_task(r, r % 2)) for r in range(4)]
    lines = slurm_summary(envs, 4, ["n1", "n2"])
    assert lines[0] == "job 41: 4 tasks on 2 node(s); ranks started by srun (step 0, 4 tasks)"
    assert lines[1] == "SLURM_PROCID == rank and SLURM_STEP_NUM_TASKS == world_size on every rank"
    assert len(lines) == 2
    swapped = envs[:2] + [envs[3], envs[2]]
    assert "MISMATCH" in slurm_summary(swapped, 4, ["n1", "n2"])[1]


def test_summary_for_mpiexec_notes_unused_tasks_and_nodes():
    env = slurm_env({**BATCH, "OMPI_COMM_WORLD_SIZE": "2"})
    lines = slurm_summary([env, env], 2, ["n1"])
    assert lines == ["job 41: 4 tasks on 2 node(s); ranks started by mpiexec",
                     "note: 2 ranks use 2 of the 4 tasks",
                     "note: ranks run on 1 host(s) of the 2 node(s) allocated"]
    assert "MISMATCH: some ranks run outside" in "\n".join(slurm_summary([env, None], 2, ["n1", "n2"]))
