"""rtxmpi.backend.env_flag: every boolean RTXMPI_* variable takes 1/true/yes/on or 0/false/no/off,
and anything else is a ConfigError naming the variable (a typo must not silently pick a side)."""
import pytest

from rtxmpi import backend
from rtxmpi.comm import nccl, shm
from rtxmpi.comm.launch import check_launch
from rtxmpi.errors import ConfigError


@pytest.mark.parametrize("text", ["1", "true", "Yes", " ON "])
def test_true_spellings(text):
    assert backend.env_flag("X", False, {"X": text}) is True


@pytest.mark.parametrize("text", ["0", "false", "No", " off "])
def test_false_spellings(text):
    assert backend.env_flag("X", True, {"X": text}) is False


@pytest.mark.parametrize("environ", [{}, {"X": ""}, {"X": "  "}])
def test_unset_or_empty_is_the_default(environ):
    assert backend.env_flag("X", True, environ) is True
    assert backend.env_flag("X", False, environ) is False


@pytest.mark.parametrize("text", ["2", "banana", "enabled", "-1"])
def test_anything_else_is_a_config_error_naming_variable_value_and_default(text):
    with pytest.raises(ConfigError, match=rf"X='{text}': use 1 \(on\) or 0 \(off, default\)"):
        backend.env_flag("X", False, {"X": text})
    with pytest.raises(ConfigError, match=r"use 1 \(on, default\) or 0 \(off\)"):
        backend.env_flag("X", True, {"X": text})


def test_the_os_environment_is_read_by_default(monkeypatch):
    monkeypatch.setenv("RTXMPI_CHECK", "2")
    with pytest.raises(ConfigError, match="RTXMPI_CHECK='2'"):
        backend.env_flag("RTXMPI_CHECK")


def test_every_boolean_variable_refuses_a_typo(monkeypatch):
    with pytest.raises(ConfigError, match="RTXMPI_HOST_MALLOC='banana'"):
        backend.tune_host_allocator({"RTXMPI_HOST_MALLOC": "banana"})
    with pytest.raises(ConfigError, match="RTXMPI_SHM_CMA='maybe'"):
        shm.ShmConfig.from_env({"RTXMPI_SHM_CMA": "maybe"})
    with pytest.raises(ConfigError, match="RTXMPI_ALLOW_SINGLETON='2'"):
        check_launch(1, {"SLURM_NTASKS": "2", "RTXMPI_ALLOW_SINGLETON": "2"})
    check_launch(1, {"SLURM_NTASKS": "2", "RTXMPI_ALLOW_SINGLETON": "yes"})  # any true spelling
    monkeypatch.setenv("RTXMPI_CUDA_AWARE_MPI", "sure")
    with pytest.raises(ConfigError, match="RTXMPI_CUDA_AWARE_MPI='sure'"):
        nccl.cuda_aware_mpi()
