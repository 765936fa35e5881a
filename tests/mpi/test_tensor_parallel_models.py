"""Tensor and sequence parallelism of Models other than the GPT, built from the shipped modules,
against the same Model in one process: a bidirectional token encoder (every parallel module,
alone and in a TransformerBlock) and a small vision transformer (PatchEmbedding, a
ClassificationHead), and the layouts a model refuses.

Every layout with pp = 1 whose product is the world size runs; the others are skipped."""
import numpy as np
import pytest
from conftest import GLOBAL_BATCH, T, global_batch

from rtxmpi.errors import ConfigError
from rtxmpi.mesh import DeviceMesh
from rtxmpi.nn import AdamW, decay_mask
from rtxmpi.nn.module import Model, Module, ParamDecl, Sequential
from rtxmpi.nn.vit import ViT, ViTConfig
from rtxmpi.nn.modules import (MLP, ClassificationHead, ClassToken, ClassTokenHead, Embedding,
                               LayerNorm, Linear, LMHead, MultiHeadAttention, PatchEmbedding,
                               PositionalEmbedding, TransformerBlock)
from rtxmpi.parallel.hybrid import HybridParallel, TensorParallelModel, build_hybrid
from rtxmpi.parallel.replica import full_index

V, C, H, K = 256, 32, 4, 5
IMAGE = (4, 8, 3)  # Hi, Wi, Ci: 2x2 patches -> 8 positions (split over sp = 2 and 4)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (4, 1, 1), (2, 2, 1), (2, 1, 2),
           (1, 4, 1), (1, 2, 2), (1, 1, 4)]


def encoder():
    """A bidirectional token model with an untied head: every module with a parallel version."""
    return [Sequential(Embedding(V, C, "tok"), PositionalEmbedding(T, C, "pos")),
            ("h0", TransformerBlock(C, H, causal=False)),
            Sequential(("attn", MultiHeadAttention(C, H, causal=False)), ("mlp", MLP(C))),
            Sequential(("ln", LayerNorm(C)), ("up", Linear(C, 2 * C, split="column")),
                       ("down", Linear(2 * C, C, split="row")), ("mix", Linear(C, C, split="replicated"))),
            Sequential(("ln_f", LayerNorm(C)), LMHead(V, C, name="out"))]


