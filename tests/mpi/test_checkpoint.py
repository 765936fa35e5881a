"""Collective save/load of sharded checkpoints; holds at any world size (-n 1, 2, 4)."""
import os
import time

import h5py
import numpy as np
import pytest

from rtxmpi.checkpoint import Shard, latest_step, latest_valid, load_checkpoint, save_checkpoint
from rtxmpi.checkpoint import format as fmt
from rtxmpi.errors import CheckpointError


def full_tensors():
    """The same global tensors on every rank (odd sizes, several dtypes)."""
    rng = np.random.default_rng(42)
    return {"params": rng.standard_normal(1013).astype(np.float32),
            "adam.v": rng.random(1013), "tiny": np.arange(3, dtype=np.int32)}


def uneven_bounds(n, world_size):
    """Piece boundaries of a ZeRO-like uneven split: rank r owns a share growing with r."""
    weights = np.arange(1, world_size + 1)
    return np.concatenate([[0], np.cumsum(weights) * n // weights.sum()])


def save_even(world, ckpt_dir, step, arrays):
    shards = {k: Shard.even(a, world.rank, world.world_size) for k, a in arrays.items()}
    return save_checkpoint(world, ckpt_dir, step, shards, meta={"step": step},
                           rank_state={"rank": world.rank, "rng": np.full(2, world.rank)})


def test_save_and_load_at_this_world_size_is_exact(world, ckpt_dir):
    arrays = full_tensors()
    path = save_even(world, ckpt_dir, 100, arrays)
    assert path == os.path.join(ckpt_dir, "step_00000100")
    ckpt = load_checkpoint(world, ckpt_dir)
    assert (ckpt.step, ckpt.world_size_saved, ckpt.meta) == (100, world.world_size, {"step": 100})
    for name, a in arrays.items():
        got = ckpt.read(name)
        assert got.dtype == a.dtype and np.array_equal(got, a), name
    state = ckpt.rank_state(world.rank)
    assert state["rank"] == world.rank and np.array_equal(state["rng"], np.full(2, world.rank))
    assert sorted(os.listdir(path)) == ["metadata.json"] + [fmt.rank_file_name(r)
                                                            for r in range(world.world_size)]


def test_each_rank_writes_only_its_slice(world, ckpt_dir):
    arrays = full_tensors()
    save_even(world, ckpt_dir, 1, arrays)
    world.barrier()
    total = 0
    for r in range(world.world_size):
        with h5py.File(os.path.join(ckpt_dir, "step_00000001", fmt.rank_file_name(r)), "r") as f:
            total += f["tensors/params"].size
    assert total == arrays["params"].size  # no duplicate bytes


def test_ranges_spanning_several_rank_files_read_back(world, ckpt_dir):
    full = np.random.default_rng(1).standard_normal(997)
    bounds = uneven_bounds(full.size, world.world_size)
    lo, hi = bounds[world.rank], bounds[world.rank + 1]
    save_checkpoint(world, ckpt_dir, 7, {"w": Shard(full[lo:hi].copy(), int(lo), full.size)})
    ckpt = load_checkpoint(world, ckpt_dir, step=7)
    assert [p["offset"] for p in ckpt.tensors["w"]["pieces"]] == [int(b) for b in bounds[:-1]]
    rng = np.random.default_rng(100 + world.rank)  # every rank asks for different ranges
    for _ in range(5):
        start = int(rng.integers(0, full.size))
        length = int(rng.integers(0, full.size - start + 1))
        assert np.array_equal(ckpt.read("w", start, length), full[start:start + length])
    assert np.array_equal(ckpt.read("w", 0, 0), full[:0])


def test_rank_failing_mid_save_raises_everywhere_and_commits_nothing(world, ckpt_dir, monkeypatch,
                                                                     assert_raised_on_every_rank):
    arrays = full_tensors()
    save_even(world, ckpt_dir, 1, arrays)
    if world.rank == world.world_size - 1:
        def broken_writer(path, shards, rank_state=None):
            with open(path, "wb") as f:
                f.write(b"partial")
            raise RuntimeError("injected disk failure")

        monkeypatch.setattr(fmt, "write_rank_file", broken_writer)
    error = assert_raised_on_every_rank(world, lambda: save_even(world, ckpt_dir, 2, arrays),
                                        CheckpointError, match=["injected disk failure",
                                                                f"rank {world.world_size - 1}"])
    assert "rank_%05d.h5" % (world.world_size - 1) in str(error)
    step_dir = os.path.join(ckpt_dir, "step_00000002")
    assert not os.path.exists(os.path.join(step_dir, "metadata.json"))
    assert latest_step(ckpt_dir) == 1
    with open(os.path.join(ckpt_dir, "latest")) as f:
        assert f.read().strip() == "step_00000001"
    world.barrier()
    monkeypatch.undo()
    save_even(world, ckpt_dir, 2, arrays)  # the next save of that step replaces the leftovers
    assert latest_step(ckpt_dir) == 2


def test_flipped_byte_raises_on_every_rank_naming_file_and_dataset(world, ckpt_dir,
                                                                   assert_raised_on_every_rank):
    save_even(world, ckpt_dir, 3, full_tensors())
    last = fmt.rank_file_name(world.world_size - 1)
    world.barrier()
    if world.rank == 0:
        path = os.path.join(ckpt_dir, "step_00000003", last)
        with h5py.File(path, "r") as f:
            offset = f["tensors/params"].id.get_offset()
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 1]))
    world.barrier()
    ckpt = load_checkpoint(world, ckpt_dir)
    # only the rank that reads the last piece hits it; every rank must raise
    n = ckpt.tensors["params"]["global_size"]
    reads_last = world.rank == world.world_size - 1
    assert_raised_on_every_rank(
        world, lambda: ckpt.read("params", n - 1 if reads_last else 0, 1), CheckpointError,
        match=[last, "/tensors/params", "checksum mismatch"])


