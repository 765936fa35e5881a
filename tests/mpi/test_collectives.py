"""Collectives on the world group against numpy references, at any world size.

Inputs differ per rank (seeded by rank) and are integer-valued, so every reduction is exact and a
wrong reduction, a wrong order or a missing rank changes the answer. Each rank computes the
expected value from every rank's inputs with numpy. Prod inputs stay in {-1, 1, 2} (unsigned
{1, 2}), so no dtype overflows at the sizes the suite runs (1, 2, 4).
"""
import re
import tempfile
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import rtxmpi
from rtxmpi import CollectiveMismatch

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool", "bfloat16"]
INTEGER_OR_BOOL = ["int8", "int32", "int64", "uint8", "bool"]
OPS = ["sum", "avg", "max", "min", "prod"]
REDUCE_CASES = [(op, d) for op in OPS for d in DTYPES if not (op == "avg" and d in INTEGER_OR_BOOL)]
COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"]


def as_dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def rank_values(rank, shape, dtype, op="sum", salt=0):
    """Integer-valued inputs of `rank`, different on every rank; exact under every op."""
    dtype = as_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    rng = np.random.default_rng([rank, salt, 20261129])
    if dtype == np.bool_:
        return rng.random(shape) < 0.4
    if op == "prod":
        values = rng.choice([1, 2] if dtype.kind == "u" else [-1, 1, 2], size=shape)
    else:
        low = 0 if dtype.kind == "u" else -20
        values = rng.integers(low, low + 41, size=shape)
    return values.astype(dtype)


def reduce_reference(inputs, op):
    """What all_reduce(op) must give for `inputs` (one array per rank), in their dtype."""
    dtype = inputs[0].dtype
    stack = np.stack(inputs)
    if dtype == np.bool_:  # sum and max are logical or; min and prod logical and
        return stack.any(axis=0) if op in ("sum", "max") else stack.all(axis=0)
    acc = np.dtype(np.float32) if dtype in (np.dtype(np.float16), BFLOAT16) else dtype
    stack = stack.astype(acc)
    if op in ("sum", "avg"):
        result = stack.sum(axis=0, dtype=acc)
        if op == "avg":
            result = (result / np.asarray(len(inputs), acc)).astype(acc)
    elif op == "prod":
        result = stack.prod(axis=0, dtype=acc)
    elif op == "max":
        result = stack.max(axis=0)
    else:
        result = stack.min(axis=0)
    return result.astype(dtype)


def assert_exact(actual, expected):
    """Same dtype, shape and values (bool results must hold only 0 and 1)."""
    assert isinstance(actual, np.ndarray), type(actual)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if actual.dtype == np.bool_:
        assert (np.ascontiguousarray(actual).view(np.uint8) <= 1).all(), "bool holds bytes > 1"
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_array_equal(actual.astype(np.float64), expected.astype(np.float64))


def all_ranks(world, fn):
    """[fn(r) for every rank r] — the per-rank inputs every rank can recompute."""
    return [fn(r) for r in range(world.world_size)]


# -- all_reduce ---------------------------------------------------------------------------------
@pytest.mark.parametrize("op,dtype", REDUCE_CASES)
def test_all_reduce_matches_numpy_in_place(world, assert_same_on_every_rank, op, dtype):
    x = rank_values(world.rank, (3, 7), dtype, op)
    expected = reduce_reference(all_ranks(world, lambda r: rank_values(r, (3, 7), dtype, op)), op)
    out = world.all_reduce(x, op)
    assert_same_on_every_rank(world, out)
    assert out is x
    assert_exact(out, expected)


@pytest.fixture(scope="module")
def unchecked(world):
    """A copy of the world group with checking off: blocking all_reduce takes its fast path."""
    group = world.split(0)
    group.check = False
    return group


@pytest.mark.parametrize("op,dtype", REDUCE_CASES)
@pytest.mark.parametrize("shape", [(3, 7), (0,), ()])
def test_all_reduce_unchecked_matches_numpy_in_place(unchecked, op, dtype, shape):
    x = np.array(rank_values(unchecked.rank, shape, dtype, op))  # np.array: 0-d stays an array
    expected = reduce_reference(
        all_ranks(unchecked, lambda r: np.array(rank_values(r, shape, dtype, op))), op)
    out = unchecked.all_reduce(x, op)
    assert out is x
    assert_exact(out, expected)


@pytest.mark.parametrize("length", [1, 7, 1001])
@pytest.mark.parametrize("op,dtype", [("sum", "float32"), ("max", "int64"), ("avg", "float16"),
                                      ("prod", "bfloat16"), ("sum", "bool")])
def test_all_reduce_odd_lengths(world, assert_same_on_every_rank, length, op, dtype):
    x = rank_values(world.rank, (length,), dtype, op)
    expected = reduce_reference(all_ranks(world, lambda r: rank_values(r, (length,), dtype, op)), op)
    world.all_reduce(x, op)
    assert_same_on_every_rank(world, x)
    assert_exact(x, expected)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(0,), (1, 0, 2)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "bool"])
