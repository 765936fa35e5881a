"""Tensor (Megatron, with and without sequence parallelism) and Ulysses sequence parallelism, alone
and with data parallelism, against the one-process GPT on the same global batch.

Every layout with pp = 1 whose product is the world size runs (at -n 4: (4,1,1,1), (2,2,1,1),
(2,1,1,2), (1,4,1,1), (1,2,1,2), (1,1,1,4)); the others are skipped."""
import numpy as np
import pytest
from conftest import GLOBAL_BATCH, T, global_batch

from rtxmpi.errors import ConfigError
from rtxmpi.mesh import DeviceMesh
from rtxmpi.nn import GPT, AdamW, GPTConfig, decay_mask
from rtxmpi.parallel.hybrid import HybridParallel, ParallelGPT

# (dp, tp, sp): pp = 1 here (pipeline layouts: tests/mpi/test_pipeline.py)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (4, 1, 1), (2, 2, 1), (2, 1, 2),
           (1, 4, 1), (1, 2, 2), (1, 1, 4)]


def config(**overrides):
    return GPTConfig(**{"vocab_size": 256, "seq_len": T, "n_layer": 2, "n_head": 4, "n_embd": 32,
                        **overrides})


def mesh_or_skip(world, dp, tp, sp):
    if dp * tp * sp != world.world_size:
        pytest.skip(f"layout dp={dp} tp={tp} sp={sp} needs {dp * tp * sp} ranks")
    return DeviceMesh(dp=dp, tp=tp, pp=1, sp=sp, group=world)


def degree_or_skip(world):
    """The world size as a tp or sp degree: it must divide T (16), the vocabulary (256) and the
    test models' widths, i.e. be a power of two up to 16."""
    n = world.world_size
    if T % n:
        pytest.skip(f"world size {n} does not divide T={T} and vocab_size=256")
    return n


def reference_grads(cfg, dtype, step=0):
    model = GPT(cfg, seed=0, dtype=dtype)
    x, y = global_batch(step)
    loss, cache = model.forward(x, y)
    model.backward(cache)
    return loss, model.flat_grad


def parallel_grads(mesh, cfg, dtype, sequence_parallel=False, step=0):
    engine = HybridParallel(ParallelGPT(cfg, mesh, seed=0, dtype=dtype,
                                        sequence_parallel=sequence_parallel))
    x, y = global_batch(step)
    rows = mesh.batch_slice(GLOBAL_BATCH)
    loss, cache = engine.forward(x[rows], y[rows])
    engine.backward(cache)
    losses = np.array([loss])
    mesh.loss_group.all_reduce(losses, op="avg")
    return float(losses[0]), engine.model.gather_full(engine.model.flat_grad), engine, cache


@pytest.mark.parametrize("dp,tp,sp", LAYOUTS)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["", "megatron_sp"])
def test_gradients_match_single_process(world, dp, tp, sp, sequence_parallel):
    if sequence_parallel and tp == 1:
        pytest.skip("Megatron sequence parallelism splits over tp")
    mesh = mesh_or_skip(world, dp, tp, sp)
    cfg = config()
    ref_loss, ref_grad = reference_grads(cfg, np.float32)
    loss, grad, _, _ = parallel_grads(mesh, cfg, np.float32, sequence_parallel)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=2e-7)


@pytest.mark.parametrize("dp,tp,sp", LAYOUTS)
def test_untied_head_float64_gradients_match_tightly(world, dp, tp, sp):
    mesh = mesh_or_skip(world, dp, tp, sp)
    cfg = config(tie_embeddings=False)
    ref_loss, ref_grad = reference_grads(cfg, np.float64)
    loss, grad, _, _ = parallel_grads(mesh, cfg, np.float64, sequence_parallel=tp > 1)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.mpi(min_size=2)
