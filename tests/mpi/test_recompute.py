"""Activation recomputation under the data-parallel engines: DataParallel's bucket reductions and
ZeRO stage 3's parameter provider give bitwise what they give without it, at any world size."""
import numpy as np
import pytest
from conftest import T, global_batch, local_slice

from rtxmpi.nn import GPT, AdamW, GPTConfig, decay_mask
from rtxmpi.parallel.data import DataParallel
from rtxmpi.parallel.zero import ZeroDataParallel

STEPS = 3


def make_model(dtype, recompute):
    return GPT(GPTConfig.named("tiny", seq_len=T), seed=0, dtype=dtype, recompute=recompute)


def dp_run(world, dtype, recompute):
    """STEPS AdamW steps under DataParallel with buckets small enough to overlap; returns the
    per-step losses, the last averaged gradient and the parameters."""
    model = make_model(dtype, recompute)
    ddp = DataParallel(model, world, bucket_bytes=model.flat_grad.nbytes // 5)
    ready, order = ddp.reducer.ready, []
    ddp.reducer.ready = lambda u: (order.append((u, ddp.reducer.launched)), ready(u))
    opt = AdamW(model.flat_data, lr=1e-2, decay_mask=decay_mask(model.params, dtype=model.dtype))
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        model.zero_grad()
        loss, cache = ddp.forward(local_slice(world, x), local_slice(world, y))
        ddp.backward(cache)
        grad = model.flat_grad.copy()
        ddp.step(opt)
        losses.append(loss)
    return losses, grad, model.flat_data.copy(), order


def zero3_run(world, dtype, recompute):
    """STEPS steps of ZeroDataParallel stage 3; the losses, the last gradient shard, the
    parameters and the engine."""
    model = make_model(dtype, recompute)
    zdp = ZeroDataParallel(model, world, stage=3,
                           optimizer=lambda params, mask: AdamW(params, lr=1e-2, decay_mask=mask))
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        loss, cache = zdp.forward(local_slice(world, x), local_slice(world, y))
        zdp.backward(cache)
        grad = zdp.grad_shard().copy()
        zdp.step()
        losses.append(loss)
    return losses, grad, zdp.full_params(), zdp


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dp_with_recomputed_blocks_is_bitwise_dp_without(world, dtype, assert_same_on_every_rank):
    loss0, grad0, params0, order0 = dp_run(world, dtype, "none")
    loss1, grad1, params1, order1 = dp_run(world, dtype, "blocks")
    assert loss1 == loss0
    assert np.array_equal(grad1, grad0) and np.array_equal(params1, params0)
    assert_same_on_every_rank(world, params1)
    # the same parameters were reported in the same order, each bucket launched at the same point
    assert order1 == order0 and order0[-1][1] > 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero3_with_recomputed_blocks_is_bitwise_zero3_without(world, dtype):
    loss0, grad0, params0, zdp0 = zero3_run(world, dtype, "none")
    loss1, grad1, params1, zdp1 = zero3_run(world, dtype, "blocks")
    assert loss1 == loss0
    assert np.array_equal(grad1, grad0) and np.array_equal(params1, params0)
    # the recompute runs on the parameters backward gathers anyway: no extra gather
    p0, p1 = zdp0.provider, zdp1.provider
    assert (p1.gathers, p1.prefetches, p1.prefetch_hits, p1.reductions) == (
        p0.gathers, p0.prefetches, p0.prefetch_hits, p0.reductions)


@pytest.mark.mpi(min_size=2)
def test_zero3_recomputing_the_embedding_unit_gathers_it_once_more_per_backward(world):
    loss0, grad0, params0, zdp0 = zero3_run(world, np.float64, "none")
    loss1, grad1, params1, zdp1 = zero3_run(world, np.float64, [0, 1])
    assert loss1 == loss0
    assert np.array_equal(grad1, grad0) and np.array_equal(params1, params0)
    # tied: the head's backward fetches unit 0 and releases it; the recompute gathers it again
    assert zdp1.provider.gathers == zdp0.provider.gathers + STEPS
    assert zdp1.provider.prefetch_hits >= zdp0.provider.prefetch_hits