def test_all_reduce_empty_array_returns_empty(world, shape, dtype, op):
    if op == "avg" and dtype in INTEGER_OR_BOOL:
        pytest.skip("avg needs a floating dtype")
    x = np.zeros(shape, as_dtype(dtype))
    out = world.all_reduce(x, op)
    assert out is x
    assert out.shape == shape and out.dtype == as_dtype(dtype)


def test_all_reduce_zero_dim_array(world):
    x = np.array(world.rank + 1, np.int64)
    out = world.all_reduce(x)
    assert out is x and out.shape == ()
    assert int(out) == sum(r + 1 for r in range(world.world_size))


VIEWS = {  # name: (shape of the base array, the view taken of it)
    "every_other": ((15,), lambda b: b[::2]),
    "reversed": ((9,), lambda b: b[::-1]),
    "column": ((5, 6), lambda b: b[:, 2]),
    "transposed": ((4, 6), lambda b: b.T),
    "transposed_slice": ((5, 6), lambda b: b[1:, ::2].T),
    "block": ((6, 7), lambda b: b[1:5:2, 2:6]),
}


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "bool"])
def test_all_reduce_strided_view_writes_back_and_leaves_base_untouched(
        world, assert_same_on_every_rank, view, dtype):
    base_shape, take = VIEWS[view]
    base = rank_values(world.rank, base_shape, dtype)
    original = base.copy()
    x = take(base)
    assert not x.flags.c_contiguous
    expected = reduce_reference(
        all_ranks(world, lambda r: take(rank_values(r, base_shape, dtype))), "sum")
    out = world.all_reduce(x)
    assert out is x
    assert_exact(x, expected)
    assert_same_on_every_rank(world, x)
    outside = np.ones(base_shape, bool)
    take(outside)[...] = False
    assert_exact(base[outside], original[outside])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_all_reduce_low_precision_half_values_are_exact(world, dtype, op):
    x = np.full(1001, world.rank + 0.5, as_dtype(dtype))
    world.all_reduce(x, op)
    total = sum(r + 0.5 for r in range(world.world_size))
    expected = total / world.world_size if op == "avg" else total
    assert (x.astype(np.float64) == expected).all(), (x[:4], expected)


def test_all_reduce_bool_sum_is_logical_or(world):
    x = np.zeros(world.world_size + 1, bool)
    x[world.rank] = True
    world.all_reduce(x, "sum")
    assert_exact(x, np.arange(world.world_size + 1) < world.world_size)


@pytest.mark.parametrize("op", ["min", "prod"])
def test_all_reduce_bool_min_and_prod_are_logical_and(world, op):
    x = np.ones(world.world_size + 1, bool)
    x[world.rank] = False
    world.all_reduce(x, op)
    assert_exact(x, np.arange(world.world_size + 1) >= world.world_size)


@pytest.mark.parametrize("dtype", INTEGER_OR_BOOL)
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_avg_on_integer_or_bool_raises_type_error_on_every_rank(
        world, assert_raised_on_every_rank, collective, dtype):
    x = np.ones(world.world_size * 2, as_dtype(dtype))
    before = x.copy()
    assert_raised_on_every_rank(world, lambda: getattr(world, collective)(x, "avg"), TypeError,
                                match=["avg", dtype])
    assert_exact(x, before)


def test_all_reduce_unknown_op_raises_value_error_on_every_rank(world, assert_raised_on_every_rank):
    assert_raised_on_every_rank(world, lambda: world.all_reduce(np.ones(3), "mean"), ValueError,
                                match=["'mean'"])


def test_all_reduce_read_only_array_raises_value_error_on_every_rank(
        world, assert_raised_on_every_rank):
    x = np.ones(3)
    x.flags.writeable = False
    assert_raised_on_every_rank(world, lambda: world.all_reduce(x), ValueError, match=["read-only"])


@pytest.mark.parametrize("dtype", ["complex64", "object", "int16", "float128"])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_unsupported_dtype_raises_type_error_naming_dtype_and_backend(
        world, assert_raised_on_every_rank, collective, dtype):
    if dtype == "float128" and not hasattr(np, "float128"):
        pytest.skip(f"numpy has no {dtype} here")
    x = np.zeros(world.world_size * 2, dtype)
    error = assert_raised_on_every_rank(world, lambda: getattr(world, collective)(x), TypeError,
                                        match=[dtype, "mpi backend"])
    assert collective in str(error)


def test_non_array_input_raises_type_error(world, assert_raised_on_every_rank):
    assert_raised_on_every_rank(world, lambda: world.all_reduce([1.0, 2.0]), TypeError,
                                match=["list"])


