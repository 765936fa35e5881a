"""Elastic recovery of hybrid layouts: the survivors' shards rebuild the one-process model.

`replica_pieces` (rtxmpi/parallel/replica.py) places every local element of a tensor-parallel or
pipeline engine in the one-process flat layout; `exchange_pieces` (rtxmpi/elastic/shrink.py)
picks one rank per shard key and assembles params and AdamW m, v, step on every rank. Checked here
on a healthy world (the shrink itself is tests/launched/test_elastic.py) against the engine's own
gathers (full_params, and the checkpoint pieces of `shards`), bitwise, after a training step.
"""
import numpy as np
import pytest
from conftest import GLOBAL_BATCH, global_batch

from rtxmpi.elastic.shrink import exchange_pieces
from rtxmpi.mesh import DeviceMesh
from rtxmpi.nn import AdamW, GPTConfig
from rtxmpi.parallel.hybrid import HybridParallel, ParallelGPT
from rtxmpi.parallel.pipeline import build_pipeline
from rtxmpi.parallel.replica import replica_pieces

CFG = GPTConfig(seq_len=16, n_layer=4, n_head=4, n_embd=32)


def optimizer(params, mask):
    return AdamW(params, lr=1e-2, decay_mask=mask)


def layouts(n):
    """(kind, dp, tp, pp, sp) for world size n."""
    out = [("hybrid", 1, n, 1, 1)]
    if n > 1:
        out.append(("pipeline", 1, 1, n, 1))
    if n == 4:
        out += [("hybrid", 2, 2, 1, 1), ("hybrid", 1, 2, 1, 2), ("pipeline", 1, 2, 2, 1),
                ("pipeline", 2, 1, 2, 1)]
    return out


def trained(world, kind, dp, tp, pp, sp):
    """An engine of the layout after one optimizer step (so m, v and step are not the initial)."""
    x, y = global_batch(0)
    if kind == "pipeline":
        engine = build_pipeline(CFG, world, dp=dp, pp=pp, tp=tp, sp=sp, micro_batches=pp, seed=3,
                                optimizer=optimizer)
        rows = engine.mesh.batch_slice(GLOBAL_BATCH)
        engine.train_step(x[rows], y[rows])
    else:
        mesh = DeviceMesh(dp=dp, tp=tp, pp=1, sp=sp, group=world)
        engine = HybridParallel(ParallelGPT(CFG, mesh, seed=3), optimizer=optimizer)
        rows = mesh.batch_slice(GLOBAL_BATCH)
        _, cache = engine.forward(x[rows], y[rows])
        engine.backward(cache)
    engine.step(lr=1e-2)
    return engine


@pytest.mark.parametrize("index", range(6))
def test_exchanged_pieces_are_the_full_model_and_optimizer_state(world, index):
    if index >= len(layouts(world.world_size)):
        pytest.skip("layout for another world size")
    kind, dp, tp, pp, sp = layouts(world.world_size)[index]
    engine = trained(world, kind, dp, tp, pp, sp)
    pieces = replica_pieces(engine)
    assert pieces.keys == tp * pp and 0 <= pieces.key < pieces.keys
    made = []
    state = exchange_pieces(world, 1, lambda: made.append(replica_pieces(engine)) or made[-1],
                            lambda: {"seen": world.rank}, world.world_size)
    assert state is not None and state.step == 1 and state.meta == {"seen": min(state.sources)}
    assert len(state.sources) == tp * pp
    assert made[0].built == (world.rank in state.sources)  # only the senders copied their state
    full = np.asarray(engine.full_params())  # collective: the engine's own gather
    assert np.array_equal(state.read("params"), full)
    for name, (data, offset, _) in engine.shards().items():  # what a checkpoint would hold
        assert np.array_equal(state.read(name, offset, len(data)), np.asarray(data)), name
    assert int(state.read("adam.step")[0]) == 1


@pytest.mark.mpi(min_size=2)
def test_no_complete_copy_means_the_checkpoint(world):
    """tp = world size: rank 1 alone is at step 2, the others at step 1, and each rank holds its
    own tp shard: no step has every key, so every rank gets None (reload the checkpoint)."""
    engine = trained(world, "hybrid", 1, world.world_size, 1, 1)
    state = exchange_pieces(world, 2 if world.rank == 1 else 1, lambda: replica_pieces(engine),
                            dict, world.world_size)
    assert state is None


@pytest.mark.mpi(min_size=4)
def test_the_newest_step_with_every_key_wins_and_the_lowest_rank_sends(world):
    """dp 2 x tp 2: rank 0 (key 0) is one step behind; rank 2 holds key 0 at the newest step."""
    if world.world_size != 4:
        pytest.skip("a 4-rank layout")
    engine = trained(world, "hybrid", 2, 2, 1, 1)
    state = exchange_pieces(world, 4 if world.rank else 3, lambda: replica_pieces(engine),
                            lambda: {"rank": world.rank}, 4)
    assert state.step == 4 and state.sources == [2, 1] and state.meta == {"rank": 1}