def vit():
    """A small vision transformer: patches, positions, bidirectional blocks, a classifier."""
    n_patches = (IMAGE[0] // 2) * (IMAGE[1] // 2)
    return [Sequential(("patch", PatchEmbedding(2, IMAGE[2], C)),
                       PositionalEmbedding(n_patches, C, name="pos"))] + [
        (f"h{l}", TransformerBlock(C, H, causal=False)) for l in range(2)] + [
        Sequential(("ln_f", LayerNorm(C)), ("head", ClassificationHead(C, K)))]


def images(step):
    rng = np.random.default_rng(step)
    return rng.standard_normal((GLOBAL_BATCH,) + IMAGE), rng.integers(0, K, GLOBAL_BATCH)


def mesh_or_skip(world, dp, tp, sp):
    if dp * tp * sp != world.world_size:
        pytest.skip(f"layout dp={dp} tp={tp} sp={sp} needs {dp * tp * sp} ranks")
    return DeviceMesh(dp=dp, tp=tp, pp=1, sp=sp, group=world)


def gradients(engine, x, y):
    """(loss averaged over the loss group, the one-process layout's gradient) of one step."""
    mesh = engine.mesh
    rows = mesh.batch_slice(GLOBAL_BATCH)
    loss, cache = engine.forward(x[rows], y[rows])
    engine.backward(cache)
    losses = np.array([loss])
    mesh.loss_group.all_reduce(losses, op="avg")
    return float(losses[0]), engine.model.gather_full(engine.model.flat_grad)


def reference_gradients(units, x, y):
    model = Model(units, seed=0, dtype=np.float64)
    loss, cache = model.forward(x, y)
    model.backward(cache)
    return loss, model.flat_grad


@pytest.mark.parametrize("dp,tp,sp", LAYOUTS)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["", "megatron_sp"])
def test_encoder_gradients_match_single_process(world, dp, tp, sp, sequence_parallel):
    if sequence_parallel and tp == 1:
        pytest.skip("Megatron sequence parallelism splits over tp")
    mesh = mesh_or_skip(world, dp, tp, sp)
    x, y = global_batch(0)
    ref_loss, ref_grad = reference_gradients(encoder(), x, y)
    engine = HybridParallel(TensorParallelModel(encoder(), mesh, dtype=np.float64,
                                                sequence_parallel=sequence_parallel))
    loss, grad = gradients(engine, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("dp,tp,sp", LAYOUTS)
def test_vit_gradients_and_three_adamw_steps_match_single_process(world, dp, tp, sp):
    """Under sp the patches and positions run whole on every sp rank, the blocks on T/sp
    positions, the classifier on the gathered sequence."""
    mesh_or_skip(world, dp, tp, sp)
    reference = Model(vit(), seed=0, dtype=np.float64)
    ref_opt = AdamW(reference.flat_data, lr=1e-2, decay_mask=decay_mask(reference.params))
    engine = build_hybrid(vit(), world, dp=dp, tp=tp, sp=sp, dtype=np.float64,
                          optimizer=lambda p, m: AdamW(p, lr=1e-2, decay_mask=m))
    np.testing.assert_array_equal(engine.full_params(), reference.flat_data)  # the same init
    for step in range(3):
        x, y = images(step)
        ref_loss, cache = reference.forward(x, y)
        reference.backward(cache)
        loss, grad = gradients(engine, x, y)
        assert loss == pytest.approx(ref_loss, rel=1e-12), f"step {step}"
        np.testing.assert_allclose(grad, reference.flat_grad, rtol=1e-8, atol=1e-12)
        assert engine.grad_norm() == pytest.approx(np.linalg.norm(reference.flat_grad), rel=1e-10)
        ref_opt.step(reference.flat_grad)
        reference.zero_grad()
        engine.step()
        engine.zero_grad()
    np.testing.assert_allclose(engine.full_params(), reference.flat_data, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("dp,tp,sp", [layout for layout in LAYOUTS if layout[2] > 1])
def test_vit_under_sp_with_zero3_and_recomputed_blocks_matches_single_process(world, dp, tp, sp):
    mesh_or_skip(world, dp, tp, sp)
    x, y = images(0)
    ref_loss, ref_grad = reference_gradients(vit(), x, y)
    engine = build_hybrid(vit(), world, dp=dp, tp=tp, sp=sp, dtype=np.float64, zero_stage=3)
    engine.model.recompute = "blocks"
    mesh = engine.mesh
    loss, cache = engine.forward(*(a[mesh.batch_slice(GLOBAL_BATCH)] for a in (x, y)))
    engine.backward(cache)
    losses = np.array([loss])
    mesh.loss_group.all_reduce(losses, op="avg")
    zero = engine.zero  # the one-process gradient from the ZeRO shards
    shard = np.zeros(-(-zero.numel // zero.group.world_size))
    shard[:len(zero.grad_shard())] = zero.grad_shard()
    grad = engine.model.gather_full(zero.group.all_gather(shard)[:zero.numel])
    assert losses[0] == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)


def test_replica_positions_follow_the_model_shards(world):
    """Elastic recovery rebuilds replicas from full_index: each local element's position in the
    one-process layout."""
    mesh = DeviceMesh(dp=1, tp=world.world_size, group=world)
    model = TensorParallelModel(encoder(), mesh, dtype=np.float64)
    full = Model(encoder(), seed=0, dtype=np.float64).flat_data
    np.testing.assert_array_equal(model.flat_data, full[full_index(model)])


@pytest.mark.parametrize("dp,tp,sp", [(1, 1, 1), (1, 2, 1), (1, 1, 2), (1, 4, 1), (1, 2, 2)])
def test_a_model_is_split_with_its_current_values(world, dp, tp, sp):
    mesh = mesh_or_skip(world, dp, tp, sp)
    model = Model(encoder(), seed=0, dtype=np.float64)
    model.flat_data += np.random.default_rng(1).standard_normal(model.num_params)
    split = TensorParallelModel(model, mesh, seed=5, dtype=np.float64)
    assert [p.name for p in split.params] == [p.name for p in model.params]
    np.testing.assert_array_equal(split.gather_full(split.flat_data), model.flat_data)


@pytest.mark.parametrize("dp,tp,sp,sequence_parallel", [(1, 2, 1, True), (1, 1, 2, False),
                                                        (1, 4, 1, False), (1, 2, 2, True)])
def test_recomputed_blocks_give_bitwise_the_same_gradients(world, dp, tp, sp, sequence_parallel):
    mesh = mesh_or_skip(world, dp, tp, sp)
    x, y = global_batch(0)
    grads = []
    for recompute in ("none", "blocks"):
        model = TensorParallelModel(encoder(), mesh, dtype=np.float64,
                                    sequence_parallel=sequence_parallel)
        model.recompute = recompute
        loss, cache = model.forward(x, y, full_sequence=True)
        assert (cache.units[1] is None) == (recompute == "blocks")  # only the input kept
        model.backward(cache)
        grads.append(model.gather_full(model.flat_grad))
    np.testing.assert_array_equal(grads[1], grads[0])


def class_token_vit():
    """The nn ViT on 6x6 images in 2x2 patches: 9 patches and the class token, 10 positions."""
    return ViT(ViTConfig(image_size=6, n_layer=2, n_head=4, n_embd=32), seed=0, dtype=np.float64)


@pytest.mark.parametrize("dp,tp,sp", [layout for layout in LAYOUTS if layout[2] < 4])
def test_the_nn_vit_with_a_class_token_matches_single_process(world, dp, tp, sp):
    mesh = mesh_or_skip(world, dp, tp, sp)
    reference = class_token_vit()
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((GLOBAL_BATCH, 6, 6, 1)), rng.integers(0, 10, GLOBAL_BATCH)
    engine = HybridParallel(TensorParallelModel(reference, mesh, dtype=np.float64))
    ref_loss, cache = reference.forward(x, y)
    reference.backward(cache)
    loss, grad = gradients(engine, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, reference.flat_grad, rtol=1e-10, atol=1e-14)


def classifier_of_tokens():
    return [Sequential(Embedding(V, C, "tok"), PositionalEmbedding(T, C, "pos")),
            ("h0", TransformerBlock(C, H, causal=False)),
            Sequential(("ln_f", LayerNorm(C)), ("head", ClassificationHead(C, K)))]


@pytest.mark.parametrize("dp,tp,sp", [layout for layout in LAYOUTS if layout[2] > 1])
def test_a_pooling_head_over_split_token_positions_matches_single_process(world, dp, tp, sp):
    """The tokens are split over sp from the start; the head gathers them."""
    mesh = mesh_or_skip(world, dp, tp, sp)
    x, _ = global_batch(0)
    y = np.random.default_rng(3).integers(0, K, GLOBAL_BATCH)
    ref_loss, ref_grad = reference_gradients(classifier_of_tokens(), x, y)
    engine = HybridParallel(TensorParallelModel(classifier_of_tokens(), mesh, dtype=np.float64))
    loss, grad = gradients(engine, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.mpi(min_size=4)
def test_a_class_token_vit_whose_positions_do_not_split_over_sp_is_refused(
        world, assert_raised_on_every_rank):
    if world.world_size != 4:
        pytest.skip("the layout dp=1 sp=4 needs 4 ranks")
    mesh = DeviceMesh(dp=1, sp=4, group=world)
    model = TensorParallelModel(class_token_vit(), mesh, dtype=np.float64)
    images = np.zeros((2, 6, 6, 1))
    error = assert_raised_on_every_rank(
        world, lambda: model.forward(images, np.zeros(2, np.int64), full_sequence=True),
        ConfigError)
    assert "10 positions per sample are not divisible by sp(4)" in str(error)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("units", [classifier_of_tokens, vit], ids=["tokens", "vit"])
def test_whole_sequence_modules_refuse_megatron_sequence_parallelism(world, units,
                                                                     assert_raised_on_every_rank):
    mesh = DeviceMesh(dp=1, tp=world.world_size, group=world)
    error = assert_raised_on_every_rank(
        world, lambda: TensorParallelModel(units(), mesh, sequence_parallel=True),
        ConfigError)
    assert "needs every position of a sample" in str(error)


@pytest.mark.mpi(min_size=2)
def test_a_whole_input_unit_after_a_whole_sequence_head_is_refused_under_sp(
        world, assert_raised_on_every_rank):
    mesh = DeviceMesh(dp=1, sp=world.world_size, group=world)
    units = [Sequential(("patch", PatchEmbedding(2, IMAGE[2], C)),
                        ("pool", ClassificationHead(C, C))),
             ClassToken(C), Sequential(("ln_f", LayerNorm(C)), ("head", ClassTokenHead(C, K)))]
    error = assert_raised_on_every_rank(world, lambda: TensorParallelModel(units, mesh),
                                        ConfigError)
    assert "whole-input units must all come before" in str(error)


class _Scale(Module):
    """y = x * s, s (C,) declared column-split but with no tensor-parallel version."""

    def param_specs(self):
        return [ParamDecl("s", (C,), False, "column", "ones")]

    def forward(self, params, x):
        return x * params[0], x

    def backward(self, params, grads, cache, dy):
        grads[0] += (dy * cache).sum(axis=(0, 1))
        return dy * params[0]


@pytest.mark.mpi(min_size=2)
def test_a_split_module_without_a_parallel_version_is_refused_under_tp(
        world, assert_raised_on_every_rank):
    mesh = DeviceMesh(dp=1, tp=world.world_size, group=world)
    units = [Sequential(Embedding(V, C, "tok"), ("scale", _Scale())),
             Sequential(("ln_f", LayerNorm(C)), LMHead(V, C, name="out"))]
    error = assert_raised_on_every_rank(world, lambda: TensorParallelModel(units, mesh),
                                        ConfigError)
    assert "_Scale declares tensor-parallel splits" in str(error)


def column_then_layernorm():
    """A LayerNorm between the column- and the row-split Linear: it would see 1/tp of the
    features."""
    return [Sequential(Embedding(V, C, "tok"), ("up", Linear(C, 2 * C, split="column")),
                       ("ln", LayerNorm(2 * C)), ("down", Linear(2 * C, C, split="row"))),
            Sequential(("ln_f", LayerNorm(C)), LMHead(V, C, name="out"))]


def column_without_row():
    return [Sequential(Embedding(V, C, "tok"), ("up", Linear(C, 2 * C, split="column"))),
            Sequential(("ln_f", LayerNorm(2 * C)), LMHead(V, 2 * C, name="out"))]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("units", [column_then_layernorm, column_without_row])
def test_a_column_linear_must_be_followed_by_a_row_linear_under_tp(world, units,
                                                                  assert_raised_on_every_rank):
    mesh = DeviceMesh(dp=1, tp=world.world_size, group=world)
    error = assert_raised_on_every_rank(world, lambda: TensorParallelModel(units(), mesh),
                                        ConfigError)
    assert "LayerNorm follows a column-split Linear" in str(error)