def test_no_checkpoint_raises_on_every_rank(world, ckpt_dir, assert_raised_on_every_rank):
    assert_raised_on_every_rank(world, lambda: load_checkpoint(world, ckpt_dir), CheckpointError,
                                match=["no committed checkpoint"])


@pytest.mark.mpi(min_size=2)
def test_different_tensors_on_ranks_raise_on_every_rank(world, ckpt_dir,
                                                        assert_raised_on_every_rank):
    name = "params" if world.rank == 0 else "other"
    shards = {name: Shard(np.zeros(4), 0, 4)}
    assert_raised_on_every_rank(world, lambda: save_checkpoint(world, ckpt_dir, 1, shards),
                                CheckpointError, match=["different tensors"])
    assert latest_step(ckpt_dir) is None


def read_all(ckpt_dir, step):
    ckpt = load_checkpoint(None, ckpt_dir, step=step)
    return {name: ckpt.read(name) for name in ckpt.tensors}


def test_async_save_equals_sync_save_though_training_changes_the_arrays(world, ckpt_dir):
    arrays = full_tensors()
    want = {k: a.copy() for k, a in arrays.items()}
    sync_dir = os.path.join(ckpt_dir, "sync")
    save_even(world, sync_dir, 5, arrays)
    shards = {k: Shard.even(a, world.rank, world.world_size) for k, a in arrays.items()}
    handle = save_checkpoint(world, ckpt_dir, 5, shards, meta={"step": 5},
                             rank_state={"rank": world.rank, "rng": np.full(2, world.rank)},
                             async_save=True)
    for a in arrays.values():  # "the next training step" changes the live arrays at once
        a += 1
    assert not os.path.exists(os.path.join(ckpt_dir, "step_00000005", "metadata.json"))
    assert handle.finish() == os.path.join(ckpt_dir, "step_00000005")
    assert handle.finish() == handle.path  # idempotent
    assert latest_step(ckpt_dir) == 5
    world.barrier()
    got, ref = read_all(ckpt_dir, 5), read_all(sync_dir, 5)
    for name, a in want.items():
        assert np.array_equal(got[name], a) and np.array_equal(ref[name], a), name
    for r in range(world.world_size):
        with h5py.File(os.path.join(ckpt_dir, "step_00000005", fmt.rank_file_name(r)), "r") as f, \
                h5py.File(os.path.join(sync_dir, "step_00000005", fmt.rank_file_name(r)), "r") as g:
            for name in want:
                assert f["tensors"][name].attrs["checksum"] == g["tensors"][name].attrs["checksum"]


def test_next_save_finishes_the_async_save_in_flight(world, ckpt_dir):
    arrays = full_tensors()
    shards = {k: Shard.even(a, world.rank, world.world_size) for k, a in arrays.items()}
    first = save_checkpoint(world, ckpt_dir, 1, shards, async_save=True)
    second = save_checkpoint(world, ckpt_dir, 2, shards, async_save=True)  # commits step 1 first
    assert fmt.is_committed(first.path) and first.finish() == first.path
    assert second.finish() == second.path and latest_step(ckpt_dir) == 2


