"""A global batch that does not divide by the data-parallel size (8 over 3 ranks: 3, 3, 2): the
split keeps the one-process sample order, and weighting each (micro-)batch by its samples makes
the sum-then-average of the ranks' gradients the one-process mean over the global batch. The ranks
are simulated in one process with the same arithmetic DataParallel does (sum, then the epilogue's
1/dp); tests/mpi/test_data_parallel.py runs it through the real engines. float64, so the check
is on the weighting, not on float32 rounding (whose noise, ~5e-7 relative, differs by split)."""
import numpy as np
import pytest

from rtxmpi import data
from rtxmpi.errors import ConfigError
from rtxmpi.kernels import grad_epilogue
from rtxmpi.nn import GPT, GPTConfig
from rtxmpi.parallel.data import grad_scale, weighted_micro_batches

TOKENS = np.random.default_rng(5).integers(0, 256, 8192).astype(np.uint8)
T = 16


def rank_batches(global_batch, dp_size, seed=3):
    return [data.BatchSampler(TOKENS, T, global_batch, seed=seed, dp_rank=r,
                              dp_size=dp_size).next_batch() for r in range(dp_size)]


def simulated_dp(global_batch, dp_size, micro_batches):
    """(gradient, reported loss) of dp_size simulated ranks, as examples/train.py computes them."""
    total, losses = None, []
    for x, y in rank_batches(global_batch, dp_size):
        model = GPT(GPTConfig.named("tiny", seq_len=T), seed=0, dtype=np.float64)
        loss_sum = 0.0
        for x_m, y_m, scale, weight in weighted_micro_batches(x, y, micro_batches, global_batch,
                                                              dp_size):
            loss, cache = model.forward(x_m, y_m)
            loss_sum += loss * weight
            model.backward(cache, scale=scale)
        losses.append(float(loss_sum / micro_batches))
        total = model.flat_grad.copy() if total is None else total + model.flat_grad
    grad_epilogue(total, 1.0 / dp_size)  # all_reduce(sum), then DataParallel's average
    return total, sum(losses) / dp_size   # the loss: all_reduce(op="avg")


def one_process(global_batch):
    x, y = rank_batches(global_batch, 1)[0]
    model = GPT(GPTConfig.named("tiny", seq_len=T), seed=0, dtype=np.float64)
    loss, cache = model.forward(x, y)
    model.backward(cache)
    return model.flat_grad, float(loss)


@pytest.mark.parametrize("global_batch, dp_size, micro_batches",
                         [(8, 3, 1), (8, 3, 2), (7, 4, 1), (9, 2, 3)])
def test_uneven_split_gradient_and_loss_equal_the_one_process_mean(global_batch, dp_size,
                                                                   micro_batches):
    grad, loss = simulated_dp(global_batch, dp_size, micro_batches)
    ref_grad, ref_loss = one_process(global_batch)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert loss == pytest.approx(ref_loss, rel=1e-12)


def test_plain_average_of_uneven_ranks_would_be_wrong():
    """The weighting is needed: averaging the 3 ranks' mean gradients (3, 3, 2 samples) differs."""
    ref_grad, _ = one_process(8)
    plain = np.mean([simulated_dp(len(x), 1, 1)[0] for x, _ in rank_batches(8, 3)], axis=0)
    assert not np.allclose(plain, ref_grad, rtol=1e-3, atol=1e-6)


def test_even_split_scale_is_exactly_one_over_k_and_weight_one():
    x, y = rank_batches(12, 4)[1]
    parts = list(weighted_micro_batches(x, y, 3, 12, 4))
    assert [len(x_m) for x_m, *_ in parts] == [1, 1, 1]
    assert all(scale == 1.0 / 3 and weight == 1.0 for *_, scale, weight in parts)  # bitwise
    assert grad_scale(3, 12, 4) == 1.0 and grad_scale(3, 8, 3) == 9 / 8


def test_micro_batches_split_unevenly_and_keep_the_sample_order():
    x, y = rank_batches(8, 3)[0]  # 3 samples
    parts = list(weighted_micro_batches(x, y, 2, 8, 3))
    assert [len(x_m) for x_m, *_ in parts] == [2, 1]
    np.testing.assert_array_equal(np.concatenate([x_m for x_m, *_ in parts]), x)
    assert [scale for *_, scale, _ in parts] == [2 * 3 / 8, 1 * 3 / 8]


def test_more_micro_batches_than_samples_raise_config_error():
    for x, y in rank_batches(8, 3):  # 3, 3, 2 samples: every rank raises, not only the last
        with pytest.raises(ConfigError, match="leaves 2 samples on the smallest rank, fewer than "
                                              "3 micro-batches"):
            list(weighted_micro_batches(x, y, 3, 8, 3))