# -- reduce_scatter -------------------------------------------------------------------------------
@pytest.mark.parametrize("op,dtype", REDUCE_CASES)
def test_reduce_scatter_returns_this_ranks_shard_of_the_reduction(
        world, assert_same_on_every_rank, op, dtype):
    n, rank = world.world_size, world.rank
    shape = (3 * n, 2)
    x = rank_values(rank, shape, dtype, op)
    before = x.copy()
    full = reduce_reference(all_ranks(world, lambda r: rank_values(r, shape, dtype, op)), op)
    out = world.reduce_scatter(x, op)
    assert_exact(out, full[3 * rank:3 * (rank + 1)])
    assert_exact(x, before)  # the input is read only
    gathered = world.all_gather(out)
    assert_same_on_every_rank(world, gathered)
    assert_exact(gathered, full)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bool"])
def test_reduce_scatter_strided_input(world, dtype):
    n, rank = world.world_size, world.rank
    take = lambda b: b[::2, 1]  # noqa: E731  (rows 0, 2, 4, ... of column 1)
    base_shape = (4 * n, 3)
    x = take(rank_values(rank, base_shape, dtype))
    full = reduce_reference(all_ranks(world, lambda r: take(rank_values(r, base_shape, dtype))),
                            "sum")
    out = world.reduce_scatter(x)
    assert_exact(out, full[2 * rank:2 * (rank + 1)])


@pytest.mark.parametrize("shape_of", [lambda n: (0,), lambda n: (0, 3), lambda n: (n, 0, 2)],
                         ids=["(0,)", "(0,3)", "(n,0,2)"])
def test_reduce_scatter_empty_returns_empty_shard(world, shape_of):
    shape = shape_of(world.world_size)
    out = world.reduce_scatter(np.zeros(shape, np.float32))
    assert out.shape == (shape[0] // world.world_size,) + shape[1:]
    assert out.dtype == np.float32


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("extra_rows", [1, -1])
def test_dim0_not_divisible_raises_value_error_on_every_rank(
        world, assert_raised_on_every_rank, collective, extra_rows):
    rows = 2 * world.world_size + extra_rows
    x = np.ones((rows, 3), np.float32)
    assert_raised_on_every_rank(world, lambda: getattr(world, collective)(x), ValueError,
                                match=[collective, f"({rows}, 3)", "divisible",
                                       str(world.world_size)])


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_to_all"])
def test_zero_dim_input_to_sharding_collective_raises_value_error(
        world, assert_raised_on_every_rank, collective):
    assert_raised_on_every_rank(world, lambda: getattr(world, collective)(np.array(1.0)),
                                ValueError, match=["divisible"])


def uneven_counts(n, pattern):
    """world_size counts for reduce_scatter(counts=): uneven, with zeros, at any world size."""
    return {"zeros_between": [(r % 3) * 2 if r % 2 == 0 else 0 for r in range(n)],
            "ramp": [r + 1 for r in range(n)],
            "one_owner": [5 if r == n - 1 else 0 for r in range(n)],
            "all_zero": [0] * n}[pattern]


@pytest.mark.parametrize("pattern", ["zeros_between", "ramp", "one_owner", "all_zero"])
@pytest.mark.parametrize("op,dtype", [("sum", "float32"), ("avg", "float64"), ("max", "int32"),
                                      ("prod", "int8"), ("sum", "float16"), ("avg", "bfloat16"),
                                      ("sum", "bool"), ("min", "bool"), ("min", "uint8")])
def test_reduce_scatter_uneven_counts_returns_this_ranks_rows(world, op, dtype, pattern):
    n, rank = world.world_size, world.rank
    counts = uneven_counts(n, pattern)
    shape = (sum(counts), 3)
    x = rank_values(rank, shape, dtype, op)
    before = x.copy()
    full = reduce_reference(all_ranks(world, lambda r: rank_values(r, shape, dtype, op)), op)
    out = world.reduce_scatter(x, op, counts=counts)
    lo = sum(counts[:rank])
    assert_exact(out, full[lo:lo + counts[rank]])
    assert_exact(x, before)  # the input is read only
    # every rank got its own piece of the same reduction
    crc = lambda a: zlib.crc32(np.ascontiguousarray(a).tobytes())  # noqa: E731
    seen = world.all_gather(np.array([crc(out)], np.int64))
    assert seen.tolist() == all_ranks(world, lambda r: crc(full[sum(counts[:r]):sum(counts[:r + 1])]))


def test_reduce_scatter_uneven_counts_strided_and_numpy_ints(world):
    n, rank = world.world_size, world.rank
    counts = np.array(uneven_counts(n, "ramp"), np.int64)  # numpy ints are accepted
    base_shape = (2 * int(counts.sum()), 3)
    take = lambda b: b[::2, 1:]  # noqa: E731
    x = take(rank_values(rank, base_shape, "float32"))
    full = reduce_reference(all_ranks(world, lambda r: take(rank_values(r, base_shape,
                                                                        "float32"))), "sum")
    out = world.reduce_scatter(x, counts=counts)
    lo = int(counts[:rank].sum())
    assert_exact(out, full[lo:lo + counts[rank]])


@pytest.mark.parametrize("pattern", ["zeros_between", "ramp", "one_owner"])
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("bfloat16", "avg"), ("bool", "sum")])
def test_reduce_scatter_uneven_counts_async_matches_blocking(world, pattern, dtype, op):
    counts = uneven_counts(world.world_size, pattern)
    make = lambda: rank_values(world.rank, (sum(counts), 2), dtype, op)  # noqa: E731
    expected = world.reduce_scatter(make(), op, counts=counts)
    work = world.reduce_scatter(make(), op, counts=counts, async_op=True)
    assert isinstance(work, rtxmpi.Work)
    junk = [np.full(64, -1e9) for _ in range(10)]  # would reuse a freed temporary input
    assert_exact(work.wait(), expected)
    del junk


