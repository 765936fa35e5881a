"""Bucket layout and the bucket engine of data parallelism (no MPI needed)."""
from types import SimpleNamespace

import numpy as np
import pytest

from rtxmpi.errors import ConfigError, RtxmpiError
from rtxmpi.parallel.data import BucketReducer, DataParallel, build_buckets


def params(sizes):
    out, offset = [], 0
    for size in sizes:
        out.append(SimpleNamespace(offset=offset, size=size))
        offset += size
    return out


def test_buckets_fill_from_the_last_parameter_and_cover_everything():
    buckets = build_buckets(params([10, 20, 30, 40]), bucket_bytes=200, itemsize=4)
    assert [(b.first, b.last) for b in buckets] == [(2, 3), (0, 1)]
    assert [(b.start, b.stop) for b in buckets] == [(30, 100), (0, 30)]


def test_a_parameter_larger_than_a_bucket_gets_its_own():
    buckets = build_buckets(params([5, 1000, 5]), bucket_bytes=64, itemsize=4)
    assert [(b.first, b.last) for b in buckets] == [(1, 2), (0, 0)]


def test_one_bucket_when_everything_fits():
    buckets = build_buckets(params([3, 4, 5]), bucket_bytes=2**20, itemsize=4)
    assert [(b.first, b.last, b.start, b.stop) for b in buckets] == [(0, 2, 0, 12)]


def test_bucket_bytes_must_be_positive():
    with pytest.raises(ConfigError, match="bucket_bytes"):
        DataParallel(SimpleNamespace(), group=None, bucket_bytes=0)


class RecordingGroup:
    """A one-process stand-in for a ProcessGroup: records the all_reduce calls (bucket slice
    bounds, async or blocking) and leaves the data as it is (a sum over one rank)."""

    def __init__(self, grad):
        self.grad, self.calls = grad, []

    def all_reduce(self, view, op, async_op=False):
        start = view.__array_interface__["data"][0] - self.grad.__array_interface__["data"][0]
        self.calls.append((start // view.itemsize, "async" if async_op else "blocking", op))
        return SimpleNamespace(test=lambda: False, wait=lambda: None) if async_op else None


def reducer(block_last):
    grad = np.zeros(100, np.float32)
    buckets = build_buckets(params([10, 20, 30, 40]), bucket_bytes=200, itemsize=4)
    group = RecordingGroup(grad)
    return BucketReducer(buckets, 4, grad, group, op="sum", block_last=block_last), group


@pytest.mark.parametrize("block_last", [True, False])
def test_bucket_reducer_launches_each_bucket_once_complete(block_last):
    r, group = reducer(block_last)
    r.arm()
    for u in (3, 2):
        r.ready(u)
    assert group.calls == [(30, "async", "sum")]  # bucket (2, 3) launched as it completed
    r.ready(1)
    r.ready(0)
    r.finish()
    # the bucket completed last: blocking in finish (DataParallel) or async (the pipeline)
    assert group.calls[1] == (0, "blocking" if block_last else "async", "sum")
    assert (r.launched, r.reported) == ((1, 4) if block_last else (2, 4))


def test_bucket_reducer_refuses_a_unit_reported_after_its_bucket_launched():
    r, _ = reducer(block_last=False)
    r.arm()
    r.ready(3)
    r.ready(2)
    with pytest.raises(RtxmpiError, match="unit 2 reported ready again after its bucket 0"):
        r.ready(2)


def test_bucket_reducer_refuses_a_backward_that_missed_a_unit():
    r, group = reducer(block_last=True)
    r.arm()
    for u in (3, 2, 1):
        r.ready(u)
    with pytest.raises(RtxmpiError, match="reported 3 of 4"):
        r.finish()
    assert [c[1] for c in group.calls] == ["async"]  # nothing blocking entered before the error
    r.finish()  # unarmed (overlap off): every bucket not launched is reduced blocking
    assert [c[1] for c in group.calls] == ["async", "blocking"]
