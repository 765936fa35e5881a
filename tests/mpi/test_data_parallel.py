"""Data parallelism against the one-process reference on the same global batch."""
from contextlib import nullcontext

import numpy as np
import pytest
from conftest import GLOBAL_BATCH, T, global_batch, local_slice

from rtxmpi.errors import RtxmpiError
from rtxmpi.nn import GPT, AdamW, GPTConfig, decay_mask
from rtxmpi.parallel.data import DataParallel


def make_model(seed=0, dtype=np.float32):
    return GPT(GPTConfig.named("tiny", seq_len=T), seed=seed, dtype=dtype)


def small_buckets(model):
    """Bucket size that splits the tiny model into several buckets (exercises overlap)."""
    return model.flat_grad.nbytes // 5


def test_wrapping_broadcasts_parameters_from_rank_0(world):
    model = make_model(seed=world.rank)  # deliberately different on every rank
    DataParallel(model, world)
    reference = make_model(seed=0)
    np.testing.assert_array_equal(model.flat_data, reference.flat_data)


def test_buckets_are_identical_on_every_rank_and_cover_all_parameters(world):
    model = make_model()
    ddp = DataParallel(model, world, bucket_bytes=small_buckets(model))
    spans = np.array([(b.start, b.stop) for b in ddp.buckets], np.int64)
    assert len(ddp.buckets) > 1
    assert spans[-1, 0] == 0 and spans[0, 1] == model.flat_grad.size
    assert (spans[:-1, 0] == spans[1:, 1]).all()  # contiguous, launch order = reverse index
    gathered = world.all_gather(spans.reshape(-1))
    assert (gathered.reshape(world.world_size, -1) == spans.reshape(-1)).all()


@pytest.mark.parametrize("bucket_kind", ["one", "several"])
def test_dp_gradients_match_single_process(world, bucket_kind):
    x, y = global_batch(0)
    reference = make_model()
    _, cache = reference.forward(x, y)
    reference.backward(cache)

    model = make_model()
    ddp = DataParallel(model, world, bucket_bytes=(2**30 if bucket_kind == "one"
                                                   else small_buckets(model)))
    _, cache = ddp.forward(local_slice(world, x), local_slice(world, y))
    ddp.backward(cache)
    np.testing.assert_allclose(model.flat_grad, reference.flat_grad, rtol=1e-5, atol=1e-7)


def test_dp_parameters_match_single_process_after_10_adamw_steps(world):
    # float64: Adam divides by sqrt(v), which turns float32 round-off in near-zero gradients into
    # full-size update differences; in float64 any real DP error still shows, round-off does not
    reference, model = make_model(dtype=np.float64), make_model(dtype=np.float64)
    ref_opt = AdamW(reference.flat_data, lr=1e-2, decay_mask=decay_mask(reference.params))
    ddp = DataParallel(model, world, bucket_bytes=small_buckets(model))
    opt = AdamW(model.flat_data, lr=1e-2, decay_mask=decay_mask(model.params))
    for step in range(10):
        x, y = global_batch(step)
        _, cache = reference.forward(x, y)
        reference.backward(cache)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        _, cache = ddp.forward(local_slice(world, x), local_slice(world, y))
        ddp.backward(cache)
        ddp.step(opt)
    np.testing.assert_allclose(model.flat_data, reference.flat_data, rtol=1e-4, atol=1e-6)


def test_no_sync_accumulates_then_reduces_the_sum(world):
    x, y = global_batch(0)
    half = GLOBAL_BATCH // 2
    reference = make_model()
    for part in (slice(0, half), slice(half, None)):
        _, cache = reference.forward(x[part], y[part])
        reference.backward(cache, scale=0.5)

    model = make_model()
    ddp = DataParallel(model, world, bucket_bytes=small_buckets(model))
    parts = [(x[:half], y[:half]), (x[half:], y[half:])]
    for i, (xp, yp) in enumerate(parts):
        _, cache = ddp.forward(local_slice(world, xp), local_slice(world, yp))
        if i == 0:
            with ddp.no_sync():
                ddp.backward(cache, scale=0.5)
        else:
            ddp.backward(cache, scale=0.5)
    np.testing.assert_allclose(model.flat_grad, reference.flat_grad, rtol=1e-5, atol=1e-7)


def test_step_refuses_without_a_synchronized_backward(world):
    model = make_model()
    ddp = DataParallel(model, world)
    opt = AdamW(model.flat_data)
    x, y = global_batch(0)
    _, cache = ddp.forward(local_slice(world, x), local_slice(world, y))
    with ddp.no_sync():
        ddp.backward(cache)
    with pytest.raises(RtxmpiError, match="synchronized backward"):
        ddp.step(opt)
    ddp.backward(cache)
    ddp.step(opt)
    with pytest.raises(RtxmpiError, match="synchronized backward"):
        ddp.step(opt)  # twice without a new backward