def test_reduce_scatter_even_counts_match_the_even_path(world):
    n = world.world_size
    x = rank_values(world.rank, (3 * n, 2), "float32")
    assert_exact(world.reduce_scatter(x, counts=[3] * n), world.reduce_scatter(x))


@pytest.mark.parametrize("bad", ["too_short", "too_long", "negative", "wrong_sum", "floats",
                                 "not_a_sequence"])
def test_reduce_scatter_bad_counts_raise_value_error_on_every_rank(
        world, assert_raised_on_every_rank, bad):
    n = world.world_size
    counts = {"too_short": [2] * (n - 1), "too_long": [2] * (n + 1),
              "negative": [4] + [-2] + [2] * (n - 2) if n > 1 else [-2],
              "wrong_sum": [2] * (n - 1) + [3], "floats": [2.0] * n, "not_a_sequence": 2}[bad]
    x = np.ones((2 * n, 3), np.float32)
    before = x.copy()
    assert_raised_on_every_rank(world, lambda: world.reduce_scatter(x, counts=counts), ValueError,
                                match=["reduce_scatter", "counts"])
    assert_exact(x, before)
    assert_exact(world.reduce_scatter(x, counts=[2] * n), np.full((2, 3), n, np.float32))


def test_reduce_scatter_counts_on_zero_dim_input_raise_value_error(
        world, assert_raised_on_every_rank):
    assert_raised_on_every_rank(
        world, lambda: world.reduce_scatter(np.array(1.0), counts=[0] * world.world_size),
        ValueError, match=["0-d"])


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_mismatched_counts_raise_collective_mismatch_on_every_rank(
        world, assert_raised_on_every_rank):
    n = world.world_size
    counts = [2] * n
    if world.rank == 1:  # same sum, different split: the data alone would not notice
        counts[0], counts[1] = 3, 1
    x = np.ones((2 * n, 3), np.float32)
    error = assert_raised_on_every_rank(world, lambda: world.reduce_scatter(x, counts=counts),
                                        CollectiveMismatch, match=["reduce_scatter", "counts"])
    assert "rank 1: reduce_scatter(" in str(error)
    # the group stays usable
    assert_exact(world.reduce_scatter(x, counts=[2] * n), np.full((2, 3), n, np.float32))


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_counts_against_even_call_raise_collective_mismatch(
        world, assert_raised_on_every_rank):
    n = world.world_size
    x = np.ones((2 * n, 3), np.float32)
    call = ((lambda: world.reduce_scatter(x, counts=[2] * n)) if world.rank == 0
            else (lambda: world.reduce_scatter(x)))
    error = assert_raised_on_every_rank(world, call, CollectiveMismatch)
    assert "counts=None" in str(error) and "counts crc32=" in str(error)


# -- all_gather -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_concatenates_in_rank_order(world, assert_same_on_every_rank, dtype):
    x = rank_values(world.rank, (2, 3), dtype)
    out = world.all_gather(x)
    assert_same_on_every_rank(world, out)
    assert_exact(out, np.concatenate(all_ranks(world, lambda r: rank_values(r, (2, 3), dtype))))


@pytest.mark.parametrize("length", [1, 7, 1001])
def test_all_gather_odd_lengths(world, length):
    out = world.all_gather(rank_values(world.rank, (length,), "float16"))
    assert_exact(out, np.concatenate(all_ranks(world, lambda r: rank_values(r, (length,),
                                                                            "float16"))))


def test_all_gather_zero_dim_gives_one_entry_per_rank(world):
    out = world.all_gather(np.array(10 * world.rank + 1, np.int32))
    assert_exact(out, 10 * np.arange(world.world_size, dtype=np.int32) + 1)