def test_megatron_sequence_parallel_shards_layernorm_regions_along_the_sequence(world):
    n = degree_or_skip(world)
    mesh = DeviceMesh(dp=1, tp=n, group=world)
    _, _, engine, cache = parallel_grads(mesh, config(n_head=4 * n), np.float32, True)
    xhat = cache.units[1][0][0]  # block 0's LayerNorm 1 input, normalized: this rank's positions
    assert xhat.shape == (GLOBAL_BATCH, T // n, 32)
    x, y = global_batch(0)
    assert engine.model.params[0].data.shape == (256 // n, 32)  # vocabulary split


@pytest.mark.mpi(min_size=2)
def test_ulysses_attention_sees_the_full_sequence_from_a_shard(world):
    n = degree_or_skip(world)
    mesh = DeviceMesh(dp=1, sp=n, group=world)
    _, _, _, cache = parallel_grads(mesh, config(n_head=2 * n), np.float32)
    assert cache.units[0][1] == world.rank * (T // n)  # first position of this rank's positions
    assert cache.units[1][0][0].shape == (GLOBAL_BATCH, T // n, 32)
    att = cache.units[1][1][1][0][3]  # block 0's attention probabilities of this rank's heads
    assert att.shape == (GLOBAL_BATCH, 2, T, T)


@pytest.mark.parametrize("dp,tp,sp", [(2, 2, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (4, 1, 1),
                                      (1, 4, 1), (1, 1, 4)])
def test_loss_curve_and_parameters_match_single_process_over_10_adamw_steps(world, dp, tp, sp):
    mesh = mesh_or_skip(world, dp, tp, sp)
    cfg = config()
    reference = GPT(cfg, seed=0, dtype=np.float64)
    ref_opt = AdamW(reference.flat_data, lr=1e-2, decay_mask=decay_mask(reference.params))
    engine = HybridParallel(ParallelGPT(cfg, mesh, seed=0, dtype=np.float64,
                                        sequence_parallel=tp > 1),
                            optimizer=lambda p, m: AdamW(p, lr=1e-2, decay_mask=m))
    rows = mesh.batch_slice(GLOBAL_BATCH)
    for step in range(10):
        x, y = global_batch(step)
        ref_loss, cache = reference.forward(x, y)
        reference.backward(cache)
        ref_norm = float(np.sqrt((reference.flat_grad ** 2).sum()))
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        loss, cache = engine.forward(x[rows], y[rows])
        engine.backward(cache)
        losses = np.array([loss])
        mesh.loss_group.all_reduce(losses, op="avg")
        assert losses[0] == pytest.approx(ref_loss, rel=1e-9), f"step {step}"
        assert engine.grad_norm() == pytest.approx(ref_norm, rel=1e-9)
        engine.step()
    np.testing.assert_allclose(engine.full_params(), reference.flat_data, rtol=1e-8, atol=1e-10)


@pytest.mark.mpi(min_size=2)
def test_heads_vocab_and_width_not_divisible_by_tp_raise(world, assert_raised_on_every_rank):
    n = degree_or_skip(world)
    mesh = DeviceMesh(dp=1, tp=n, group=world)
    assert_raised_on_every_rank(world, lambda: ParallelGPT(config(n_head=1, n_embd=n * 8), mesh),
                                ConfigError, match=["n_head (1)", f"tp={n}"])
    assert_raised_on_every_rank(world, lambda: ParallelGPT(config(vocab_size=4 * n + 1), mesh),
                                ConfigError, match=[f"vocab_size ({4 * n + 1})"])


@pytest.mark.mpi(min_size=2)
def test_sequence_or_heads_not_divisible_by_sp_raise(world, assert_raised_on_every_rank):
    n = degree_or_skip(world)
    mesh = DeviceMesh(dp=1, sp=n, group=world)
    assert_raised_on_every_rank(world, lambda: ParallelGPT(config(n_head=1, n_embd=16), mesh),
                                ConfigError, match=["1 attention heads", f"sp({n})"])
    engine = HybridParallel(ParallelGPT(config(n_head=n), mesh))
    x, y = global_batch(0)
    assert_raised_on_every_rank(world, lambda: engine.forward(x[:, :T - 1], y[:, :T - 1]),
                                ConfigError, match=[f"sequence length {T - 1}", f"sp({n})"])


@pytest.mark.mpi(min_size=2)
def test_tp_ranks_fed_different_tokens_raise_in_checking_mode(world, assert_raised_on_every_rank):
    n = degree_or_skip(world)
    mesh = DeviceMesh(dp=1, tp=n, group=world)
    model = ParallelGPT(config(n_head=4 * n), mesh)
    x, y = global_batch(0)
    x = (x + world.rank) % 256  # each tp rank a different batch
    assert_raised_on_every_rank(world, lambda: model.forward(x, y), ConfigError,
                                match=["fed different tokens"])


@pytest.mark.mpi(min_size=2)
def test_micro_batches_under_no_sync_accumulate_the_whole_batch_gradient(world):
    n = world.world_size
    if n % 2:
        pytest.skip("needs an even world size (sp = 2)")
    mesh = DeviceMesh(dp=1, tp=n // 2, sp=2, group=world)
    cfg = config(n_head=4 * n)
    _, ref_grad = reference_grads(cfg, np.float64)
    engine = HybridParallel(ParallelGPT(cfg, mesh, dtype=np.float64, sequence_parallel=n > 2))
    x, y = global_batch(0)
    half = GLOBAL_BATCH // 2
    _, cache = engine.forward(x[:half], y[:half])
    with engine.no_sync():
        engine.backward(cache, scale=0.5)
    _, cache = engine.forward(x[half:], y[half:])
    engine.backward(cache, scale=0.5)
    grad = engine.model.gather_full(engine.model.flat_grad)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)
