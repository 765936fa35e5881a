"""The typed error hierarchy (docs/design.md, "Invariants"): the recovery layer decides by class."""
import pytest

import rtxmpi
from rtxmpi import errors
from rtxmpi.comm.group import validate_timeout


@pytest.mark.parametrize("cls,parents", [
    (errors.ConfigError, (errors.RtxmpiError, ValueError)),
    (errors.CollectiveError, (errors.RtxmpiError,)),
    (errors.CollectiveTimeout, (errors.CollectiveError, errors.RtxmpiError)),
    (errors.CollectiveMismatch, (errors.CollectiveError, errors.RtxmpiError)),
    (errors.RankFailure, (errors.RtxmpiError,)),
    (errors.CheckpointError, (errors.RtxmpiError,)),
])
def test_error_hierarchy(cls, parents):
    for parent in parents:
        assert issubclass(cls, parent), f"{cls.__name__} is not a {parent.__name__}"
    assert issubclass(errors.RtxmpiError, Exception)


def test_config_error_is_caught_as_value_error():
    with pytest.raises(ValueError, match="set dp=4"):
        raise errors.ConfigError("dp(2) * tp(2) = 4 != world_size(8); set dp=4")


@pytest.mark.parametrize("cls", [errors.RankFailure, errors.CheckpointError])
def test_rank_failure_and_checkpoint_error_are_not_collective_errors(cls):
    assert not issubclass(cls, errors.CollectiveError)
    assert not issubclass(cls, ValueError)


def test_timeout_and_mismatch_are_distinct():
    assert not issubclass(errors.CollectiveTimeout, errors.CollectiveMismatch)
    assert not issubclass(errors.CollectiveMismatch, errors.CollectiveTimeout)
    assert not issubclass(errors.RankFailure, errors.CollectiveTimeout)


def test_collective_timeout_carries_op_seq_group_missing_and_deadline():
    error = errors.CollectiveTimeout("all_reduce #7 timed out", op="all_reduce", seq=7,
                                     group="world/split1:0", missing=(2, 3), timeout_s=2.5)
    assert str(error) == "all_reduce #7 timed out"
    assert (error.op, error.seq, error.group, error.timeout_s) == ("all_reduce", 7,
                                                                   "world/split1:0", 2.5)
    assert error.missing == [2, 3] and isinstance(error.missing, list)


def test_collective_timeout_defaults():
    error = errors.CollectiveTimeout("late")
    assert (error.op, error.seq, error.group, error.missing, error.timeout_s) == (
        "", -1, "world", [], 0.0)


def test_rank_failure_carries_ranks_as_a_list():
    error = errors.RankFailure("rank 3 died", ranks=(3,))
    assert error.ranks == [3] and str(error) == "rank 3 died"
    assert errors.RankFailure("?").ranks == []


def test_errors_are_exported_from_the_package():
    for name in ("RtxmpiError", "ConfigError", "CollectiveError", "CollectiveTimeout",
                 "CollectiveMismatch", "RankFailure", "CheckpointError"):
        assert getattr(rtxmpi, name) is getattr(errors, name)
        assert name in rtxmpi.__all__


@pytest.mark.parametrize("value", ["soon", None, 0, -1, float("nan")])
def test_bad_timeout_is_a_config_error_naming_the_value(value):
    with pytest.raises(errors.ConfigError, match="timeout_s"):
        validate_timeout(value)


@pytest.mark.parametrize("value,expected", [(2, 2.0), ("0.5", 0.5), (300.0, 300.0)])
def test_timeout_accepts_positive_seconds(value, expected):
    assert validate_timeout(value) == expected


def _skip_if_initialized():
    if rtxmpi.is_initialized():  # init() returns the existing world without checking arguments
        pytest.skip("another test in this process initialized rtxmpi")


def test_init_refuses_unknown_backend_with_config_error():
    _skip_if_initialized()
    with pytest.raises(errors.ConfigError, match="backend must be one of"):
        rtxmpi.init(backend="gloo")
    assert not rtxmpi.is_initialized()


def test_init_refuses_bad_timeout_with_config_error():
    _skip_if_initialized()
    with pytest.raises(errors.ConfigError, match="timeout_s must be > 0"):
        rtxmpi.init(backend="mpi", timeout_s=0)
    assert not rtxmpi.is_initialized()


@pytest.mark.parametrize("value", ["-5", "abc"])
def test_init_names_a_bad_rtxmpi_timeout_s(monkeypatch, value):
    _skip_if_initialized()
    monkeypatch.setenv("RTXMPI_TIMEOUT_S", value)
    with pytest.raises(errors.ConfigError, match=f"RTXMPI_TIMEOUT_S must be .*{value}"):
        rtxmpi.init(backend="mpi")
    assert not rtxmpi.is_initialized()


def test_world_before_init_is_a_config_error():
    _skip_if_initialized()
    with pytest.raises(errors.ConfigError, match="init"):
        rtxmpi.world()