@pytest.mark.parametrize("view", ["every_other", "transposed", "block"])
def test_all_gather_strided_input(world, view):
    base_shape, take = VIEWS[view]
    x = take(rank_values(world.rank, base_shape, "int32"))
    out = world.all_gather(x)
    assert_exact(out, np.concatenate(all_ranks(world, lambda r: take(rank_values(r, base_shape,
                                                                                 "int32")))))


@pytest.mark.parametrize("shape", [(0,), (1, 0, 2)])
def test_all_gather_empty_returns_empty(world, shape):
    out = world.all_gather(np.zeros(shape, np.float64))
    assert out.shape == (world.world_size * shape[0],) + shape[1:]


# -- broadcast ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_from_every_src_copies_src_array(world, assert_same_on_every_rank, dtype):
    for src in range(world.world_size):
        x = rank_values(world.rank, (4, 5), dtype, salt=src)
        out = world.broadcast(x, src)
        assert out is x
        assert_same_on_every_rank(world, x)
        assert_exact(x, rank_values(src, (4, 5), dtype, salt=src))


@pytest.mark.parametrize("view", ["every_other", "transposed_slice", "block"])
def test_broadcast_strided_view_writes_back_and_leaves_base_untouched(world, view):
    base_shape, take = VIEWS[view]
    for src in range(world.world_size):
        base = rank_values(world.rank, base_shape, "float32", salt=src)
        original = base.copy()
        world.broadcast(take(base), src)
        assert_exact(take(base), take(rank_values(src, base_shape, "float32", salt=src)))
        outside = np.ones(base_shape, bool)
        take(outside)[...] = False
        assert_exact(base[outside], original[outside])


@pytest.mark.parametrize("shape", [(0,), (1, 0, 2)])
def test_broadcast_empty_returns_empty(world, shape):
    x = np.zeros(shape, np.int8)
    assert world.broadcast(x, world.world_size - 1) is x


@pytest.mark.parametrize("src_of", [lambda n: n, lambda n: -1, lambda n: 0.0],
                         ids=["size", "negative", "float"])
def test_broadcast_bad_src_raises_value_error_on_every_rank(
        world, assert_raised_on_every_rank, src_of):
    assert_raised_on_every_rank(world, lambda: world.broadcast(np.ones(2), src_of(world.world_size)),
                                ValueError, match=["src="])


# -- all_to_all -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_chunk_j_comes_from_rank_j(world, assert_same_on_every_rank, dtype):
    n, rank = world.world_size, world.rank
    shape = (2 * n, 3)
    x = rank_values(rank, shape, dtype)
    before = x.copy()
    out = world.all_to_all(x)
    expected = np.concatenate([rank_values(j, shape, dtype)[2 * rank:2 * (rank + 1)]
                               for j in range(n)])
    assert_exact(out, expected)
    assert_exact(x, before)
    assert_same_on_every_rank(world, world.all_gather(out))


def test_all_to_all_strided_input(world):
    n, rank = world.world_size, world.rank
    take = lambda b: b[:, ::2].T  # noqa: E731  (shape (2n, 3) from a (3, 4n) base)
    base_shape = (3, 4 * n)
    out = world.all_to_all(take(rank_values(rank, base_shape, "int64")))
    expected = np.concatenate([take(rank_values(j, base_shape, "int64"))[2 * rank:2 * (rank + 1)]
                               for j in range(n)])
    assert_exact(out, expected)


@pytest.mark.parametrize("shape_of", [lambda n: (0,), lambda n: (n, 0, 2)], ids=["(0,)", "(n,0,2)"])
def test_all_to_all_empty_returns_empty(world, shape_of):
    shape = shape_of(world.world_size)
    assert world.all_to_all(np.zeros(shape, np.uint8)).shape == shape


# -- send / recv ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_send_recv_ring_passes_array_to_next_rank(world, dtype):
    n, rank = world.world_size, world.rank
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    sent = world.send(rank_values(rank, (1001,), dtype), nxt, async_op=True)
    got = world.recv(np.empty(1001, as_dtype(dtype)), prev)
    sent.wait()
    assert sent.test()
    assert_exact(got, rank_values(prev, (1001,), dtype))


def test_send_recv_strided_arrays(world):
    n, rank = world.world_size, world.rank
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    sent = world.send(rank_values(rank, (4, 6), "float32").T, nxt, async_op=True)
    base = np.full((4, 12), -99.0, np.float32)
    received = world.recv(base[:, ::2].T, prev, async_op=True)
    assert isinstance(received, rtxmpi.Work)
    out = received.wait()
    sent.wait()
    assert_exact(out, rank_values(prev, (4, 6), "float32").T)
    assert_exact(base[:, ::2], rank_values(prev, (4, 6), "float32"))
    assert (base[:, 1::2] == -99.0).all()