def one_process_step(x, y, lr=1e-2):
    """Parameters of the float64 one-process model after one AdamW step on (x, y)."""
    reference = make_model(dtype=np.float64)
    _, cache = reference.forward(x, y)
    reference.backward(cache)
    AdamW(reference.flat_data, lr=lr, decay_mask=decay_mask(reference.params)).step(
        reference.flat_grad)
    return reference.flat_data


@pytest.mark.mpi(min_size=2)
def test_step_after_a_synced_then_a_no_sync_backward_is_refused_on_every_rank(
        world, assert_raised_on_every_rank):
    """The first micro-batch synchronized, the last under no_sync: the last one's gradient never
    reached the other replicas, so step refuses on every rank and changes nothing; after
    zero_grad, the right order (no_sync first) steps to the one-process parameters."""
    x, y = global_batch(0)
    half = GLOBAL_BATCH // 2
    parts = [(x[:half], y[:half]), (x[half:], y[half:])]
    model = make_model(dtype=np.float64)
    ddp = DataParallel(model, world, bucket_bytes=small_buckets(model))
    opt = AdamW(model.flat_data, lr=1e-2, decay_mask=decay_mask(model.params))
    before = model.flat_data.copy()
    for order in ("synced first", "no_sync first"):
        for i, (xp, yp) in enumerate(parts):
            _, cache = ddp.forward(local_slice(world, xp), local_slice(world, yp))
            with ddp.no_sync() if (i == 0) == (order == "no_sync first") else nullcontext():
                ddp.backward(cache, scale=0.5)
        if order == "synced first":
            assert_raised_on_every_rank(world, lambda: ddp.step(opt), RtxmpiError,
                                        match=["under no_sync()"])
            np.testing.assert_array_equal(model.flat_data, before)
            ddp.zero_grad()
    ddp.step(opt)
    np.testing.assert_allclose(model.flat_data, one_process_step(x, y), rtol=1e-9, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_uneven_batches_finish_together_with_equal_weights(world):
    model = make_model()
    ddp = DataParallel(model, world, bucket_bytes=small_buckets(model))
    opt = AdamW(model.flat_data, lr=1e-2)
    x, y = global_batch(0)
    b = GLOBAL_BATCH // world.world_size
    n_batches = 3 if world.rank == 0 else 5  # rank 0 runs out first
    batches = [(local_slice(world, x), local_slice(world, y))] * n_batches
    steps = 0
    for xb, yb in ddp.join(batches):
        _, cache = ddp.forward(xb, yb)
        ddp.backward(cache)
        ddp.step(opt)
        steps += 1
    assert steps == 3
    assert b > 0
    weights = world.all_gather(model.flat_data.copy()).reshape(world.world_size, -1)
    for r in range(1, world.world_size):
        np.testing.assert_array_equal(weights[r], weights[0])


def test_dp_gradients_in_shared_memory_fold_straight_from_the_peers(world):
    """GPT(grad_alloc=rtxmpi.shared_zeros): the same gradients as the one-process reference, and
    on one node with the compiled extension the buckets' all_reduces fold straight from the
    peers' gradient memory (direct_calls)."""
    from rtxmpi import shared_zeros

    x, y = global_batch(0)
    reference = make_model()
    _, cache = reference.forward(x, y)
    reference.backward(cache)
    model = GPT(GPTConfig.named("tiny", seq_len=T), seed=0, grad_alloc=shared_zeros)
    ddp = DataParallel(model, world, bucket_bytes=small_buckets(model) // 4)
    world.all_reduce(np.zeros(1, np.float32))  # the group's shared-memory engine exists from here
    engine = world.backend._shm if world.world_size > 1 else None
    direct = engine.mailbox.direct_calls if engine and engine.mailbox is not None else None
    before = direct() if direct else 0
    _, cache = ddp.forward(local_slice(world, x), local_slice(world, y))
    ddp.backward(cache)
    np.testing.assert_allclose(model.flat_grad, reference.flat_grad, rtol=1e-5, atol=1e-7)
    if direct:  # the buckets above the mailbox size
        big = sum(1 for b in ddp.buckets if (b.stop - b.start) * 4 > engine.small_bytes)
        assert big and direct() - before == big


def test_grad_alloc_must_return_a_fitting_array():
    from rtxmpi.errors import ConfigError

    cfg = GPTConfig.named("tiny", seq_len=T)
    with pytest.raises(ConfigError, match="grad_alloc returned"):
        GPT(cfg, grad_alloc=lambda n, dtype: np.zeros(n + 1, dtype))
    with pytest.raises(ConfigError, match="grad_alloc returned"):
        GPT(cfg, grad_alloc=lambda n, dtype: np.zeros(n, np.float64))
