"""Fixtures and helpers for tests run on every rank of an MPI job (see tests/mpi_pytest.py).

Every test here holds at any world size (1, 2, 4, ...): expected values are computed with numpy
from the world size and rank, never hard-coded. Tests that need several ranks carry
`@pytest.mark.mpi(min_size=2)`. Collect and run order is identical on every rank, so a test may
call collectives freely; a test must make the same collective calls on every rank.
"""
import os
import shutil
import tempfile
import zlib

import numpy as np
import pytest

import rtxmpi
from rtxmpi.comm import shm
from rtxmpi.data import BatchSampler


@pytest.fixture(scope="session")
def world():
    """The world ProcessGroup, in checking mode, with the suite's deadline ($RTXMPI_TIMEOUT_S)."""
    return rtxmpi.init(check=True, timeout_s=float(os.environ.get("RTXMPI_TIMEOUT_S") or 120))


@pytest.fixture
def ckpt_dir(world):
    """A fresh directory, the same path on every rank (made by rank 0, broadcast)."""
    buf = np.zeros(256, np.uint8)
    if world.rank == 0:
        path = tempfile.mkdtemp(prefix="rtxmpi-ckpt-").encode()
        buf[:len(path)] = np.frombuffer(path, np.uint8)
    world.broadcast(buf, src=0)
    path = bytes(buf).rstrip(b"\0").decode()
    yield path
    world.barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def group_with(world, **config):
    """A copy of `world` made with these shared-memory settings (ShmConfig; the defaults when
    none), checking mode off."""
    saved = shm.CONFIG
    shm.CONFIG = shm.ShmConfig(**config)
    try:
        group = world.split(0)
    finally:
        shm.CONFIG = saved
    group.check = False
    return group


@pytest.fixture(name="assert_same_on_every_rank")
def _assert_same_on_every_rank_fixture():
    """The helper `assert_same_on_every_rank(group, x)`, for test modules."""
    return assert_same_on_every_rank


@pytest.fixture(name="assert_raised_on_every_rank")
def _assert_raised_on_every_rank_fixture():
    """The helper `assert_raised_on_every_rank(group, fn, exc_type, match)`, for test modules."""
    return assert_raised_on_every_rank


def digest(x):
    """A stable hash (crc32) of an array's dtype, shape and bytes."""
    x = np.ascontiguousarray(x)
    return zlib.crc32(f"{x.dtype.str}{x.shape}".encode() + x.tobytes())


def assert_same_on_every_rank(group, x):
    """Collective: all ranks of `group` check that `x` is bitwise identical everywhere."""
    digests = group.all_gather(np.array([digest(x)], np.int64))
    assert (digests == digests[0]).all(), f"results differ across ranks: digests {digests.tolist()}"


def assert_raised_on_every_rank(group, fn, exc_type, match=None):
    """Run `fn()` on every rank of `group`; assert each rank raised `exc_type`; return the error.

    The flags are compared with one all_gather, so a rank that did not raise fails the test on
    every rank (in checking mode its stray collective shows up as a CollectiveMismatch).
    """
    error = None
    try:
        fn()
    except exc_type as exc:
        error = exc
    flags = group.all_gather(np.array([error is not None]))
    assert flags.all(), f"{exc_type.__name__} raised only on ranks {np.flatnonzero(flags).tolist()}"
    if match is not None:
        for text in match:
            assert text in str(error), f"{text!r} not in error message: {error}"
    return error


# -- the global batch that data-parallel tests compare against one process -----------------------
GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
T = 16


def global_batch(step):
    """The full (GLOBAL_BATCH, T) global batch of `step`, as one process would read it."""
    tokens = np.random.default_rng(123).integers(0, 256, 4096).astype(np.uint8)
    return BatchSampler(tokens, T, GLOBAL_BATCH, seed=7, start_sample=step * GLOBAL_BATCH).next_batch()


def local_slice(world, x):
    """This rank's rows of a global batch."""
    b = len(x) // world.world_size
    return x[world.rank * b:(world.rank + 1) * b]
