"""check_launch: refuse a Slurm step whose N > 1 tasks each became an MPI world of 1."""
import pytest

from rtxmpi.comm.launch import check_launch, slurm_tasks
from rtxmpi.errors import ConfigError


@pytest.mark.parametrize("environ,expected", [
    ({}, None),
    ({"SLURM_NTASKS": "4"}, 4),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8"}, 2),
    ({"SLURM_NTASKS": ""}, None),
])
def test_slurm_tasks_reads_the_step_size_first(environ, expected):
    assert slurm_tasks(environ) == expected


def test_outside_slurm_a_singleton_starts():
    check_launch(1, {})


def test_slurm_tasks_without_mpi_launcher_are_refused_with_launch_advice():
    with pytest.raises(ConfigError) as info:
        check_launch(1, {"SLURM_NTASKS": "2"})
    message = str(info.value)
    assert "Slurm started 2 tasks but MPI sees a world of 1" in message
    assert "srun --mpi=pmix -n 2" in message and "mpiexec -n 2" in message
    assert "RTXMPI_ALLOW_SINGLETON=1" in message


def test_step_size_from_srun_is_refused_too():
    with pytest.raises(ConfigError, match="Slurm started 4 tasks"):
        check_launch(1, {"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"})


def test_refusal_is_a_value_error_for_callers_that_catch_bad_input():
    with pytest.raises(ValueError):
        check_launch(1, {"SLURM_NTASKS": "3"})


@pytest.mark.parametrize("world_size", [2, 4])
def test_mpi_world_matching_the_slurm_tasks_starts(world_size):
    check_launch(world_size, {"SLURM_NTASKS": str(world_size),
                              "SLURM_STEP_NUM_TASKS": str(world_size)})


def test_mpiexec_smaller_than_the_allocation_starts():
    check_launch(2, {"SLURM_NTASKS": "8", "OMPI_COMM_WORLD_SIZE": "2"})


def test_one_task_allocation_starts_a_singleton():
    check_launch(1, {"SLURM_NTASKS": "1"})


def test_srun_one_task_step_inside_a_larger_allocation_starts():
    check_launch(1, {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1"})


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_launcher_that_says_one_rank_makes_a_singleton_deliberate(variable):
    check_launch(1, {"SLURM_NTASKS": "4", variable: "1"})


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_launcher_that_says_several_ranks_but_mpi_sees_one_is_refused(variable):
    # e.g. `srun --mpi=pmi2 -n 2` with an MPI built without PMI-2: PMI_SIZE=2, two singletons
    with pytest.raises(ConfigError, match="Slurm started 2 tasks"):
        check_launch(1, {"SLURM_NTASKS": "2", variable: "2"})


def test_allow_singleton_overrides_the_check():
    check_launch(1, {"SLURM_NTASKS": "2", "RTXMPI_ALLOW_SINGLETON": "1"})


def test_allow_singleton_other_than_one_does_not_override():
    with pytest.raises(ConfigError):
        check_launch(1, {"SLURM_NTASKS": "2", "RTXMPI_ALLOW_SINGLETON": "0"})


@pytest.mark.parametrize("variable, value", [
    ("SLURM_NTASKS", "four"), ("SLURM_NTASKS", "0"), ("SLURM_STEP_NUM_TASKS", "2.0"),
    ("OMPI_COMM_WORLD_SIZE", "one"), ("PMI_SIZE", "-1")])
def test_a_malformed_task_count_is_a_config_error_naming_the_variable(variable, value):
    with pytest.raises(ConfigError, match=f"{variable}={value!r} is not an integer >= 1"):
        check_launch(2, {variable: value})