def test_async_writer_failure_raises_on_every_rank_at_finish(world, ckpt_dir, monkeypatch,
                                                             assert_raised_on_every_rank):
    arrays = full_tensors()
    save_even(world, ckpt_dir, 1, arrays)
    if world.rank == world.world_size - 1:
        def broken_writer(path, shards, rank_state=None):
            raise RuntimeError("injected disk failure")

        monkeypatch.setattr(fmt, "write_rank_file", broken_writer)
    shards = {k: Shard.even(a, world.rank, world.world_size) for k, a in arrays.items()}
    handle = save_checkpoint(world, ckpt_dir, 2, shards, async_save=True)  # returns on every rank
    assert_raised_on_every_rank(world, handle.finish, CheckpointError,
                                match=["injected disk failure", f"rank {world.world_size - 1}"])
    assert not os.path.exists(os.path.join(ckpt_dir, "step_00000002", "metadata.json"))
    with open(os.path.join(ckpt_dir, "latest")) as f:
        assert f.read().strip() == "step_00000001"
    with pytest.raises(CheckpointError):
        handle.finish()  # the same error again, no collective
    world.barrier()
    monkeypatch.undo()
    save_even(world, ckpt_dir, 2, arrays)  # the in-flight slot is free: a new save works
    assert latest_step(ckpt_dir) == 2


def test_async_write_past_its_deadline_raises_on_every_rank(world, ckpt_dir, monkeypatch,
                                                             assert_raised_on_every_rank):
    arrays = full_tensors()
    if world.rank == 0:
        def slow_writer(path, shards, rank_state=None):
            time.sleep(1.0)
            raise RuntimeError("slow disk gave up")

        monkeypatch.setattr(fmt, "write_rank_file", slow_writer)
    shards = {k: Shard.even(a, world.rank, world.world_size) for k, a in arrays.items()}
    handle = save_checkpoint(world, ckpt_dir, 3, shards, async_save=True)
    assert_raised_on_every_rank(world, lambda: handle.finish(timeout_s=0.1), CheckpointError,
                                match=["not done after 0.1 s", "rank 0"])
    assert latest_step(ckpt_dir) is None
    time.sleep(1.2)  # let the slow writer end before the directory is removed


def test_read_many_returns_every_range_and_fails_on_every_rank(world, ckpt_dir,
                                                              assert_raised_on_every_rank):
    arrays = full_tensors()
    save_even(world, ckpt_dir, 3, arrays)
    ckpt = load_checkpoint(world, ckpt_dir)
    start = world.rank  # every rank asks for different ranges
    out = np.zeros(500, np.float32)
    got = ckpt.read_many({"params": (start, 500, out), "adam.v": (start, None, None), "tiny": (0, 2, None)})
    assert got["params"] is out and np.array_equal(out, arrays["params"][start:start + 500])
    assert np.array_equal(got["adam.v"], arrays["adam.v"][start:])
    assert np.array_equal(got["tiny"], arrays["tiny"][:2])
    bad = {"tiny": (0, 2, None)} if world.rank else {"tiny": (0, 4, None)}  # rank 0 asks past the end
    assert_raised_on_every_rank(world, lambda: ckpt.read_many(bad), CheckpointError,
                                match=["outside its 3 elements"])


def test_latest_valid_falls_back_alike_on_every_rank_when_one_ranks_file_is_corrupt(
        world, ckpt_dir, assert_raised_on_every_rank):
    save_even(world, ckpt_dir, 1, full_tensors())
    save_even(world, ckpt_dir, 2, full_tensors())
    last = fmt.rank_file_name(world.world_size - 1)  # verified by the last rank alone
    world.barrier()
    if world.rank == 0:
        path = os.path.join(ckpt_dir, "step_00000002", last)
        with h5py.File(path, "r") as f:
            offset = f["tensors/adam.v"].id.get_offset()
        with open(path, "r+b") as f:
            f.seek(offset + 5)
            byte = f.read(1)
            f.seek(offset + 5)
            f.write(bytes([byte[0] ^ 4]))
    world.barrier()
    step, skipped = latest_valid(world, ckpt_dir)
    assert step == 1 and [p for p, _ in skipped] == [os.path.join(ckpt_dir, "step_00000002")]
    assert f"{last}: dataset /tensors/adam.v: checksum mismatch" in skipped[0][1]
    assert_raised_on_every_rank(world, lambda: latest_valid(world, ckpt_dir, fallback=False),
                                CheckpointError, match=["step_00000002", "checksum mismatch"])
