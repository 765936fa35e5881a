"""A bad batch on ONE rank raises ConfigError on EVERY rank of the step, naming that rank, before
any rank enters the step's collectives (no rank is left waiting for a deadline).

Every training entry point: DataParallel, ZeroDataParallel (stages 1 and 3), HybridParallel and
ZeroHybridParallel (tensor parallel over every rank, and dp x tp at -n 4), PipelineParallel built
from a mesh and from bare pp/dp groups. The last world rank gets a token id of 300 (vocab 256);
the other ranks' batches are good. Afterwards the same engine trains a good batch, so nothing was
left half-sent.
"""
import numpy as np
import pytest
from conftest import GLOBAL_BATCH, T, global_batch, local_slice

from rtxmpi.errors import ConfigError
from rtxmpi.mesh import DeviceMesh
from rtxmpi.nn import GPT, GPTConfig
from rtxmpi.parallel.data import DataParallel
from rtxmpi.parallel.hybrid import HybridParallel, ParallelGPT
from rtxmpi.parallel.pipeline import PipelineParallel
from rtxmpi.parallel.zero import ZeroDataParallel
from rtxmpi.parallel.zero_hybrid import ZeroHybridParallel

CFG = GPTConfig(vocab_size=256, seq_len=T, n_layer=2, n_head=4, n_embd=16)


def spoil_on_last_rank(world, x):
    """This rank's rows x as int64, with one id of 300 on the last world rank only."""
    x = x.astype(np.int64)
    if world.rank == world.world_size - 1:
        x[0, 1] = 300
    return x


def expected(world):
    """Texts every rank's message must hold: the offending rank (when there are peers) and its
    range."""
    texts = ["300", "256"]
    if world.world_size > 1:
        texts.append(f"failed on 1 rank(s): rank {world.world_size - 1}: ")
    return texts


def flat_engine(world, kind):
    """(engine, this rank's rows of a batch) for the engines whose forward takes local rows."""
    if kind in ("dp", "zero1", "zero3"):
        model = GPT(CFG, seed=0)
        engine = (DataParallel(model, world) if kind == "dp"
                  else ZeroDataParallel(model, world, stage=int(kind[-1])))
        return engine, lambda a: local_slice(world, a)
    dp = 2 if kind.endswith("dp2") and world.world_size % 2 == 0 else 1
    mesh = DeviceMesh(dp=dp, tp=world.world_size // dp, pp=1, sp=1, group=world)
    model = ParallelGPT(CFG, mesh, seed=0)
    engine = (HybridParallel(model) if kind.startswith("hybrid")
              else ZeroHybridParallel(model, stage=3))
    return engine, lambda a: a[mesh.batch_slice(GLOBAL_BATCH)]


@pytest.mark.parametrize("kind", ["dp", "zero1", "zero3", "hybrid", "hybrid-dp2",
                                  "zero_hybrid-dp2"])
def test_a_bad_token_on_one_rank_raises_on_every_rank(world, kind, assert_raised_on_every_rank):
    engine, rows = flat_engine(world, kind)
    x, y = global_batch(0)
    bad = spoil_on_last_rank(world, rows(x))
    assert_raised_on_every_rank(world, lambda: engine.forward(bad, rows(y)), ConfigError,
                                match=expected(world))
    loss, cache = engine.forward(rows(x), rows(y))  # the engine still runs a good step
    engine.backward(cache)
    assert np.isfinite(loss)


@pytest.mark.parametrize("built", ["mesh", "groups"])
def test_a_bad_token_on_one_pipeline_rank_raises_on_every_rank(world, built,
                                                               assert_raised_on_every_rank):
    n = world.world_size
    dp = 2 if n == 4 else 1
    mesh = DeviceMesh(dp=dp, tp=1, pp=n // dp, sp=1, group=world)
    model, m = GPT(CFG, seed=0), n // dp
    engine = (PipelineParallel.from_mesh(model, mesh, micro_batches=m) if built == "mesh" else
              PipelineParallel(model, mesh.group("pp"), mesh.group("dp"), micro_batches=m))
    x, y = global_batch(0)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    bad = spoil_on_last_rank(world, x[rows])
    err = assert_raised_on_every_rank(world, lambda: engine.train_step(bad, y[rows]), ConfigError,
                                      match=expected(world) + ["x must hold integer token ids"])
    assert ", 300]" in str(err)  # the offending range
    assert np.isfinite(engine.train_step(x[rows], y[rows]))  # nothing was left half-sent
