"""ZeRO shard layout and stage-2 column buckets (no MPI needed)."""
from types import SimpleNamespace

import numpy as np
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.nn import AdamW, decay_mask
from rtxmpi.nn.params import layout
from rtxmpi.parallel.zero import (build_column_buckets, even_range, optimizer_bytes,
                                  shard_decay_mask, shard_range, shard_size, zero_state_bytes)


def ranges(numel, world_size):
    return [shard_range(numel, world_size, r) for r in range(world_size)]


def params(sizes):
    out, offset = [], 0
    for size in sizes:
        out.append(SimpleNamespace(offset=offset, size=size))
        offset += size
    return out


def test_7_elements_over_4_ranks_are_2_2_2_1():
    assert ranges(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]


@pytest.mark.parametrize("numel,world_size", [(7, 3), (2, 4), (0, 2), (12, 4)])
def test_even_pieces_tile_the_vector_and_differ_by_at_most_one(numel, world_size):
    pieces = [even_range(numel, world_size, r) for r in range(world_size)]
    assert pieces[0][0] == 0 and pieces[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    sizes = [hi - lo for lo, hi in pieces]
    assert max(sizes) - min(sizes) <= 1
    assert even_range(7, 3, 2) == (4, 7)  # the larger pieces last (Shard.even's layout)


def test_1_element_over_4_ranks_is_1_0_0_0():
    assert ranges(1, 4) == [(0, 1), (1, 1), (1, 1), (1, 1)]


def test_5_elements_over_4_ranks_leave_the_last_shard_empty():
    assert [stop - start for start, stop in ranges(5, 4)] == [2, 2, 1, 0]


def test_0_elements_give_empty_shards_everywhere():
    assert shard_size(0, 4) == 0
    assert ranges(0, 4) == [(0, 0)] * 4


@pytest.mark.parametrize("world_size", range(1, 10))
def test_shards_cover_every_element_exactly_once(world_size):
    for numel in range(0, 40):
        count = np.zeros(numel, np.int64)
        previous_stop = 0
        for start, stop in ranges(numel, world_size):
            assert start == previous_stop and stop >= start  # contiguous, in rank order
            assert stop - start <= shard_size(numel, world_size)
            count[start:stop] += 1
            previous_stop = stop
        assert previous_stop == numel and (count == 1).all()


def test_bad_layout_arguments_raise_config_error():
    with pytest.raises(ConfigError):
        shard_size(-1, 4)
    with pytest.raises(ConfigError):
        shard_size(4, 0)
    with pytest.raises(ConfigError):
        shard_range(4, 2, 2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket_bytes", [1, 16, 40, 2**20])
def test_column_buckets_cover_the_shard_columns_once_last_columns_first(world_size, bucket_bytes):
    sizes = [5, 1, 0, 9, 3, 2]
    numel = sum(sizes)
    buckets, _ = build_column_buckets(params(sizes), numel, world_size, bucket_bytes, itemsize=8)
    size = shard_size(numel, world_size)
    assert buckets[0].col_stop == size and buckets[-1].col_start == 0
    for earlier, later in zip(buckets, buckets[1:]):
        assert later.col_stop == earlier.col_start
    assert [b.index for b in buckets] == list(range(len(buckets)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bucket_bytes", [1, 16, 40, 2**20])
def test_each_parameter_maps_to_exactly_the_buckets_holding_its_elements(world_size, bucket_bytes):
    sizes = [5, 1, 0, 9, 3, 2]
    numel = sum(sizes)
    ps = params(sizes)
    buckets, buckets_of = build_column_buckets(ps, numel, world_size, bucket_bytes, itemsize=8)
    size = shard_size(numel, world_size)
    for p, touched in zip(ps, buckets_of):
        columns = {e % size for e in range(p.offset, p.offset + p.size)}
        expected = {b.index for b in buckets
                    if any(b.col_start <= c < b.col_stop for c in columns)}
        assert set(touched) == expected
    for b in buckets:
        assert b.num_params == sum(b.index in t for t in buckets_of) > 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shard_decay_mask_is_the_slice_of_the_full_mask(world_size):
    specs = layout([("w", (3, 2), True), ("b", (2,), False), ("e", (5,), True), ("g", (1,), False)])
    full = decay_mask(specs)
    for rank in range(world_size):
        start, stop = shard_range(len(full), world_size, rank)
        np.testing.assert_array_equal(shard_decay_mask(specs, start, stop), full[start:stop])


def test_optimizer_bytes_count_the_state_not_the_parameters():
    params64 = np.zeros(10)
    opt = AdamW(params64, decay_mask=np.ones(10))
    assert optimizer_bytes(opt) == 4 * params64.nbytes  # m, v, decay mask, scratch


def test_zero_state_bytes_is_the_per_rank_memory_model():
    # 7 float32 elements over 4 ranks: shards of S = 2 (the last rank's short: + send buffer)
    assert zero_state_bytes(7, 4, 0) == {"params": 28, "grads": 28, "optimizer": 112,
                                         "total": 168, "transient": 0}
    assert zero_state_bytes(7, 4, 1)["params"] == 28 + 8
    assert zero_state_bytes(8, 4, 2) == {"params": 32, "grads": 32, "optimizer": 32,
                                         "total": 96, "transient": 0}
    assert zero_state_bytes(8, 4, 3, unit_numel=3) == {"params": 8, "grads": 8, "optimizer": 32,
                                                       "total": 48, "transient": 24}
    # float16 model, CPU offload: float32 master and host gradient shards, float32 AdamW state
    assert zero_state_bytes(8, 4, 3, itemsize=2, offload="cpu") == {
        "params": 4 + 8, "grads": 4 + 8, "optimizer": 32, "total": 56, "transient": 0}


@pytest.mark.parametrize("kwargs", [{"stage": 4}, {"stage": 0, "offload": "cpu"},
                                    {"stage": 2, "offload": "nvme"}])
def test_zero_state_bytes_refuses_what_it_does_not_model(kwargs):
    with pytest.raises(ConfigError):
        zero_state_bytes(8, 4, **kwargs)
