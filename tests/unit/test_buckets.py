"""Bucket layout of data parallelism (no MPI needed)."""
from types import SimpleNamespace

import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.parallel.data import DataParallel, build_buckets


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
