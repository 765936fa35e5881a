"""Pipeline parallelism against the one-process reference on the same global batch.

Layouts come from the world size n: pp = n (one pipeline through every rank) and, for even n,
pp = 2 x dp = n / 2; at n = 1 the pipeline has one stage. Both schedules, tied and untied
embeddings.
"""
import numpy as np
import pytest
from conftest import GLOBAL_BATCH, T, global_batch

from rtxmpi.errors import ConfigError
from rtxmpi.mesh import DeviceMesh
from rtxmpi.nn import GPT, AdamW, GPTConfig, clip_grad_norm, decay_mask
from rtxmpi.parallel.pipeline import PipelineParallel


def make_model(tied=True, dtype=np.float32, n_layer=4):
    cfg = GPTConfig(seq_len=T, n_layer=n_layer, n_head=2, n_embd=32, tie_embeddings=tied)
    return GPT(cfg, seed=3, dtype=dtype)


def layouts(world):
    n = world.world_size
    out = [(1, n)]  # (dp, pp)
    if n % 2 == 0 and n > 2:
        out.append((n // 2, 2))
    return out


def build(world, dp, pp, **kwargs):
    mesh = DeviceMesh(dp=dp, pp=pp, group=world)
    model = kwargs.pop("model", None) or make_model()
    return mesh, PipelineParallel.from_mesh(model, mesh, **kwargs)


def reference_grad(model, x, y):
    _, cache = model.forward(x, y)
    model.backward(cache)
    return model.flat_grad


def check_stage_grads(engine, reference):
    st = engine.stage
    np.testing.assert_allclose(st.flat_grad[:st.own_size],
                               reference.flat_grad[st.flat_start:st.flat_stop], rtol=1e-5, atol=1e-7)
    if st.tied_copy:  # the head's wte copy holds the full (summed) wte gradient too
        np.testing.assert_allclose(st.params[-1].grad, reference.params[0].grad,
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_gradients_match_single_process(world, schedule, tied):
    x, y = global_batch(0)
    reference = make_model(tied)
    reference_grad(reference, x, y)
    ref_loss, _ = make_model(tied).forward(x, y)
    for dp, pp in layouts(world):
        mesh, engine = build(world, dp, pp, model=make_model(tied), micro_batches=4,
                             schedule=schedule)
        rows = mesh.batch_slice(GLOBAL_BATCH)
        loss = engine.train_step(x[rows], y[rows])
        check_stage_grads(engine, reference)
        assert loss == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.mpi(min_size=2)
def test_pipeline_with_a_given_split_matches_single_process(world):
    x, y = global_batch(1)
    reference = make_model()
    reference_grad(reference, x, y)
    pp = world.world_size
    split = [4 - (pp - 1)] + [1] * (pp - 1)  # uneven: the first stage takes the rest
    _, engine = build(world, 1, pp, micro_batches=pp, split=split)
    assert engine.layouts[0] == (0, split[0])
    engine.train_step(x, y)
    check_stage_grads(engine, reference)


def test_pipeline_loss_curve_matches_single_process_over_10_steps(world):
    # float64 (as the DP test): Adam amplifies float32 round-off in near-zero gradients
    def optimizer(params, mask):
        return AdamW(params, lr=1e-2, decay_mask=mask)

    reference = make_model(dtype=np.float64)
    ref_opt = optimizer(reference.flat_data, decay_mask(reference.params, dtype=np.float64))
    ref_losses = []
    for step in range(10):
        x, y = global_batch(step)
        loss, cache = reference.forward(x, y)
        reference.backward(cache)
        clip_grad_norm(reference.flat_grad, 1.0)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        ref_losses.append(loss)
    dp, pp = layouts(world)[-1]
    mesh, engine = build(world, dp, pp, model=make_model(dtype=np.float64), micro_batches=4,
                         optimizer=optimizer)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    losses = []
    for step in range(10):
        x, y = global_batch(step)
        losses.append(engine.train_step(x[rows], y[rows]))
        engine.step(max_grad_norm=1.0)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9)
    full = engine.full_params()  # collective: every rank
    np.testing.assert_allclose(full, reference.flat_data, rtol=1e-6, atol=1e-9)
    st = engine.stage
    if st.tied_copy:  # the two wte copies stay identical
        wte = st.params[-1]
        np.testing.assert_array_equal(wte.data, full[:wte.size].reshape(wte.shape))


def test_eval_loss_is_the_forward_loss_and_leaves_no_gradient(world):
    x, y = global_batch(2)
    ref_loss, _ = make_model().forward(x, y)
    mesh, engine = build(world, 1, world.world_size, micro_batches=world.world_size)
    assert engine.eval_loss(x, y) == pytest.approx(ref_loss, rel=1e-5)
    assert not engine.stage.flat_grad.any()


def test_checkpoint_pieces_cover_every_tensor_once(world):
    _, engine = build(world, *layouts(world)[-1], micro_batches=2)
    pieces = engine.shards()
    for name, (data, offset, size) in pieces.items():
        cover = np.zeros(size, np.int64)
        cover[offset:offset + data.shape[0]] = 1
        world.all_reduce(cover)
        assert (cover == 1).all(), name
    full = engine.full_params()
    reference = make_model()
    np.testing.assert_array_equal(full, reference.flat_data)
    engine.stage.flat_data[...] = 0
    engine.load_shards(lambda name, offset, length: (
        reference.flat_data[offset:offset + length] if name == "params" else
        np.zeros(length, np.int64) if name == "adam.step" else np.zeros(length, np.float32)))
    np.testing.assert_array_equal(engine.full_params(), reference.flat_data)


# -- impossible settings: ConfigError (a ValueError) on every rank, nothing sent -------------------
def nothing_pending(group):
    """No message is waiting on the group's communicator (after a barrier)."""
    group.barrier()
    from mpi4py import MPI
    return not group.backend.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)


@pytest.mark.mpi(min_size=2)
def test_micro_batches_not_dividing_the_batch_raise_on_every_rank(world, assert_raised_on_every_rank):
    mesh, engine = build(world, 1, world.world_size, micro_batches=3, schedule="gpipe")
    x, y = global_batch(0)  # 8 rows, 3 micro-batches
    assert_raised_on_every_rank(world, lambda: engine.train_step(x, y), ValueError,
                                match=["not divisible by micro_batches 3"])
    assert nothing_pending(engine.pp_group)


@pytest.mark.mpi(min_size=2)
def test_1f1b_with_fewer_micro_batches_than_stages_raises_on_every_rank(
        world, assert_raised_on_every_rank):
    err = assert_raised_on_every_rank(
        world, lambda: build(world, 1, world.world_size, micro_batches=1), ValueError,
        match=["1F1B needs micro_batches >= pipeline stages"])
    assert isinstance(err, ConfigError)


@pytest.mark.mpi(min_size=2)
def test_more_stages_than_layers_raise_on_every_rank(world, assert_raised_on_every_rank):
    assert_raised_on_every_rank(
        world, lambda: build(world, 1, world.world_size, model=make_model(n_layer=1),
                             micro_batches=4), ValueError, match=["every stage needs"])


@pytest.mark.mpi(min_size=2)
def test_a_split_that_does_not_fit_raises_on_every_rank(world, assert_raised_on_every_rank):
    assert_raised_on_every_rank(
        world, lambda: build(world, 1, world.world_size, micro_batches=4,
                             split=[5] + [1] * (world.world_size - 1)), ValueError,
        match=["summing to the 4 layers"])


@pytest.mark.mpi(min_size=4)
def test_pipeline_refuses_tensor_parallel_mesh(world, assert_raised_on_every_rank):
    mesh = DeviceMesh(dp=1, tp=2, pp=world.world_size // 2, group=world)
    assert_raised_on_every_rank(
        world, lambda: PipelineParallel.from_mesh(make_model(), mesh, micro_batches=2),
        ConfigError, match=["tp(2)"])