def test_send_recv_tags_keep_messages_apart(world):
    n, rank = world.world_size, world.rank
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    first = world.send(np.full(3, 100 + rank), nxt, tag=1, async_op=True)
    second = world.send(np.full(3, 200 + rank), nxt, tag=2, async_op=True)
    got2 = world.recv(np.empty(3, np.int64), prev, tag=2)
    got1 = world.recv(np.empty(3, np.int64), prev, tag=1)
    first.wait()
    second.wait()
    assert (got1 == 100 + prev).all() and (got2 == 200 + prev).all()


@pytest.mark.parametrize("peer_of", [lambda n: n, lambda n: -1], ids=["size", "negative"])
def test_send_recv_bad_peer_raises_value_error(world, assert_raised_on_every_rank, peer_of):
    peer = peer_of(world.world_size)
    assert_raised_on_every_rank(world, lambda: world.send(np.ones(2), peer), ValueError,
                                match=["dst="])
    assert_raised_on_every_rank(world, lambda: world.recv(np.ones(2), peer), ValueError,
                                match=["src="])


# -- barrier --------------------------------------------------------------------------------------
def test_barrier_returns_none(world):
    assert world.barrier() is None


def test_barrier_orders_side_effects_across_ranks(world):
    name = np.zeros(256, np.uint8)
    if world.rank == 0:
        encoded = tempfile.mkdtemp(prefix="rtxmpi-barrier-").encode()
        name[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    world.broadcast(name, 0)
    directory = Path(name.tobytes().rstrip(b"\0").decode())
    time.sleep(0.02 * world.rank)  # later ranks arrive later
    (directory / f"rank{world.rank}").write_text("here")
    world.barrier()
    seen = sorted(p.name for p in directory.iterdir())
    world.barrier()
    if world.rank == 0:
        for p in directory.iterdir():
            p.unlink()
        directory.rmdir()
    assert seen == sorted(f"rank{r}" for r in range(world.world_size))


# -- async_op=True --------------------------------------------------------------------------------
def _async_cases(world):
    """name: (blocking call, async call) on fresh inputs; both return the result."""
    n, rank = world.world_size, world.rank
    f32 = lambda shape, op="sum": rank_values(rank, shape, "float32", op)  # noqa: E731
    cases = {f"all_reduce_{op}": (lambda op=op: world.all_reduce(f32((5, 3), op), op),
                                  lambda op=op: world.all_reduce(f32((5, 3), op), op, async_op=True))
             for op in OPS}
    cases.update({
        "all_reduce_float16_strided": (
            lambda: world.all_reduce(rank_values(rank, (9,), "float16")[::2]),
            lambda: world.all_reduce(rank_values(rank, (9,), "float16")[::2], async_op=True)),
        "all_reduce_bool": (lambda: world.all_reduce(rank_values(rank, (9,), "bool")),
                            lambda: world.all_reduce(rank_values(rank, (9,), "bool"), async_op=True)),
        "reduce_scatter": (lambda: world.reduce_scatter(f32((2 * n, 3))),
                           lambda: world.reduce_scatter(f32((2 * n, 3)), async_op=True)),
        "reduce_scatter_bfloat16_avg": (
            lambda: world.reduce_scatter(rank_values(rank, (2 * n,), "bfloat16"), "avg"),
            lambda: world.reduce_scatter(rank_values(rank, (2 * n,), "bfloat16"), "avg",
                                         async_op=True)),
        "all_gather": (lambda: world.all_gather(f32((2, 3))),
                       lambda: world.all_gather(f32((2, 3)), async_op=True)),
        "broadcast": (lambda: world.broadcast(f32((4,)), n - 1),
                      lambda: world.broadcast(f32((4,)), n - 1, async_op=True)),
        "broadcast_strided": (lambda: world.broadcast(f32((4, 4)).T, 0),
                              lambda: world.broadcast(f32((4, 4)).T, 0, async_op=True)),
        "all_to_all": (lambda: world.all_to_all(f32((2 * n, 3))),
                       lambda: world.all_to_all(f32((2 * n, 3)), async_op=True)),
        "barrier": (lambda: world.barrier(), lambda: world.barrier(async_op=True)),
    })
    return cases


ASYNC_CASES = ["all_reduce_" + op for op in OPS] + [
    "all_reduce_float16_strided", "all_reduce_bool", "reduce_scatter",
    "reduce_scatter_bfloat16_avg", "all_gather", "broadcast", "broadcast_strided", "all_to_all",
    "barrier"]


def _same_result(a, b):
    if a is None or b is None:
        assert a is None and b is None
    else:
        assert_exact(a, b)


@pytest.mark.parametrize("case", ASYNC_CASES)
def test_async_op_wait_returns_same_result_as_blocking(world, case):
    blocking, nonblocking = _async_cases(world)[case]
    expected = blocking()
    work = nonblocking()
    assert isinstance(work, rtxmpi.Work)
    result = work.wait()
    assert work.test() and work.is_completed()
    _same_result(result, expected)
    _same_result(work.result, expected)
    assert work.wait() is result  # waiting again is harmless


@pytest.mark.parametrize("case", ["all_reduce_sum", "all_gather", "barrier", "all_to_all"])
def test_async_op_test_becomes_true_without_wait(world, case):
    blocking, nonblocking = _async_cases(world)[case]
    expected = blocking()
    work = nonblocking()
    deadline = time.monotonic() + 30
    while not work.test() and time.monotonic() < deadline:
        time.sleep(0.0005)
    completed = work.test()
    work.wait()
    assert completed, f"{work!r} did not complete by polling test()"
    _same_result(work.result, expected)


def test_several_async_ops_in_flight_complete_in_any_wait_order(world):
    n = world.world_size
    works = [world.all_reduce(np.full(4, float(world.rank + k)), async_op=True) for k in range(4)]
    results = [works[k].wait() for k in (3, 1, 0, 2)]
    for k, result in zip((3, 1, 0, 2), results):
        assert (result == sum(r + k for r in range(n))).all()


# -- checking mode: mismatches are caught before any data moves ----------------------------------
def _call(world, collective, x, **kwargs):
    return getattr(world, collective)(x, **kwargs)


def _assert_names_rank_calls(error, world, collective, describe):
    """The message has one entry per rank: `rank r: collective(seq=S, shape=..., dtype=...`."""
    text = str(error)
    for r in range(world.world_size):
        shape, dtype = describe(r)
        pattern = (rf"rank {r}: {collective}\(seq=\d+, shape={re.escape(str(shape))}, "
                   rf"dtype={dtype}\b")
        assert re.search(pattern, text), f"no {pattern!r} in {text}"


def _assert_group_still_usable(world):
    y = np.full(3, world.rank, np.int64)
    world.all_reduce(y)
    assert (y == sum(range(world.world_size))).all()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_mismatched_shapes_raise_on_every_rank(world, assert_raised_on_every_rank, collective):
    shape_of = lambda r: (1, 8) if r % 2 == 0 else (2, 8)  # noqa: E731
    x = np.full(shape_of(world.rank), world.rank + 1, np.float32)
    before = x.copy()
    error = assert_raised_on_every_rank(world, lambda: _call(world, collective, x),
                                        CollectiveMismatch)
    _assert_names_rank_calls(error, world, collective, lambda r: (shape_of(r), "float32"))
    assert_exact(x, before)  # detected before any data moved
    _assert_group_still_usable(world)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_mismatched_dtypes_raise_on_every_rank(world, assert_raised_on_every_rank, collective):
    dtype_of = lambda r: "float32" if r % 2 == 0 else "float64"  # noqa: E731
    shape = (2 * world.world_size, 8)
    x = np.full(shape, world.rank + 1, dtype_of(world.rank))
    before = x.copy()
    error = assert_raised_on_every_rank(world, lambda: _call(world, collective, x),
                                        CollectiveMismatch)
    _assert_names_rank_calls(error, world, collective, lambda r: (shape, dtype_of(r)))
    assert_exact(x, before)
    _assert_group_still_usable(world)


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_in_async_call_raise_before_returning_work(
        world, assert_raised_on_every_rank):
    x = np.ones((1 + world.rank % 2, 8), np.float32)
    assert_raised_on_every_rank(world, lambda: world.all_reduce(x, async_op=True),
                                CollectiveMismatch)
    _assert_group_still_usable(world)


@pytest.mark.mpi(min_size=2)
def test_mismatched_reduce_ops_raise_on_every_rank(world, assert_raised_on_every_rank):
    op_of = lambda r: "sum" if r == 0 else "max"  # noqa: E731
    error = assert_raised_on_every_rank(world, lambda: world.all_reduce(np.ones(4), op_of(world.rank)),
                                        CollectiveMismatch)
    for r in range(world.world_size):
        pattern = rf"rank {r}: all_reduce\(seq=\d+, shape=\(4,\), dtype=float64, op={op_of(r)}\)"
        assert re.search(pattern, str(error)), str(error)
    _assert_group_still_usable(world)


@pytest.mark.mpi(min_size=2)
def test_mismatched_broadcast_src_raises_on_every_rank(world, assert_raised_on_every_rank):
    x = np.full(4, float(world.rank))
    error = assert_raised_on_every_rank(world, lambda: world.broadcast(x, world.rank), CollectiveMismatch)
    for r in range(world.world_size):
        assert f"rank {r}: broadcast(" in str(error) and f"src={r}" in str(error)
    assert (x == world.rank).all()
    _assert_group_still_usable(world)


@pytest.mark.mpi(min_size=2)
def test_different_collectives_in_the_same_slot_raise_on_every_rank(
        world, assert_raised_on_every_rank):
    x = np.ones((world.world_size, 2), np.float32)
    calls = [lambda: world.all_reduce(x), lambda: world.all_gather(x), lambda: world.barrier()]
    error = assert_raised_on_every_rank(world, calls[world.rank % 3], CollectiveMismatch)
    assert "rank 0: all_reduce(" in str(error) and "rank 1: all_gather(" in str(error)
    _assert_group_still_usable(world)


# -- host staging: device (cupy) arrays on a backend that reads only host memory -----------------
class FakeDeviceArray:
    """Stand-in for a cupy array (no GPU needed): `set()` and `asarray()` behave like cupy's."""

    def __init__(self, data):
        self.data = data

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    flags = property(lambda self: self.data.flags)

    def __getitem__(self, key):
        return FakeDeviceArray(self.data[key])  # a view, as in cupy

    def __setitem__(self, key, value):
        self.data[key] = value.data if isinstance(value, FakeDeviceArray) else value

    def set(self, host, stream=None):
        assert isinstance(host, np.ndarray) and host.shape == self.shape
        if not (self.flags.c_contiguous or self.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")  # cupy's own check
        self.data[...] = host


class FakeCupy:
    ndarray = FakeDeviceArray

    @staticmethod
    def asnumpy(x, stream=None):
        return np.array(x.data)

    @staticmethod
    def asarray(a):
        if isinstance(a, FakeDeviceArray):
            return a
        a = np.asarray(a)
        if a.dtype == object:
            raise ValueError("Unsupported dtype object")  # what cupy.asarray(None) raises
        return FakeDeviceArray(a.copy())


@pytest.fixture
def fake_cupy(monkeypatch):
    import rtxmpi.comm.group as group_module

    monkeypatch.setattr(group_module, "is_device_array", lambda x: isinstance(x, FakeDeviceArray))
    monkeypatch.setattr(group_module, "xp_of",
                        lambda x: FakeCupy if isinstance(x, FakeDeviceArray) else np)
    return FakeCupy


@pytest.mark.parametrize("async_op", [False, True])
def test_device_array_all_reduce_is_staged_through_host_and_written_back(world, fake_cupy, async_op):
    x = FakeDeviceArray(np.full((2, 3), world.rank + 1.0, np.float32))
    out = world.all_reduce(x, async_op=async_op)
    if async_op:
        assert isinstance(out, rtxmpi.Work) and out.test()
        out = out.wait()
    assert out is x
    assert (x.data == sum(r + 1 for r in range(world.world_size))).all()


@pytest.mark.parametrize("view", ["every_other", "transposed_slice", "block"])
def test_device_array_strided_view_is_written_back_and_base_untouched(world, fake_cupy, view):
    base_shape, take = VIEWS[view]
    base = rank_values(world.rank, base_shape, "float32")
    original = base.copy()
    x = take(FakeDeviceArray(base)) if view == "every_other" else FakeDeviceArray(take(base))
    expected = reduce_reference(
        all_ranks(world, lambda r: take(rank_values(r, base_shape, "float32"))), "sum")
    assert world.all_reduce(x) is x
    assert_exact(take(base), expected)
    outside = np.ones(base_shape, bool)
    take(outside)[...] = False
    assert_exact(base[outside], original[outside])


def test_device_array_all_gather_returns_device_array(world, fake_cupy):
    out = world.all_gather(FakeDeviceArray(np.array([world.rank], np.int64)))
    assert isinstance(out, FakeDeviceArray)
    assert out.data.tolist() == list(range(world.world_size))


@pytest.mark.parametrize("async_op", [False, True])
def test_device_array_send_recv_ring(world, fake_cupy, async_op):
    # host staging makes even async_op=True calls synchronous: small (eager) messages only
    n, rank = world.world_size, world.rank
    sent = world.send(FakeDeviceArray(np.full(3, rank, np.int64)), (rank + 1) % n,
                      async_op=async_op)
    target = FakeDeviceArray(np.zeros(3, np.int64))
    got = world.recv(target, (rank - 1) % n, async_op=async_op)
    if async_op:
        assert isinstance(sent, rtxmpi.Work) and sent.wait() is None
        got = got.wait()
    else:
        assert sent is None
    assert got is target and (target.data == (rank - 1) % n).all()


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather", "all_to_all"])
def test_async_collective_keeps_a_temporary_input_alive_until_wait(world, collective):
    n = 4 * world.world_size
    expected = {"reduce_scatter": lambda: np.full(4, sum(r + 0.5 for r in range(world.world_size))),
                "all_gather": lambda: np.repeat(np.arange(world.world_size) + 0.5, n),
                "all_to_all": lambda: np.repeat(np.arange(world.world_size) + 0.5, 4)}[collective]()
    for _ in range(5):
        # the input is a temporary (and a strided one, so the group makes its own contiguous copy)
        work = getattr(world, collective)(np.full(2 * n, world.rank + 0.5)[::2], async_op=True)
        junk = [np.full(2 * n, -1e9) for _ in range(20)]  # would reuse freed memory
        np.testing.assert_array_equal(work.wait(), expected)
        del junk
