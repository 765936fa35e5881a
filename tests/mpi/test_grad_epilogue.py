"""The data-parallel epilogue (rtxmpi.kernels.grad_epilogue after the bucket all_reduces): the
average, and a non-finite flag that is the same on every rank (holds at any world size)."""
import types

import numpy as np
import pytest

from rtxmpi.parallel.data import DataParallel


class TwoParams:
    """A model stand-in: two parameters (3 and 5 elements) whose gradient is `fill(rank)`."""

    def __init__(self, fill):
        self.params = [types.SimpleNamespace(offset=0, size=3), types.SimpleNamespace(offset=3, size=5)]
        self.flat_data = np.zeros(8, np.float32)
        self.flat_grad = np.zeros(8, np.float32)
        self.fill = fill

    def forward(self, idx, targets=None):
        return 0.0, None

    def backward(self, cache, scale=1.0, grad_ready=None):
        self.flat_grad += self.fill
        for i in (1, 0):
            if grad_ready is not None:
                grad_ready(i)

    def zero_grad(self):
        self.flat_grad[...] = 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad_rank", [None, 1])
def test_epilogue_averages_and_flags_non_finite_on_every_rank(world, bad_rank):
    r, n = world.rank, world.world_size
    fill = np.full(8, r + 1, np.float32)
    if r == bad_rank:
        fill[6] = np.nan
    ddp = DataParallel(TwoParams(fill), world, bucket_bytes=12)  # two buckets
    ddp.backward(None)
    assert bool(ddp.nonfinite) == (bad_rank is not None)
    if bad_rank is None:
        expected = np.float32(sum(range(1, n + 1))) * np.float32(1.0 / n)
        assert (ddp.model.flat_grad == expected).all()
